// The device mesh and its communicator groups: the rank order, the errors for sizes that do not
// divide, the members of every group of a split job (under mpirun with 4 ranks), and the traffic
// each collective counts against the ring formulas, computed by hand. Transfers between two ranks:
// a ring, the neighbouring stages of a 2-stage pipeline, their order, dtypes and counts, and
// (a hidden case, run under mpirun -np 2 by tests/CMakeLists.txt) a recv that never completes.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
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

TEST_CASE("mesh: the context index comes after the tensor index, before data and stage", "[dist][mesh]") {
  const dist::Mesh mesh = dist::Mesh::of(16, 2, 2, 2);
  CHECK(mesh.data == 2);
  // Rank 13 = 1 + 2 (0 + 2 (1 + 2 x 1)): tensor 1, context 0, data 1, stage 1.
  CHECK(mesh.coord(13) == dist::Mesh::Coord{1, 1, 1, 0});
  // Rank 3 = 1 + 2 x 1: tensor 1, context 1.
  CHECK(mesh.coord(3) == dist::Mesh::Coord{1, 0, 0, 1});
  for (int r = 0; r < 16; ++r) CHECK(mesh.rank(mesh.coord(r)) == r);
  CHECK(mesh.describe() ==
        "16 rank(s) = tensor 2 x context 2 x data 2 x pipeline 2 (tensor index fastest, then context, then data, then stage)");
  CHECK_THROWS_WITH(dist::Mesh::of(12, 2, 1, 4),
                    "dist.tensor_parallel x dist.context_parallel x dist.pipeline_parallel (2 x 4 x 1 = 8) must divide "
                    "the number of ranks, 12");
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
  struct Shape { int tensor, pipeline, context; };
  for (const Shape shape : {Shape{1, 1, 1}, Shape{2, 1, 1}, Shape{1, 2, 1}, Shape{2, 2, 1}, Shape{4, 1, 1}, Shape{1, 4, 1},
                            Shape{1, 1, 2}, Shape{2, 1, 2}, Shape{1, 2, 2}, Shape{1, 1, 4}}) {
    if (W % (shape.tensor * shape.pipeline * shape.context) != 0) continue;
    const dist::Mesh mesh = dist::Mesh::of(W, shape.tensor, shape.pipeline, shape.context);
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
    for (int d = 0; d < mesh.data; ++d) {
      for (int c = 0; c < mesh.context; ++c) data.push_back(mesh.rank({at.tensor, d, at.pipeline, c}));
    }
    for (int t = 0; t < mesh.tensor; ++t) tensor.push_back(mesh.rank({t, at.data, at.pipeline, at.context}));
    for (int p = 0; p < mesh.pipeline; ++p) pipeline.push_back(mesh.rank({at.tensor, at.data, p, at.context}));
    for (int c = 0; c < mesh.context; ++c) context.push_back(mesh.rank({at.tensor, at.data, at.pipeline, c}));
    CHECK(members(comms.data_host()) == data);
    CHECK(members(*comms.tensor_group) == tensor);
    CHECK(members(*comms.pipeline_group) == pipeline);
    CHECK(members(*comms.context_group) == context);
    CHECK(comms.data_host().rank() == at.context + mesh.context * at.data);
    CHECK(comms.data_index() == at.data);
    CHECK(comms.context_group->rank() == at.context);
    CHECK(comms.tensor_group->rank() == at.tensor);

    // A sum over the data group adds the data group's ranks only.
    std::vector<float> sum = {float(me), 1.0f};
    comms.data_host().all_reduce_sum(sum.data(), 2);
    float expected = 0;
    for (int r : data) expected += float(r);
    CHECK(sum[0] == expected);
    CHECK(sum[1] == float(mesh.data * mesh.context));
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
  for (int k = 0; k <= dist::Traffic::barrier; ++k) CHECK(t.calls[k] == 1);
  CHECK(t.calls[dist::Traffic::send] == 0);
  CHECK(t.calls[dist::Traffic::recv] == 0);
}

namespace {

// What rank `from` sends as its `index`-th message: n floats, different for every sender,
// message and position.
std::vector<float> payload(int from, int index, std::size_t n) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = float(from) * 1000.0f + float(index) * 100.0f + float(i % 97) * 0.5f;
  return v;
}

// The upper 16 bits of each float of 2 x `v`: bf16 words (exact for these values) that depend on
// every element.
std::vector<std::uint16_t> doubled_bf16(const std::vector<float>& v) {
  std::vector<std::uint16_t> words(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) {
    const float twice = 2.0f * v[i];
    std::uint32_t bits = 0;
    std::memcpy(&bits, &twice, 4);
    words[i] = std::uint16_t(bits >> 16);
  }
  return words;
}

}  // namespace

TEST_CASE("transfers: one rank has no peer", "[dist][mesh]") {
  auto single = dist::make_single_communicator();
  std::vector<float> x(4, 1.0f), y(4);
  CHECK_THROWS_WITH(single->start_send(x.data(), 4, DType::f32, 0), "send: no peer on a one-rank communicator");
  CHECK_THROWS_WITH(single->recv(y.data(), 4, DType::f32, 0), "recv: no peer on a one-rank communicator");
  CHECK_THROWS_WITH(single->start_exchange(x.data(), y.data(), 4, DType::f32, 0),
                    "exchange (send): no peer on a one-rank communicator");
  CHECK_THROWS_AS(single->send(x.data(), 4, DType::f32, 1), RuntimeError);
  CHECK(single->traffic().total_calls() == 0);  // refused calls are not counted
}

// Under mpirun -np 4 (alone: the one-rank refusal only).
TEST_CASE("transfers: a ring of ranks, each sending on while it receives, in order and in every dtype",
          "[dist][mesh][mpi]") {
  const int W = job().world_size(), me = job().rank();
  auto comm = job().split(0, me);
  if (W == 1) {
    std::vector<float> x(4);
    CHECK_THROWS_WITH(comm->start_recv(x.data(), 4, DType::f32, 0), "recv: no peer on a one-rank communicator");
    return;
  }
  const int next = (me + 1) % W, prev = (me + W - 1) % W;
  // 1 MiB: past MPI's eager limit, so a send completes only once its receive is posted.
  const std::size_t n = std::size_t(1) << 18;
  const std::vector<float> mine = payload(me, 0, n);
  std::vector<float> got(n, -1.0f);
  auto sent = comm->start_send(mine.data(), std::int64_t(n), DType::f32, next);
  auto received = comm->start_recv(got.data(), std::int64_t(n), DType::f32, prev);
  received->wait();
  sent->wait();
  CHECK(got == payload(prev, 0, n));

  // The other way round, as one exchange.
  comm->start_exchange(mine.data(), got.data(), std::int64_t(n), DType::f32, prev, next)->wait();
  CHECK(got == payload(next, 0, n));

  // Both directions in one group (a pipeline stage's start_transfers): a large message to the
  // next rank and a bf16 one to the previous, and theirs received.
  {
    const std::size_t k = 17;
    const std::vector<std::uint16_t> back = doubled_bf16(payload(me, 4, k));
    std::vector<float> from_prev(n, -1.0f);
    std::vector<std::uint16_t> from_next(k, 0xffff);
    comm->start_transfers({{dist::PeerTransfer::send, const_cast<float*>(mine.data()), std::int64_t(n), DType::f32, next},
                           {dist::PeerTransfer::send, const_cast<std::uint16_t*>(back.data()), std::int64_t(k), DType::bf16, prev},
                           {dist::PeerTransfer::recv, from_prev.data(), std::int64_t(n), DType::f32, prev},
                           {dist::PeerTransfer::recv, from_next.data(), std::int64_t(k), DType::bf16, next}})
        ->wait();
    CHECK(from_prev == payload(prev, 0, n));
    CHECK(from_next == doubled_bf16(payload(next, 4, k)));
  }

  // Several messages between the same two ranks meet in the order they were started.
  const std::size_t m = 33;
  const std::vector<float> first = payload(me, 1, m), second = payload(me, 2, m);
  std::vector<float> got1(m), got2(m);
  auto r1 = comm->start_recv(got1.data(), std::int64_t(m), DType::f32, prev);
  auto r2 = comm->start_recv(got2.data(), std::int64_t(m), DType::f32, prev);
  auto s1 = comm->start_send(first.data(), std::int64_t(m), DType::f32, next);
  auto s2 = comm->start_send(second.data(), std::int64_t(m), DType::f32, next);
  r2->wait();  // waited for out of order: each request is its own
  r1->wait();
  s1->wait();
  s2->wait();
  CHECK(got1 == payload(prev, 1, m));
  CHECK(got2 == payload(prev, 2, m));

  // bf16 and i32 travel unchanged.
  const std::vector<std::uint16_t> words = doubled_bf16(payload(me, 3, m));
  std::vector<std::uint16_t> got_words(m, 0xffff);
  comm->start_exchange(words.data(), got_words.data(), std::int64_t(m), DType::bf16, next, prev)->wait();
  CHECK(got_words == doubled_bf16(payload(prev, 3, m)));
  std::vector<std::int32_t> ints(m), got_ints(m, 0);
  for (std::size_t i = 0; i < m; ++i) ints[i] = std::int32_t((me + 1) * 100000 + int(i)) * (i % 2 ? -1 : 1);
  comm->start_exchange(ints.data(), got_ints.data(), std::int64_t(m), DType::i32, next, prev)->wait();
  for (std::size_t i = 0; i < m; ++i) CHECK(got_ints[i] == std::int32_t((prev + 1) * 100000 + int(i)) * (i % 2 ? -1 : 1));

  // Peers that are not another rank of the group.
  CHECK_THROWS_WITH(comm->start_send(mine.data(), 1, DType::f32, W),
                    "send: peer rank " + std::to_string(W) + " is not in this group of " + std::to_string(W) + " ranks");
  CHECK_THROWS_WITH(comm->start_recv(got.data(), 1, DType::f32, me), "recv: rank " + std::to_string(me) + " is this rank");
  CHECK_THROWS_WITH(comm->start_send(mine.data(), -1, DType::f32, next), "send: negative count -1");
}

TEST_CASE("transfers: neighbouring stages of a 2-stage pipeline pass activations forward and bf16 gradients back",
          "[dist][mesh][mpi]") {
  const int W = job().world_size(), me = job().rank();
  if (W % 2 != 0) {
    CHECK_THROWS_AS(dist::Mesh::of(W, 1, 2), InputError);
    return;
  }
  const dist::Mesh mesh = dist::Mesh::of(W, 1, 2);  // 4 ranks: data 2 x pipeline 2
  const dist::Communicators comms = dist::split_mesh(job().split(0, me), mesh);
  dist::Communicator& pipe = *comms.pipeline_group;
  const dist::Mesh::Coord at = mesh.coord(me);
  const int stage = at.pipeline, other = 1 - stage;
  const int partner = mesh.rank({at.tensor, at.data, other});  // the job rank of the other stage
  REQUIRE(pipe.rank() == stage);
  CHECK(pipe.job_rank(other) == partner);
  CHECK(pipe.job_rank(stage) == me);

  // 1F1B's traffic for 3 micro-batches: every receive is posted before the data is due; stage 1
  // doubles each activation (as bf16 words) and sends that back as its gradient.
  const int micro = 3;
  const std::size_t n = 1000;
  std::vector<std::vector<float>> activations(micro, std::vector<float>(n, -1.0f));
  std::vector<std::vector<std::uint16_t>> gradients(micro, std::vector<std::uint16_t>(n, 0xffff));
  std::vector<std::unique_ptr<dist::Request>> receives, sends;
  if (stage == 0) {
    for (int i = 0; i < micro; ++i) {
      receives.push_back(pipe.start_recv(gradients[std::size_t(i)].data(), std::int64_t(n), DType::bf16, 1));
    }
    for (int i = 0; i < micro; ++i) {
      activations[std::size_t(i)] = payload(me, i, n);
      sends.push_back(pipe.start_send(activations[std::size_t(i)].data(), std::int64_t(n), DType::f32, 1));
    }
  } else {
    for (int i = 0; i < micro; ++i) {
      receives.push_back(pipe.start_recv(activations[std::size_t(i)].data(), std::int64_t(n), DType::f32, 0));
    }
    for (int i = 0; i < micro; ++i) {
      receives[std::size_t(i)]->wait();
      gradients[std::size_t(i)] = doubled_bf16(activations[std::size_t(i)]);
      sends.push_back(pipe.start_send(gradients[std::size_t(i)].data(), std::int64_t(n), DType::bf16, 0));
    }
  }
  if (stage == 0) {
    for (auto& r : receives) r->wait();
  }
  for (auto& s : sends) s->wait();
  for (int i = 0; i < micro; ++i) {
    CAPTURE(stage, i);
    const int sender = stage == 0 ? me : partner;  // whose activations these are
    CHECK(activations[std::size_t(i)] == payload(sender, i, n));
    CHECK(gradients[std::size_t(i)] == doubled_bf16(payload(sender, i, n)));
  }

  // Counted on the pipeline group: what each stage sent, by its element size; receives send nothing.
  const dist::Traffic& t = pipe.traffic();
  CHECK(t.calls[dist::Traffic::send] == micro);
  CHECK(t.calls[dist::Traffic::recv] == micro);
  CHECK(t.bytes[dist::Traffic::send] == double(micro) * double(n) * (stage == 0 ? 4.0 : 2.0));
  CHECK(t.bytes[dist::Traffic::recv] == 0.0);
  CHECK(t.total_calls() == 2 * micro);
  CHECK(std::string(dist::Traffic::name(dist::Traffic::send)) == "send");
  CHECK(std::string(dist::Traffic::name(dist::Traffic::recv)) == "recv");

  // The blocking forms, and each group's own ranks: the data group's partner is another replica.
  if (mesh.data > 1) {
    dist::Communicator& data = comms.data_host();
    const int peer = at.data ^ 1;  // pairs of replicas
    if (peer < mesh.data) {
      std::vector<float> got(5, 0.0f);
      if (at.data % 2 == 0) {
        data.send(payload(me, 9, 5).data(), 5, DType::f32, peer);
        data.recv(got.data(), 5, DType::f32, peer);
      } else {
        data.recv(got.data(), 5, DType::f32, peer);
        data.send(payload(me, 9, 5).data(), 5, DType::f32, peer);
      }
      CHECK(got == payload(mesh.rank({at.tensor, peer, at.pipeline}), 9, 5));
      CHECK(data.traffic().bytes[dist::Traffic::send] == 20.0);
    }
  }
}

// Hidden: run by tests/CMakeLists.txt under mpirun -np 2, which expects the job to stop with the
// message within a few seconds. Rank 1 waits for a message rank 0 never sends; rank 0 sleeps.
TEST_CASE("transfers: a recv from a rank that never sends stops the job, naming both", "[.][p2p_timeout]") {
  const auto comm = dist::make_communicator(false, 1.0);
  REQUIRE(comm->world_size() == 2);
  comm->set_rank_noun("stage");
  if (comm->rank() == 1) {
    std::vector<float> x(16);
    comm->recv(x.data(), 16, DType::f32, 0);
    FAIL("the recv returned");
  }
  std::this_thread::sleep_for(std::chrono::seconds(30));
  FAIL("rank 0 was not stopped");
}
