// The device mesh and its communicator groups: the rank order, the errors for sizes that do not
// divide, the members of every group of a split job, and the traffic each collective counts.
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "catch_compat.h"
#include "core/error.h"
#include "dist/communicator.h"
#include "dist/mesh.h"
#include "mesh_check.h"

using namespace llmtrain;

using llmtrain::dist::Axis;
using llmtrain::test::job;
using llmtrain::test::mesh_of;
using llmtrain::test::place;

TEST_CASE("mesh: the tensor index varies fastest, then data, then the stage", "[dist][mesh]") {
  const dist::Mesh mesh = mesh_of(12, 2, 3);
  CHECK(mesh.size(Axis::data) == 2);
  CHECK(mesh.world() == 12);
  // Rank 7 = 1 + 2 (1 + 2 x 1): tensor 1, data 1, stage 1.
  CHECK(mesh.coord(7) == place(1, 1, 1));
  CHECK(mesh.coord(5) == place(1, 0, 1));
  CHECK(mesh.coord(2) == place(0, 1, 0));
  for (int r = 0; r < 12; ++r) CHECK(mesh.rank(mesh.coord(r)) == r);
  CHECK(mesh.describe() == "12 rank(s) = tensor 2 x data 2 x pipeline 3 (tensor index fastest, then data, then stage)");
}

TEST_CASE("mesh: the context index comes after the tensor index, before data and stage", "[dist][mesh]") {
  const dist::Mesh mesh = mesh_of(16, 2, 2, 2);
  CHECK(mesh.size(Axis::data) == 2);
  // Rank 13 = 1 + 2 (0 + 2 (1 + 2 x 1)): tensor 1, context 0, data 1, stage 1.
  CHECK(mesh.coord(13) == place(1, 1, 1, 0));
  // Rank 3 = 1 + 2 x 1: tensor 1, context 1.
  CHECK(mesh.coord(3) == place(1, 0, 0, 1));
  for (int r = 0; r < 16; ++r) CHECK(mesh.rank(mesh.coord(r)) == r);
  CHECK(mesh.describe() ==
        "16 rank(s) = tensor 2 x context 2 x data 2 x pipeline 2 (tensor index fastest, then context, then data, then stage)");
  CHECK_THROWS_WITH(mesh_of(12, 2, 1, 4),
                    "dist.tensor_parallel x dist.context_parallel x dist.pipeline_parallel (2 x 4 x 1 = 8) must divide "
                    "the number of ranks, 12");
}

TEST_CASE("mesh: sizes that do not divide the world are refused naming both keys", "[dist][mesh]") {
  CHECK_THROWS_WITH(mesh_of(6, 4, 1),
                    "dist.tensor_parallel x dist.pipeline_parallel (4 x 1 = 4) must divide the number of ranks, 6");
  CHECK_THROWS_AS(mesh_of(8, 0, 1), InputError);
  CHECK(mesh_of(1, 1, 1).size(Axis::data) == 1);
}

TEST_CASE("traffic: one process sends nothing, but every call is counted", "[dist][mesh]") {
  auto single = dist::make_single_communicator();
  std::vector<float> data(10, 1.0f);
  single->all_reduce_sum(data.data(), 10);
  single->all_gather(data.data(), data.data(), 10);
  single->barrier();
  CHECK(single->traffic().total_calls() == 3);
  CHECK(single->traffic().total_bytes() == 0.0);
  CHECK(single->split(3, 0)->world_size() == 1);
}

// Under mpirun -np 4 (alone, world size 1: only the 1 x 1 x 1 mesh applies).
TEST_CASE("mesh: every group of a split job holds the ranks that share the other coordinates", "[dist][mesh][mpi]") {
  const int W = job().world_size(), me = job().rank();
  struct Shape { int tensor, pipeline, context; };
  for (const Shape shape : {Shape{1, 1, 1}, Shape{2, 1, 1}, Shape{1, 2, 1}, Shape{2, 2, 1}, Shape{4, 1, 1}, Shape{1, 4, 1},
                            Shape{1, 1, 2}, Shape{2, 1, 2}, Shape{1, 2, 2}, Shape{1, 1, 4}}) {
    if (W % (shape.tensor * shape.pipeline * shape.context) != 0) continue;
    const dist::Mesh mesh = mesh_of(W, shape.tensor, shape.pipeline, shape.context);
    CAPTURE(mesh.describe());
    const dist::Communicators comms = dist::split_mesh(job().split(0, me), mesh);
    REQUIRE(comms.world->rank() == me);
    const dist::Mesh::Coord at = mesh.coord(me);

    // Each group's members, gathered in group order, against the mesh's own arithmetic.
    auto members = [&](dist::Communicator& group) {
      std::vector<float> all(std::size_t(group.world_size()));
      const float mine = float(me);
      group.all_gather(&mine, all.data(), 1);
      return std::vector<int>(all.begin(), all.end());
    };
    // The data-parallel group holds the context and data axes, context index fastest.
    std::vector<int> data, tensor, pipeline, context;
    for (int d = 0; d < mesh.size(Axis::data); ++d) {
      for (int c = 0; c < mesh.size(Axis::context); ++c) {
        data.push_back(mesh.rank(place(at[Axis::tensor], d, at[Axis::pipeline], c)));
      }
    }
    const int t0 = at[Axis::tensor], d0 = at[Axis::data], p0 = at[Axis::pipeline], c0 = at[Axis::context];
    for (int t = 0; t < mesh.size(Axis::tensor); ++t) tensor.push_back(mesh.rank(place(t, d0, p0, c0)));
    for (int p = 0; p < mesh.size(Axis::pipeline); ++p) pipeline.push_back(mesh.rank(place(t0, d0, p, c0)));
    for (int c = 0; c < mesh.size(Axis::context); ++c) context.push_back(mesh.rank(place(t0, d0, p0, c)));
    CHECK(members(comms.host(Axis::data)) == data);
    CHECK(members(comms.host(Axis::tensor)) == tensor);
    CHECK(members(comms.host(Axis::pipeline)) == pipeline);
    CHECK(members(comms.host(Axis::context)) == context);
    CHECK(comms.host(Axis::data).rank() == at[Axis::context] + mesh.size(Axis::context) * at[Axis::data]);
    CHECK(comms.data_index() == at[Axis::data]);
    CHECK(comms.host(Axis::context).rank() == at[Axis::context]);
    CHECK(comms.host(Axis::tensor).rank() == at[Axis::tensor]);

    // A sum over the data group adds the data group's ranks only.
    std::vector<float> sum = {float(me), 1.0f};
    comms.host(Axis::data).all_reduce_sum(sum.data(), 2);
    float expected = 0;
    for (int r : data) expected += float(r);
    CHECK(sum[0] == expected);
    CHECK(sum[1] == float(mesh.size(Axis::data) * mesh.size(Axis::context)));
  }
}

TEST_CASE("traffic: each collective counts the bytes of the ring algorithm", "[dist][mesh][mpi]") {
  auto comm = job().split(0, job().rank());  // a fresh group: nothing counted yet
  const int n = comm->world_size();
  const std::int64_t count = 1000;
  std::vector<float> data(static_cast<std::size_t>(count * n), 1.0f);
  std::vector<float> shard(static_cast<std::size_t>(count));
  comm->all_reduce_sum(data.data(), count);
  comm->reduce_scatter_sum(data.data(), shard.data(), count);
  comm->all_gather(shard.data(), data.data(), count);
  comm->broadcast(data.data(), count, 0);
  comm->barrier();
  // An all-to-all of 10 (r + 1) floats to each rank r: this rank's own part stays.
  std::vector<std::int64_t> to_each(static_cast<std::size_t>(n)), from_each(static_cast<std::size_t>(n), 10 * (comm->rank() + 1));
  std::int64_t total = 0;
  for (int r = 0; r < n; ++r) total += (to_each[std::size_t(r)] = 10 * (r + 1));
  std::vector<float> out(std::size_t(total), 1.0f), in(std::size_t(10 * (comm->rank() + 1) * n));
  comm->all_to_all(out.data(), to_each, in.data(), from_each, DType::f32);
  const dist::Traffic& t = comm->traffic();
  CHECK(std::abs(t.bytes[dist::Traffic::all_to_all] - 4.0 * double(total - 10 * (comm->rank() + 1))) < 1e-6);
  CHECK(t.calls[dist::Traffic::all_to_all] == 1);
  // By hand, 4-byte floats over n ranks: an all-reduce of 4000 bytes sends 2 (n-1)/n of them; a
  // reduce-scatter or all-gather of n shards of 4000 bytes sends the n-1 shards it does not own.
  CHECK(std::abs(t.bytes[dist::Traffic::all_reduce] - (2.0 * (n - 1) / n * 4000)) < 1e-6);
  CHECK(std::abs(t.bytes[dist::Traffic::reduce_scatter] - (4000.0 * (n - 1))) < 1e-6);
  CHECK(std::abs(t.bytes[dist::Traffic::all_gather] - (4000.0 * (n - 1))) < 1e-6);
  CHECK(std::abs(t.bytes[dist::Traffic::broadcast] - (4000.0 * (n - 1) / n)) < 1e-6);
  CHECK(t.bytes[dist::Traffic::barrier] == 0.0);
  CHECK(t.total_calls() == 6);
  for (int k = 0; k <= dist::Traffic::barrier; ++k) CHECK(t.calls[k] == 1);
  CHECK(t.calls[dist::Traffic::send] == 0);
  CHECK(t.calls[dist::Traffic::recv] == 0);
}
