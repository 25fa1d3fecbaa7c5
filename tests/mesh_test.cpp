// The device mesh and its communicator groups: the rank order, the errors for sizes that do not
// divide, the members of every group of a split job (under mpirun with 4 ranks), and the traffic
// each collective counts against the ring formulas, computed by hand; every collective (the
// all-to-all of varying counts included) against its definition, whole and in pieces. Transfers between two ranks:
// a ring, the neighbouring stages of a 2-stage pipeline, their order, dtypes and counts, and
// (hidden cases, run under mpirun by tests/CMakeLists.txt) a recv that never completes, and lost
// ranks named while a live one waits in another group.
#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "catch_compat.h"
#include "core/error.h"
#include "dist/communicator.h"
#include "dist/mesh.h"
#ifdef LLMTRAIN_MPI_CALL_LOG
#include "mpi_call_log.h"
#endif

using namespace llmtrain;

using llmtrain::dist::Axis;

namespace {

// The job's communicator, made once: MPI starts once per process and stops at exit.
dist::Communicator& job() {
  static const std::unique_ptr<dist::Communicator> comm = dist::make_communicator(false, 60.0);
  return *comm;
}

// The mesh of W ranks for tensor, pipeline and context sizes, and a place on it, as the tests
// below spell them (the mesh's own table orders the axes tensor, context, data, pipeline).
dist::Mesh mesh_of(int W, int tensor, int pipeline, int context = 1) {
  return dist::Mesh::of(W, {{Axis::tensor, tensor}, {Axis::pipeline, pipeline}, {Axis::context, context}});
}
dist::Mesh::Coord place(int tensor, int data, int pipeline, int context = 0) {
  dist::Mesh::Coord c;
  c[Axis::tensor] = tensor;
  c[Axis::data] = data;
  c[Axis::pipeline] = pipeline;
  c[Axis::context] = context;
  return c;
}

// This process's rank in the job, as mpirun numbers it (before any communicator exists).
int job_rank_from_env() {
  const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
  return rank ? std::atoi(rank) : 0;
}

}  // namespace

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
  // Finished in stream order (context parallelism's ring): over host memory, waited for.
  std::vector<float> queued(n, -1.0f);
  comm->start_exchange(mine.data(), queued.data(), std::int64_t(n), DType::f32, next, prev)->queue_wait();
  CHECK(queued == payload(prev, 0, n));

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
    CHECK_THROWS_AS(mesh_of(W, 1, 2), InputError);
    return;
  }
  const dist::Mesh mesh = mesh_of(W, 1, 2);  // 4 ranks: data 2 x pipeline 2
  const dist::Communicators comms = dist::split_mesh(job().split(0, me), mesh);
  dist::Communicator& pipe = comms.host(Axis::pipeline);
  const dist::Mesh::Coord at = mesh.coord(me);
  const int stage = at[Axis::pipeline], other = 1 - stage;
  const int partner = mesh.rank(place(at[Axis::tensor], at[Axis::data], other));  // the job rank of the other stage
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
  if (mesh.size(Axis::data) > 1) {
    dist::Communicator& data = comms.host(Axis::data);
    const int peer = at[Axis::data] ^ 1;  // pairs of replicas
    if (peer < mesh.size(Axis::data)) {
      std::vector<float> got(5, 0.0f);
      if (at[Axis::data] % 2 == 0) {
        data.send(payload(me, 9, 5).data(), 5, DType::f32, peer);
        data.recv(got.data(), 5, DType::f32, peer);
      } else {
        data.recv(got.data(), 5, DType::f32, peer);
        data.send(payload(me, 9, 5).data(), 5, DType::f32, peer);
      }
      CHECK(got == payload(mesh.rank(place(at[Axis::tensor], peer, at[Axis::pipeline])), 9, 5));
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

// Ranks 2 and 3 hang (SIGSTOP) while rank 1, alive, waits in a collective of another group ({2, 1},
// where rank 2 is the group's rank 0 and takes its heartbeats). Rank 0, in a collective of the
// whole job, hears none of the three; it must name ranks 2 and 3 alone, since rank 1 answers the
// roll call. Rank 0's timeout (4 s) is the shortest, so it is the one that stops the job.
TEST_CASE("lost ranks: a rank alive in another group's collective is not named lost", "[.][lost_elsewhere]") {
  const int me = job_rank_from_env();
  const auto comm = dist::make_communicator(false, me == 0 ? 4.0 : 30.0);
  REQUIRE(comm->world_size() == 4);
  const bool pair = me == 1 || me == 2;
  const auto group = comm->split(pair ? 0 : 1, me == 2 ? 0 : 1);
  if (me >= 2) raise(SIGSTOP);
  std::vector<float> x(16, 1.0f);
  if (me == 1) {
    group->all_reduce_sum(x.data(), 16);
  } else {
    comm->all_reduce_sum(x.data(), 16);
  }
  FAIL("the collective returned");
}

namespace {

// Sets LLMTRAIN_COMM_MAX_ELEMENTS for its lifetime (every rank the same), unset afterwards.
class PieceLimit {
 public:
  explicit PieceLimit(const char* value) { setenv("LLMTRAIN_COMM_MAX_ELEMENTS", value, 1); }
  ~PieceLimit() { unsetenv("LLMTRAIN_COMM_MAX_ELEMENTS"); }
  PieceLimit(const PieceLimit&) = delete;
  PieceLimit& operator=(const PieceLimit&) = delete;
};

// Rank `rank`'s element i (stream `salt`): a float in [-1, 1) with a full mantissa, so that sums
// round and the order of additions shows in the last bits.
float noise(int rank, std::int64_t i, int salt) {
  std::uint64_t x = std::uint64_t(rank + 1) * 0x9E3779B97F4A7C15ull ^ std::uint64_t(i + 1) * 0xBF58476D1CE4E5B9ull ^
                    std::uint64_t(salt + 1) * 0x94D049BB133111EBull;
  x ^= x >> 31;
  x *= 0xD6E9F8CC2D0C1F95ull;
  x ^= x >> 29;
  return float(double(x >> 11) / double(1ull << 53) * 2.0 - 1.0);
}

std::vector<float> noise_vector(int rank, std::int64_t n, int salt) {
  std::vector<float> v(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) v[std::size_t(i)] = noise(rank, i, salt);
  return v;
}

template <class T>
std::vector<char> bytes_of(const std::vector<T>& v) {
  std::vector<char> out(v.size() * sizeof(T));
  if (!v.empty()) std::memcpy(out.data(), v.data(), out.size());
  return out;
}

// Every collective and transfer of `comm` on n elements per rank (per shard), each result's bytes
// in order; each is also checked against its definition, computed here from every rank's inputs
// (sums in double: within float rounding).
std::vector<std::vector<char>> every_call(dist::Communicator& comm, std::int64_t n) {
  const int W = comm.world_size(), me = comm.rank();
  const std::size_t un = std::size_t(n);
  std::vector<std::vector<char>> out;
  const auto sum_of = [&](std::int64_t i, int salt) {
    double s = 0;
    for (int r = 0; r < W; ++r) s += noise(r, i, salt);
    return s;
  };
  {  // all-reduce sum, f32, blocking and started
    std::vector<float> a = noise_vector(me, n, 1), b = noise_vector(me, n, 2);
    comm.all_reduce_sum(a.data(), n);
    comm.start_all_reduce_sum(b.data(), n)->wait();
    for (std::int64_t i = 0; i < n; ++i) {
      REQUIRE(std::abs(a[std::size_t(i)] - sum_of(i, 1)) <= 1e-6 * W);
      REQUIRE(std::abs(b[std::size_t(i)] - sum_of(i, 2)) <= 1e-6 * W);
    }
    out.push_back(bytes_of(a));
    out.push_back(bytes_of(b));
  }
  {  // all-reduce sum, f64; max, i64 and f32
    std::vector<double> d(un);
    std::vector<std::int64_t> k(un);
    std::vector<float> m = noise_vector(me, n, 4);
    for (std::size_t i = 0; i < un; ++i) {
      d[i] = double(noise(me, std::int64_t(i), 3)) / 3.0;
      k[i] = std::int64_t(noise(me, std::int64_t(i), 5) * 1e9);
    }
    comm.all_reduce_sum(d.data(), n);
    comm.all_reduce_max(k.data(), n);
    comm.all_reduce_max(m.data(), n);
    for (std::int64_t i = 0; i < n; ++i) {
      float fm = -2;
      std::int64_t km = std::numeric_limits<std::int64_t>::min();
      for (int r = 0; r < W; ++r) {
        fm = std::max(fm, noise(r, i, 4));
        km = std::max(km, std::int64_t(noise(r, i, 5) * 1e9));
      }
      REQUIRE(std::abs(d[std::size_t(i)] - sum_of(i, 3) / 3.0) <= 1e-12 * W);
      REQUIRE(m[std::size_t(i)] == fm);
      REQUIRE(k[std::size_t(i)] == km);
    }
    out.push_back(bytes_of(d));
    out.push_back(bytes_of(k));
    out.push_back(bytes_of(m));
  }
  {  // reduce-scatter: element i of rank r's block b is noise(r, b * n + i)
    const std::vector<float> send = noise_vector(me, W * n, 6);
    std::vector<float> recv(un, -7.0f);
    comm.start_reduce_scatter_sum(send.data(), recv.data(), n)->wait();
    for (std::int64_t i = 0; i < n; ++i) REQUIRE(std::abs(recv[std::size_t(i)] - sum_of(me * n + i, 6)) <= 1e-6 * W);
    out.push_back(bytes_of(recv));
  }
  {  // all-gather: f32 from a buffer of its own and in place; bf16 words
    const std::vector<float> mine = noise_vector(me, n, 7);
    std::vector<float> all(std::size_t(W) * un, -7.0f), in_place(std::size_t(W) * un, -7.0f);
    std::copy(mine.begin(), mine.end(), in_place.begin() + std::ptrdiff_t(me * n));
    comm.all_gather(mine.data(), all.data(), n);
    comm.all_gather(in_place.data() + me * n, in_place.data(), n);
    std::vector<std::uint16_t> words(un), gathered(std::size_t(W) * un, 0xffff);
    for (std::size_t i = 0; i < un; ++i) words[i] = std::uint16_t(me * 4099 + int(i) * 13);
    comm.start_all_gather(words.data(), gathered.data(), n, DType::bf16)->wait();
    for (int r = 0; r < W; ++r) {
      for (std::int64_t i = 0; i < n; ++i) {
        const std::size_t at = std::size_t(r * n + i);
        REQUIRE(all[at] == noise(r, i, 7));
        REQUIRE(in_place[at] == noise(r, i, 7));
        REQUIRE(gathered[at] == std::uint16_t(r * 4099 + int(i) * 13));
      }
    }
    out.push_back(bytes_of(all));
    out.push_back(bytes_of(in_place));
    out.push_back(bytes_of(gathered));
  }
  {  // broadcast from the last rank
    std::vector<float> b = noise_vector(me, n, 8);
    comm.broadcast(b.data(), n, W - 1);
    REQUIRE(b == noise_vector(W - 1, n, 8));
    out.push_back(bytes_of(b));
  }
  {  // all-to-all of varying counts (some 0): rank r sends rank s c(r, s) elements, element j being
     // noise(r, s n + j); f32 and i32
    const auto c = [&](int r, int s) { return n == 0 ? std::int64_t(0) : (n + 3 * r + 2 * s) % (n + 1); };
    std::vector<std::int64_t> send_counts(static_cast<std::size_t>(W)), recv_counts(static_cast<std::size_t>(W));
    std::vector<float> send;
    for (int s = 0; s < W; ++s) {
      send_counts[std::size_t(s)] = c(me, s);
      recv_counts[std::size_t(s)] = c(s, me);
      for (std::int64_t j = 0; j < c(me, s); ++j) send.push_back(noise(me, s * n + j, 10));
    }
    std::int64_t received = 0;
    for (const std::int64_t k : recv_counts) received += k;
    std::vector<float> recv(std::size_t(received), -7.0f);
    std::vector<std::int32_t> isend(send.size()), irecv(recv.size(), -7);
    for (std::size_t i = 0; i < send.size(); ++i) isend[i] = std::int32_t(send[i] * 1e6f);
    comm.start_all_to_all(send.data(), send_counts, recv.data(), recv_counts, DType::f32)->wait();
    comm.all_to_all(isend.data(), send_counts, irecv.data(), recv_counts, DType::i32);
    std::size_t at = 0;
    for (int r = 0; r < W; ++r) {
      for (std::int64_t j = 0; j < c(r, me); ++j, ++at) {
        REQUIRE(recv[at] == noise(r, me * n + j, 10));
        REQUIRE(irecv[at] == std::int32_t(noise(r, me * n + j, 10) * 1e6f));
      }
    }
    out.push_back(bytes_of(recv));
    out.push_back(bytes_of(irecv));
  }
  if (W > 1) {  // transfers round the ring: send and recv, an exchange, a group of both directions
    const int next = (me + 1) % W, prev = (me + W - 1) % W;
    const std::vector<float> mine = noise_vector(me, n, 9);
    std::vector<float> got(un, -7.0f), back(un, -7.0f), g1(un, -7.0f), g2(un, -7.0f);
    auto sent = comm.start_send(mine.data(), n, DType::f32, next);
    comm.recv(got.data(), n, DType::f32, prev);
    sent->wait();
    comm.start_exchange(mine.data(), back.data(), n, DType::f32, prev, next)->wait();
    comm.start_transfers({{dist::PeerTransfer::send, const_cast<float*>(mine.data()), n, DType::f32, next},
                          {dist::PeerTransfer::send, const_cast<float*>(mine.data()), n, DType::f32, prev},
                          {dist::PeerTransfer::recv, g1.data(), n, DType::f32, prev},
                          {dist::PeerTransfer::recv, g2.data(), n, DType::f32, next}})
        ->wait();
    REQUIRE(got == noise_vector(prev, n, 9));
    REQUIRE(back == noise_vector(next, n, 9));
    REQUIRE(g1 == noise_vector(prev, n, 9));
    REQUIRE(g2 == noise_vector(next, n, 9));
    out.push_back(bytes_of(got));
    out.push_back(bytes_of(back));
  }
  return out;
}

}  // namespace

// Under mpirun -np 4 and -np 3 (alone: one rank, every call the identity). Pieces of 7 elements
// (and of 1) against the whole calls: the same bytes, for sizes below, at and around the limit.
TEST_CASE("pieces: collectives and transfers split by LLMTRAIN_COMM_MAX_ELEMENTS give the whole call's bytes",
          "[dist][mesh][mpi][pieces]") {
  auto comm = job().split(0, job().rank());
  for (const std::int64_t n : {0, 1, 6, 7, 8, 13, 50, 101}) {
    CAPTURE(n);
    const dist::Traffic before = comm->traffic();
    const auto whole = every_call(*comm, n);
    const dist::Traffic whole_traffic = comm->traffic().since(before);
    for (const char* limit : {"7", "1"}) {
      CAPTURE(limit);
      const dist::Traffic start = comm->traffic();
      std::vector<std::vector<char>> split;
      {
        PieceLimit forced(limit);
        split = every_call(*comm, n);
      }
      REQUIRE(split.size() == whole.size());
      for (std::size_t k = 0; k < whole.size(); ++k) {
        CAPTURE(k);
        CHECK(split[k] == whole[k]);
      }
      // One logical call each, the same bytes counted once (to the rounding of the running totals).
      const dist::Traffic t = comm->traffic().since(start);
      for (int kind = 0; kind < dist::Traffic::kinds; ++kind) {
        CHECK(t.calls[kind] == whole_traffic.calls[kind]);
        CHECK(std::abs(t.bytes[kind] - whole_traffic.bytes[kind]) <= 1e-9 * (1.0 + whole_traffic.bytes[kind]));
      }
    }
  }
  if (comm->world_size() > 1) {  // (one rank makes no call that has a limit)
    PieceLimit bad("0");
    std::vector<float> x(4, 1.0f);
    CHECK_THROWS_AS(comm->all_reduce_sum(x.data(), 4), InputError);
  }
  CHECK(dist::piece_limit(1000) == 1000);
  {
    PieceLimit seven("7");
    CHECK(dist::piece_limit(1000) == 7);
    CHECK(dist::piece_limit(5) == 5);
  }
}

#ifdef LLMTRAIN_MPI_CALL_LOG
// Under mpirun -np 2 and -np 4. Open MPI's non-blocking collectives compute a reduce-scatter's or
// all-gather's ranks x count, and byte offsets, in int: a limit forced between one rank's count
// and the total (elements), or below the bytes (all-reduce too), must split the call, every call
// MPI sees within it (as MPI's profiling interface records them), with the whole call's bytes.
TEST_CASE("pieces: a collective whose total over the ranks or whose bytes pass MPI's int is split within them",
          "[dist][mesh][mpi][pieces_total]") {
  using test::MpiCalls;
  auto comm = job().split(0, job().rank());
  const int W = comm->world_size();
  if (W == 1) {
    SUCCEED("one rank: no MPI call to split");
    return;
  }
  for (const std::int64_t n : {5, 13, 64}) {
    CAPTURE(n);
    test::mpi_calls() = MpiCalls{};
    const dist::Traffic before = comm->traffic();
    const auto whole = every_call(*comm, n);
    const dist::Traffic whole_traffic = comm->traffic().since(before);
    const MpiCalls whole_calls = test::mpi_calls();
    // Whole calls: one MPI call each (2 all-reduces of f32, f64, i64 max, f32 max: 5; 3 gathers).
    REQUIRE(whole_calls.calls[MpiCalls::reduce_scatter] == 1);
    REQUIRE(whole_calls.calls[MpiCalls::all_gather] == 3);
    REQUIRE(whole_calls.calls[MpiCalls::all_reduce] == 5);
    REQUIRE(whole_calls.calls[MpiCalls::broadcast] == 1);
    REQUIRE(whole_calls.largest_total[MpiCalls::all_gather] == W * n);

    // elements: one rank's n is within the limit, the total W n is not
    const std::int64_t elements = W * n - 1;
    // bytes: n f32 (4 n bytes) and more are not; one rank's count is far within the element limit
    const std::int64_t bytes = 4 * n - 1;
    for (const char* variable : {"LLMTRAIN_COMM_MAX_ELEMENTS", "LLMTRAIN_COMM_MAX_BYTES"}) {
      CAPTURE(variable);
      const bool by_elements = std::string(variable) == "LLMTRAIN_COMM_MAX_ELEMENTS";
      const std::int64_t limit = by_elements ? elements : bytes;
      test::mpi_calls() = MpiCalls{};
      const dist::Traffic start = comm->traffic();
      setenv(variable, std::to_string(limit).c_str(), 1);
      const auto split = every_call(*comm, n);
      unsetenv(variable);
      const MpiCalls calls = test::mpi_calls();
      REQUIRE(split.size() == whole.size());
      for (std::size_t k = 0; k < whole.size(); ++k) {
        CAPTURE(k);
        CHECK(split[k] == whole[k]);
      }
      // Split: more MPI calls than whole, each within the limit.
      CHECK(calls.calls[MpiCalls::reduce_scatter] > 1);
      CHECK(calls.calls[MpiCalls::all_gather] > 3);
      if (!by_elements) CHECK(calls.calls[MpiCalls::all_reduce] > 5);
      for (const int kind : {MpiCalls::all_reduce, MpiCalls::reduce_scatter, MpiCalls::all_gather, MpiCalls::broadcast}) {
        CAPTURE(kind);
        CHECK(calls.largest_count[kind] >= 1);
        if (by_elements) {
          CHECK(calls.largest_total[kind] <= limit);
        } else {
          CHECK(calls.largest_bytes[kind] <= limit);
        }
      }
      // One logical call each, the same bytes counted.
      const dist::Traffic t = comm->traffic().since(start);
      for (int kind = 0; kind < dist::Traffic::kinds; ++kind) {
        CHECK(t.calls[kind] == whole_traffic.calls[kind]);
        CHECK(std::abs(t.bytes[kind] - whole_traffic.bytes[kind]) <= 1e-9 * (1.0 + whole_traffic.bytes[kind]));
      }
    }
  }
}
#endif
