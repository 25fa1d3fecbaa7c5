// The NCCL communicator on a non-blocking communicator whose calls return ncclInProgress before
// their work is on the stream (the emulator's NCCL shim does so for its first polls): every
// collective's result must be there when the call returns. Two ranks are emulated, holding the
// same data, so a reduced buffer is twice the input and an unreduced one is not.
#include <cuda_runtime_api.h>

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
  std::unique_ptr<dist::Request> do_start_all_reduce_sum(float*, std::int64_t) override { return nullptr; }
  void do_reduce_scatter_sum(const float*, float*, std::int64_t) override {}
  void do_all_gather(const float*, float*, std::int64_t) override {}
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
  cudaFree(data);
  cudaFree(gathered);
}
