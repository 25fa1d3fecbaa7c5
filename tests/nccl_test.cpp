// The NCCL communicator on one GPU (world size 1): collectives on device memory.
#include <vector>

#include "catch_compat.h"
#include "dist/communicator.h"
#include "dist/nccl_communicator.h"
#include "ops/buffer.h"

using namespace llmtrain;

TEST_CASE("NCCL collectives on device memory, one rank", "[cuda][dist]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);
  const auto host = dist::make_single_communicator();
  const auto nccl = dist::make_nccl_communicator(*host, 0, 60.0);
  CHECK(nccl->name() == "nccl");
  std::vector<float> values = {1.5f, -2.0f, 3.25f, 0.0f, 7.0f};
  ops::Buffer a(Device::cuda, values.size() * sizeof(float)), b(Device::cuda, values.size() * sizeof(float));
  const Tensor host_values(values.data(), DType::f32, Device::cpu, {5});
  ops::copy(a.view(DType::f32, {5}), host_values);
  nccl->all_reduce_sum(a.view(DType::f32, {5}).as<float>(), 5);  // one rank: the sum is the value
  nccl->broadcast(a.view(DType::f32, {5}).as<float>(), 5, 0);
  nccl->all_gather(a.view(DType::f32, {5}).as<float>(), b.view(DType::f32, {5}).as<float>(), 5);
  std::vector<float> out(5);
  ops::copy(Tensor(out.data(), DType::f32, Device::cpu, {5}), b.view(DType::f32, {5}));
  CHECK(out == values);
  nccl->start_all_reduce_sum(b.view(DType::f32, {5}).as<float>(), 5)->wait();
  ops::copy(Tensor(out.data(), DType::f32, Device::cpu, {5}), b.view(DType::f32, {5}));
  CHECK(out == values);
}
