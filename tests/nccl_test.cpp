// The NCCL communicator on device memory, at the world size the binary is started with: alone
// (ctest's "test_nccl: ..." cases) it is one rank, where every collective is the identity; under
// `mpirun -np 2` (the "test_nccl: ... 2 ranks" test in tests/CMakeLists.txt) each rank holds
// different values, so every collective, reduce_scatter and all_reduce_max included, is checked
// against its definition, and so are transfers between ranks (a ring exchange, and a send and a
// recv between pairs of ranks).
//
// NCCL needs one GPU per rank: a communicator with two ranks on one device fails to initialise
// (ncclInvalidUsage, "Duplicate GPU detected"), so with fewer GPUs on a node than ranks there,
// every rank skips visibly (all ranks agree on it first: a rank going on alone would wait for the
// others in NCCL's initialisation). It cannot run without a GPU (dev/cuda_emu's NCCL shim, which
// emulates ranks in one process, has its own test: dev/cuda_emu/tests/nccl_in_progress_test.cpp);
// a machine without a GPU runs the skipping path, at both world sizes.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "catch_compat.h"
#include "dist/communicator.h"
#include "dist/nccl_communicator.h"
#include "ops/buffer.h"
#include "device/runtime.h"

using namespace llmtrain;

namespace {

// A device copy of a host array of 4- or 8-byte elements (copied as 32-bit words: ops::copy
// takes the dtypes tensors have, and float, double and int64 are all whole words).
template <class T>
class DeviceCopy {
 public:
  explicit DeviceCopy(const std::vector<T>& host) : n_(host.size()), buffer_(Device::cuda, host.size() * sizeof(T)) {
    static_assert(sizeof(T) % 4 == 0, "whole 32-bit words only");
    ops::copy(words(buffer_.data(), Device::cuda), words(const_cast<T*>(host.data()), Device::cpu));
  }
  T* data() const { return static_cast<T*>(buffer_.data()); }
  std::vector<T> to_host() const {
    std::vector<T> host(n_);
    ops::copy(words(host.data(), Device::cpu), words(buffer_.data(), Device::cuda));
    return host;
  }

 private:
  Tensor words(void* p, Device device) const {
    return Tensor(p, DType::i32, device, {std::int64_t(n_ * sizeof(T) / 4)});
  }
  std::size_t n_;
  ops::Buffer buffer_;
};

// What rank r holds: small integers and halves, so that every sum is exact in any order.
std::vector<float> rank_values(int r, std::size_t n) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = float(i % 7) * 0.5f - 1.5f + float(r * 10) + float(i / 7);
  return v;
}

}  // namespace

TEST_CASE("NCCL collectives on device memory, at this world size (1 alone, 2 under mpirun)", "[cuda][dist]") {
  const auto host = dist::make_communicator(false, 60.0);
  const int W = host->world_size(), rank = host->rank();

  // [ranks on the busiest node, -(GPUs on the node with fewest)], agreed by every rank.
  std::string why;
  const int gpus = ops::cuda_available(&why) ? int(device::query_devices().devices.size()) : 0;
  std::vector<std::int64_t> need = {host->local_rank() + 1, -gpus};
  host->all_reduce_max(need.data(), 2);
  if (need[0] > -need[1]) {
    LLMTRAIN_SKIP("NCCL needs a GPU per rank (it refuses two ranks on one device): " + std::to_string(-need[1]) +
                  " GPU(s) for " + std::to_string(need[0]) + " rank(s) on a node" +
                  (why.empty() ? std::string() : " (this rank: " + why + ")"));
  }
  const int device = ops::use_cuda_device(host->local_rank());
  const auto nccl = dist::make_nccl_communicator(*host, device, 60.0);
  CHECK(nccl->name() == "nccl");
  CHECK(nccl->world_size() == W);
  CHECK(nccl->rank() == rank);
  CAPTURE(W, rank);

  // all_reduce_sum (float, double; blocking and started) and all_reduce_max (int64).
  const std::size_t n = 37;  // odd, not a multiple of any vector width
  std::vector<float> sum(n, 0.0f);
  for (int r = 0; r < W; ++r) {
    const std::vector<float> v = rank_values(r, n);
    for (std::size_t i = 0; i < n; ++i) sum[i] += v[i];
  }
  {
    const DeviceCopy<float> a(rank_values(rank, n)), b(rank_values(rank, n));
    nccl->all_reduce_sum(a.data(), std::int64_t(n));
    CHECK(a.to_host() == sum);
    nccl->start_all_reduce_sum(b.data(), std::int64_t(n))->wait();
    CHECK(b.to_host() == sum);
  }
  {
    const std::vector<float> v = rank_values(rank, n);
    const DeviceCopy<double> a(std::vector<double>(v.begin(), v.end()));
    nccl->all_reduce_sum(a.data(), std::int64_t(n));
    CHECK(a.to_host() == std::vector<double>(sum.begin(), sum.end()));
  }
  {
    // Each position's maximum is held by a different rank; negative values and values past 2^32.
    std::vector<std::int64_t> mine(6), want(6, std::numeric_limits<std::int64_t>::min());
    for (int r = 0; r < W; ++r) {
      const std::vector<std::int64_t> v = {r, -r, 1000 - 7 * r, (std::int64_t(1) << 40) + r, -(std::int64_t(1) << 40) - r,
                                           (r % 2 ? 5 : -5)};
      for (std::size_t i = 0; i < v.size(); ++i) want[i] = std::max(want[i], v[i]);
      if (r == rank) mine = v;
    }
    const DeviceCopy<std::int64_t> a(mine);
    nccl->all_reduce_max(a.data(), std::int64_t(mine.size()));
    CHECK(a.to_host() == want);
  }

  // reduce_scatter_sum: rank r gets the sum over ranks of shard r; all_gather puts the shards
  // back together in rank order.
  const std::int64_t shard = 5;
  const std::size_t whole = std::size_t(W * shard);
  {
    const DeviceCopy<float> send(rank_values(rank, whole)), recv(std::vector<float>(std::size_t(shard), -99.0f));
    std::vector<float> total(whole, 0.0f);
    for (int r = 0; r < W; ++r) {
      const std::vector<float> v = rank_values(r, whole);
      for (std::size_t i = 0; i < whole; ++i) total[i] += v[i];
    }
    nccl->reduce_scatter_sum(send.data(), recv.data(), shard);
    CHECK(recv.to_host() == std::vector<float>(total.begin() + rank * shard, total.begin() + (rank + 1) * shard));
    CHECK(send.to_host() == rank_values(rank, whole));  // not in place: the input stays
  }
  {
    const DeviceCopy<float> send(rank_values(rank, std::size_t(shard))), recv(std::vector<float>(whole, -99.0f));
    nccl->all_gather(send.data(), recv.data(), shard);
    std::vector<float> want;
    for (int r = 0; r < W; ++r) {
      const std::vector<float> v = rank_values(r, std::size_t(shard));
      want.insert(want.end(), v.begin(), v.end());
    }
    CHECK(recv.to_host() == want);
  }

  // broadcast from the last rank (not rank 0, whose values a broken broadcast might leave).
  {
    const DeviceCopy<float> a(rank_values(rank, n));
    nccl->broadcast(a.data(), std::int64_t(n), W - 1);
    CHECK(a.to_host() == rank_values(W - 1, n));
  }

  // Transfers. One rank has no peer; with several, a ring exchange (one NCCL group), then a send
  // and a recv between pairs of ranks, started in matching order (the even rank sends first), of
  // the same bytes taken as 2n bf16 words.
  if (W == 1) {
    const DeviceCopy<float> a(rank_values(rank, n));
    CHECK_THROWS_WITH(nccl->start_send(a.data(), std::int64_t(n), DType::f32, 0),
                      "send: no peer on a one-rank communicator");
  } else {
    const int next = (rank + 1) % W, prev = (rank + W - 1) % W;
    const DeviceCopy<float> mine(rank_values(rank, n)), got(std::vector<float>(n, -99.0f));
    nccl->start_exchange(mine.data(), got.data(), std::int64_t(n), DType::f32, next, prev)->wait();
    CHECK(got.to_host() == rank_values(prev, n));
    CHECK(mine.to_host() == rank_values(rank, n));
    if (rank + 1 < W || rank % 2 == 1) {  // ranks 2k and 2k+1 (a last odd rank sits out)
      const int partner = rank ^ 1;
      const DeviceCopy<float> back(std::vector<float>(n, -99.0f));
      if (rank % 2 == 0) {
        nccl->send(mine.data(), 2 * std::int64_t(n), DType::bf16, partner);
        nccl->recv(back.data(), 2 * std::int64_t(n), DType::bf16, partner);
      } else {
        nccl->recv(back.data(), 2 * std::int64_t(n), DType::bf16, partner);
        nccl->send(mine.data(), 2 * std::int64_t(n), DType::bf16, partner);
      }
      CHECK(back.to_host() == rank_values(partner, n));
      CHECK(nccl->traffic().bytes[dist::Traffic::send] == double(n) * 4 * 2);
      CHECK(nccl->traffic().calls[dist::Traffic::recv] == 2);
    }
  }
  nccl->barrier();
}
