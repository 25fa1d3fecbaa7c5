// Context parallelism's ring over the NCCL communicator on the NCCL shim, whose transfers move
// their data only once something is ordered after them (the emulator holds them on the
// communicator's stream): the ring's stream-ordered waits must make every step's attention see
// the block it was sent, and no buffer may be overwritten before the transfer reading it is done.
// A dropped wait reads a block that has not arrived, or sends one already overwritten.
//
// The shim's ranks hold the same data (a recv gets what this process sent on), so the reference
// is the same rank's CPU ring over a group that hands every block straight back: the same blocks
// at the same positions, attended to in the same order.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "catch_compat.h"
#include "cuda_compare.h"
#include "dist/nccl_communicator.h"
#include "llmtrain_emu/runtime_control.h"
#include "ops/ops.h"
#include "parallel/context_attention.h"
#include "parallel/context_parallel_comm.h"
#include "shim_host.h"

using namespace llmtrain;

namespace {

// Every exchange receives what it sends (the shim's ranks running this same program), on the host.
class LoopbackGroup final : public parallel::ContextGroup {
 public:
  class Done final : public Pending {
   public:
    void wait() override {}
  };
  std::unique_ptr<Pending> start_exchange(const Tensor& send, const Tensor& recv, int, int) override {
    std::memcpy(recv.data, send.data, send.bytes());
    return std::make_unique<Done>();
  }
  void all_gather(const Tensor&, const Tensor&) override { FAIL("the ring does not all-gather"); }
  void reduce_scatter(const Tensor&, const Tensor&) override { FAIL("the ring does not reduce-scatter"); }
  void sum(std::vector<double>&) override { FAIL("the ring sums nothing"); }
};

std::vector<float> random_values(std::mt19937& rng, std::size_t n) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

std::int64_t host_syncs() {
  return llmtrain_emu::runtime_calls("cudaDeviceSynchronize") + llmtrain_emu::runtime_calls("cudaStreamSynchronize") +
         llmtrain_emu::runtime_calls("cudaEventSynchronize");
}

}  // namespace

TEST_CASE("context parallel ring over NCCL: stream-ordered waits give the host-waited ring's results",
          "[cuda][dist][context]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);
  const int B = 2, NH = 2, NKV = 1, HS = 8, C = NH * HS, W = C + 2 * NKV * HS;
  for (const int n : {2, 3}) {
    for (const int rank : {0, n - 1}) {
      CAPTURE(n, rank);
      const int T = 2 * n * 3, Tl = T / n;  // chunks of 3 tokens
      std::mt19937 rng(11 + n + rank);
      std::vector<float> qkv = random_values(rng, std::size_t(B) * Tl * W), dout = random_values(rng, std::size_t(B) * Tl * C);
      std::vector<float> out(std::size_t(B) * Tl * C), lse(std::size_t(B) * NH * Tl), dqkv(qkv.size());
      const auto cpu = [](std::vector<float>& v, std::initializer_list<std::int64_t> shape) {
        return Tensor(v.data(), DType::f32, Device::cpu, shape);
      };
      parallel::ContextAttention reference(rank, n, true, Device::cpu, DType::f32);
      LoopbackGroup loopback;
      reference.set_group(&loopback);
      reference.attention_forward(cpu(out, {B, Tl, C}), cpu(lse, {B, NH, Tl}), cpu(qkv, {B, Tl, W}), NH, NKV, Tensor(), Tensor());
      reference.attention_backward(cpu(dqkv, {B, Tl, W}), cpu(dout, {B, Tl, C}), cpu(qkv, {B, Tl, W}),
                                   cpu(out, {B, Tl, C}), cpu(lse, {B, NH, Tl}), NH, NKV, Tensor(),
                                   Tensor());

      test::ShimHost host(n, rank);
      const auto nccl = dist::make_nccl_communicator(host, 0, 30.0);
      parallel::CommContextGroup group(*nccl, *nccl);
      parallel::ContextAttention cp(rank, n, true, Device::cuda, DType::f32);
      cp.set_group(&group);
      const test::DeviceArray<float> d_qkv(qkv), d_dout(dout);
      const test::DeviceArray<float> d_out(std::vector<float>(out.size(), NAN)), d_lse(std::vector<float>(lse.size(), NAN));
      const test::DeviceArray<float> d_dqkv(std::vector<float>(dqkv.size(), NAN));
      const std::int64_t syncs = host_syncs();
      cp.attention_forward(d_out.tensor({B, Tl, C}), d_lse.tensor({B, NH, Tl}), d_qkv.tensor({B, Tl, W}), NH, NKV, Tensor(),
                           Tensor());
      cp.attention_backward(d_dqkv.tensor({B, Tl, W}), d_dout.tensor({B, Tl, C}), d_qkv.tensor({B, Tl, W}),
                            d_out.tensor({B, Tl, C}), d_lse.tensor({B, NH, Tl}), NH, NKV, Tensor(), Tensor());
      CHECK(host_syncs() == syncs);  // no host wait inside the ring
      // Forward (n - 1) and backward 2 (n - 1) exchanges, each one send and one receive.
      CHECK(nccl->traffic().calls[dist::Traffic::send] == 3 * (n - 1));
      const std::vector<float> got_out = d_out.to_host(), got_lse = d_lse.to_host(), got_dqkv = d_dqkv.to_host();
      nccl->wait_queued();
      bool finite = true;
      const double e_out = test::relative_error(got_out.data(), out.data(), std::int64_t(out.size()), &finite);
      const double e_lse = test::relative_error(got_lse.data(), lse.data(), std::int64_t(lse.size()), &finite);
      const double e_dqkv = test::relative_error(got_dqkv.data(), dqkv.data(), std::int64_t(dqkv.size()), &finite);
      CAPTURE(e_out, e_lse, e_dqkv);
      CHECK(finite);
      CHECK(e_out < 1e-5);
      CHECK(e_lse < 1e-5);
      CHECK(e_dqkv < 1e-4);
    }
  }
}
