// Every collective and transfer against its definition, whole and in pieces of at most
// LLMTRAIN_COMM_MAX_ELEMENTS elements, and split within MPI's int limits (with the MPI call log).
#include <algorithm>
#include <cstdlib>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "catch_compat.h"
#include "core/error.h"
#include "dist/communicator.h"
#include "mesh_check.h"
#ifdef LLMTRAIN_MPI_CALL_LOG
#include "mpi_call_log.h"
#endif

using namespace llmtrain;

using llmtrain::test::job;

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
