// The NCCL communicator on a non-blocking communicator whose calls return ncclInProgress before
// their work is on the stream (the emulator's NCCL shim does so for its first polls): every
// collective's result must be there when the call returns. Two ranks are emulated, holding the
// same data, so a reduced buffer is twice the input and an unreduced one is not.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "catch_compat.h"
#include "dist/communicator.h"
#include "dist/nccl_communicator.h"

using namespace llmtrain;

namespace {

// Rank 0 of 2 over host memory: only the broadcast of NCCL's id is used (rank 0 keeps its own).
class TwoRanksHost final : public dist::Communicator {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 2; }
  std::string name() const override { return "two-ranks-host"; }
  std::unique_ptr<dist::Communicator> split(int, int) override { return nullptr; }

 protected:
  void do_all_reduce_sum(float*, std::int64_t) override {}
  void do_all_reduce_sum(double*, std::int64_t) override {}
  void do_all_reduce_max(std::int64_t*, std::int64_t) override {}
  void do_all_reduce_max(float*, std::int64_t) override {}
  std::unique_ptr<dist::Request> do_start_all_reduce_sum(float*, std::int64_t) override { return nullptr; }
  std::unique_ptr<dist::Request> do_start_reduce_scatter_sum(const float*, float*, std::int64_t) override {
    return nullptr;
  }
  std::unique_ptr<dist::Request> do_start_all_gather(const void*, void*, std::int64_t, DType) override { return nullptr; }
  void do_broadcast(float*, std::int64_t, int) override {}
  void do_barrier() override {}
};

std::vector<float> read(const float* device, size_t n) {
  std::vector<float> host(n);
  REQUIRE(cudaMemcpy(host.data(), device, n * sizeof(float), cudaMemcpyDeviceToHost) == cudaSuccess);
  return host;
}

}  // namespace

TEST_CASE("NCCL: a collective that returns ncclInProgress is complete when the call returns", "[cuda][dist]") {
  TwoRanksHost host;
  const auto nccl = dist::make_nccl_communicator(host, 0, 30.0);
  const std::vector<float> values = {1.5f, -2.0f, 3.25f, 0.0f};
  const size_t n = values.size();
  float* data = nullptr;
  float* gathered = nullptr;
  REQUIRE(cudaMalloc(reinterpret_cast<void**>(&data), n * sizeof(float)) == cudaSuccess);
  REQUIRE(cudaMalloc(reinterpret_cast<void**>(&gathered), 2 * n * sizeof(float)) == cudaSuccess);
  auto upload = [&] {
    REQUIRE(cudaMemcpy(data, values.data(), n * sizeof(float), cudaMemcpyHostToDevice) == cudaSuccess);
  };
  const std::vector<float> doubled = {3.0f, -4.0f, 6.5f, 0.0f};

  upload();
  nccl->all_reduce_sum(data, std::int64_t(n));
  CHECK(read(data, n) == doubled);  // the gradients an update would read

  upload();
  nccl->start_all_reduce_sum(data, std::int64_t(n))->wait();
  CHECK(read(data, n) == doubled);

  upload();
  nccl->all_gather(data, gathered, std::int64_t(n));
  std::vector<float> both = values;
  both.insert(both.end(), values.begin(), values.end());
  CHECK(read(gathered, 2 * n) == both);

  REQUIRE(cudaMemcpy(gathered, both.data(), 2 * n * sizeof(float), cudaMemcpyHostToDevice) == cudaSuccess);
  nccl->reduce_scatter_sum(gathered, data, std::int64_t(n));  // rank 0's shard, summed over 2 ranks
  CHECK(read(data, n) == doubled);

  // ZeRO 3's started collectives: a reduce-scatter, and an in-place all-gather of bf16 words
  // (rank 0's part already at the start of the buffer).
  REQUIRE(cudaMemcpy(gathered, both.data(), 2 * n * sizeof(float), cudaMemcpyHostToDevice) == cudaSuccess);
  nccl->start_reduce_scatter_sum(gathered, data, std::int64_t(n))->wait();
  CHECK(read(data, n) == doubled);
  const std::vector<std::uint16_t> words = {0x3fc0, 0xc000, 0x4050, 0x0000};  // 1.5, -2, 3.25, 0 in bf16
  std::vector<std::uint16_t> out(2 * n, 0xffff);
  REQUIRE(cudaMemcpy(gathered, words.data(), n * 2, cudaMemcpyHostToDevice) == cudaSuccess);
  nccl->start_all_gather(gathered, gathered, std::int64_t(n), DType::bf16)->wait();
  REQUIRE(cudaMemcpy(out.data(), gathered, 2 * n * 2, cudaMemcpyDeviceToHost) == cudaSuccess);
  std::vector<std::uint16_t> twice = words;
  twice.insert(twice.end(), words.begin(), words.end());
  CHECK(out == twice);
  CHECK(nccl->traffic().calls[dist::Traffic::all_gather] == 2);
  CHECK(nccl->traffic().bytes[dist::Traffic::all_gather] == n * 4 + n * 2);  // (2-1)/2 of 2n elements each
  cudaFree(data);
  cudaFree(gathered);
}
