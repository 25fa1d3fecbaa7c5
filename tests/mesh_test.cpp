// The device mesh and its communicator groups: the rank order, the errors for sizes that do not
// divide, the members of every group of a split job (under mpirun with 4 ranks), and the traffic
// each collective counts against the ring formulas, computed by hand.
#include <algorithm>
#include <cmath>
#include <vector>

#include "catch_compat.h"
#include "core/error.h"
#include "dist/communicator.h"
#include "dist/mesh.h"

using namespace llmtrain;

namespace {

// The job's communicator, made once: MPI starts once per process and stops at exit.
dist::Communicator& job() {
  static const std::unique_ptr<dist::Communicator> comm = dist::make_communicator(false, 60.0);
  return *comm;
}

}  // namespace

TEST_CASE("mesh: the tensor index varies fastest, then data, then the stage", "[dist][mesh]") {
  const dist::Mesh mesh = dist::Mesh::of(12, 2, 3);
  CHECK(mesh.data == 2);
  CHECK(mesh.world() == 12);
  // Rank 7 = 1 + 2 (1 + 2 x 1): tensor 1, data 1, stage 1.
  CHECK(mesh.coord(7) == dist::Mesh::Coord{1, 1, 1});
  CHECK(mesh.coord(5) == dist::Mesh::Coord{1, 0, 1});
  CHECK(mesh.coord(2) == dist::Mesh::Coord{0, 1, 0});
  for (int r = 0; r < 12; ++r) CHECK(mesh.rank(mesh.coord(r)) == r);
  CHECK(mesh.describe() == "12 rank(s) = tensor 2 x data 2 x pipeline 3 (tensor index fastest, then data, then stage)");
}

TEST_CASE("mesh: sizes that do not divide the world are refused naming both keys", "[dist][mesh]") {
  CHECK_THROWS_WITH(dist::Mesh::of(6, 4, 1),
                    "dist.tensor_parallel x dist.pipeline_parallel (4 x 1 = 4) must divide the number of ranks, 6");
  CHECK_THROWS_AS(dist::Mesh::of(8, 0, 1), InputError);
  CHECK(dist::Mesh::of(1, 1, 1).data == 1);
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
  struct Shape { int tensor, pipeline; };
  for (const Shape shape : {Shape{1, 1}, Shape{2, 1}, Shape{1, 2}, Shape{2, 2}, Shape{4, 1}, Shape{1, 4}}) {
    if (W % (shape.tensor * shape.pipeline) != 0) continue;
    const dist::Mesh mesh = dist::Mesh::of(W, shape.tensor, shape.pipeline);
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
    std::vector<int> data, tensor, pipeline;
    for (int d = 0; d < mesh.data; ++d) data.push_back(mesh.rank({at.tensor, d, at.pipeline}));
    for (int t = 0; t < mesh.tensor; ++t) tensor.push_back(mesh.rank({t, at.data, at.pipeline}));
    for (int p = 0; p < mesh.pipeline; ++p) pipeline.push_back(mesh.rank({at.tensor, at.data, p}));
    CHECK(members(comms.data_host()) == data);
    CHECK(members(*comms.tensor_group) == tensor);
    CHECK(members(*comms.pipeline_group) == pipeline);
    CHECK(comms.data_host().rank() == at.data);
    CHECK(comms.tensor_group->rank() == at.tensor);

    // A sum over the data group adds the data group's ranks only.
    std::vector<float> sum = {float(me), 1.0f};
    comms.data_host().all_reduce_sum(sum.data(), 2);
    float expected = 0;
    for (int r : data) expected += float(r);
    CHECK(sum[0] == expected);
    CHECK(sum[1] == float(mesh.data));
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
  const dist::Traffic& t = comm->traffic();
  // By hand, 4-byte floats over n ranks: an all-reduce of 4000 bytes sends 2 (n-1)/n of them; a
  // reduce-scatter or all-gather of n shards of 4000 bytes sends the n-1 shards it does not own.
  CHECK(std::abs(t.bytes[dist::Traffic::all_reduce] - (2.0 * (n - 1) / n * 4000)) < 1e-6);
  CHECK(std::abs(t.bytes[dist::Traffic::reduce_scatter] - (4000.0 * (n - 1))) < 1e-6);
  CHECK(std::abs(t.bytes[dist::Traffic::all_gather] - (4000.0 * (n - 1))) < 1e-6);
  CHECK(std::abs(t.bytes[dist::Traffic::broadcast] - (4000.0 * (n - 1) / n)) < 1e-6);
  CHECK(t.bytes[dist::Traffic::barrier] == 0.0);
  CHECK(t.total_calls() == 5);
  for (int k = 0; k < dist::Traffic::kinds; ++k) CHECK(t.calls[k] == 1);
}
