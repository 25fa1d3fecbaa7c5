// Expert parallelism on the CUDA device, one expert rank per process under mpirun (2 or 4 ranks):
// each rank holds 4 / ranks of the 4 experts of every MoE layer and runs a micro-batch of its own;
// its MoE layers send the token slots' rows to their experts' ranks and back by all-to-all.
// Against the whole CPU model running every rank's micro-batch in turn: each rank's loss is the
// CPU model's on its micro-batch, the shared parameters' gradients summed over the ranks are the
// CPU model's, and each rank's experts' gradients (fed by every rank's tokens) are the CPU
// model's of those experts. Softmax router with a shared expert, the sigmoid router with an
// expert bias, a capacity that drops slots; fp32 and bf16.
//
// The rows travel through the trainer's own ExpertParallel over a communicator that stages each
// device buffer through host memory (MPI between the processes), so the ranks may share one GPU
// and the CUDA emulator (dev/cuda_emu) runs them; NCCL's all-to-all itself is checked by
// test_nccl (test_nccl_emu).
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "catch_compat.h"
#include "cuda_compare.h"
#include "dist/communicator.h"
#include "model/model.h"
#include "model/moe_layer.h"
#include "ops/ops.h"
#include "parallel/expert_parallel_comm.h"
#include "staged_communicator.h"

using namespace llmtrain;
using llmtrain::test::relative_error;
using llmtrain::test::device_job;
using llmtrain::test::job;
using llmtrain::test::to_host;

namespace {

config::ModelConfig tiny_moe(const std::string& router, double capacity) {
  config::ModelConfig c;
  c.arch = config::Arch::llama;
  c.vocab_size = 97;
  c.context_length = 16;
  c.n_layer = 3;
  c.n_head = 4;
  c.n_kv_head = 2;
  c.d_model = 64;
  c.ffn_hidden = 96;
  c.tie_embeddings = false;
  auto& m = c.moe;
  m.enabled = true;
  m.experts = 4;
  m.top_k = 2;
  m.ffn_hidden = 32;
  m.shared_experts = 1;
  m.shared_ffn_hidden = 32;
  m.first_dense_layers = 1;
  m.router = router;
  m.bias_update_rate = router == "sigmoid" ? 0.01 : 0.0;
  m.aux_loss_coef = 0.01;
  m.z_loss_coef = 0.001;
  m.capacity_factor = capacity;
  return c;
}

// Rank r's micro-batch (B, T) of the job's N.
void batch(int r, int B, int T, int V, std::vector<std::int32_t>& inputs, std::vector<std::int32_t>& targets) {
  inputs.assign(std::size_t(B) * T, 0);
  targets.assign(inputs.size(), 0);
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    inputs[i] = std::int32_t((i * 31 + std::size_t(r) * 13 + 5) % std::size_t(V));
    targets[i] = std::int32_t((i * 17 + 3 + std::size_t(r) * 7) % std::size_t(V));
  }
}

void compare_model(const std::string& router, double capacity, DType dtype) {
  dist::Communicator& world = job();
  const int rank = world.rank(), N = world.world_size();
  CAPTURE(router, capacity, N, rank, dtype_name(dtype));
  const auto c = tiny_moe(router, capacity);
  const auto whole = model::make_model(c, Device::cpu);
  whole->init_weights(11);
  if (router == "sigmoid") {  // a bias that changes the choices: 0.02 (e - 1.5) for expert e of each layer
    for (const auto& info : whole->param_infos()) {
      if (!info.name.ends_with("e_score_correction_bias")) continue;
      for (std::int64_t e = 0; e < info.numel; ++e) whole->params().as<float>()[info.offset + e] = 0.02f * (float(e) - 1.5f);
    }
  }
  test::StagedCommunicator staged(world);
  parallel::ExpertParallel experts(world, staged);  // rank `rank` of N
  model::Layout layout;
  layout.experts = &experts;
  const auto part = model::make_model(c, Device::cuda, model::Recompute::none, dtype, ops::AttentionKernels::flash, layout);
  // This rank's weights: the whole model's at each local segment's logical place.
  const std::vector<model::Segment> segments = part->segments(false);
  std::vector<float> mine(std::size_t(part->num_params()));
  for (const model::Segment& s : segments) {
    for (std::int64_t i = 0; i < s.length; ++i) mine[std::size_t(s.local + i)] = whole->params().as<float>()[s.logical + i];
  }
  ops::copy(part->params(), Tensor(mine.data(), DType::f32, Device::cpu, {part->num_params()}));
  // 2 MoE layers, each rank 4 / N of their 4 experts of 3 (32, 64) matrices.
  CHECK(part->num_params() == whole->num_params() - 2 * (4 - 4 / N) * 3 * 32 * 64);

  const double loss_tol = dtype == DType::f32 ? 1e-5 : 1e-2, grad_tol = dtype == DType::f32 ? 1e-4 : 5e-2;
  const int B = 2, T = 16;
  const double n = double(B) * T;
  whole->zero_grads();
  part->zero_grads();
  std::vector<std::int32_t> inputs, targets;
  double expected = 0.0;
  for (int r = 0; r < N; ++r) {  // every rank's micro-batch through the whole model, in turn
    batch(r, B, T, int(c.vocab_size), inputs, targets);
    const double loss = whole->forward(inputs.data(), targets.data(), B, T, float(1.0 / n)) / n;
    whole->backward();
    if (r == rank) expected = loss;
  }
  batch(rank, B, T, int(c.vocab_size), inputs, targets);
  const double got = part->forward(inputs.data(), targets.data(), B, T, float(1.0 / n)) / n;
  part->backward();
  CAPTURE(expected, got);
  CHECK(std::abs(got - expected) <= loss_tol * std::abs(expected));
  // The shared gradients summed over the ranks, each rank's experts at their place.
  const std::vector<float> grads = to_host(part->grads());
  std::vector<float> logical(std::size_t(whole->num_params()), 0.0f);
  for (const model::Segment& s : segments) {
    for (std::int64_t i = 0; i < s.length; ++i) logical[std::size_t(s.logical + i)] += grads[std::size_t(s.local + i)];
  }
  world.all_reduce_sum(logical.data(), std::int64_t(logical.size()));
  const float* reference = whole->grads().as<float>();
  bool finite = true;
  for (const auto& info : whole->param_infos()) {
    const double error =
        relative_error(logical.data() + info.offset, reference + info.offset, info.numel, &finite);
    CAPTURE(info.name, error);
    CHECK(error < grad_tol);
  }
  CHECK(finite);
}

}  // namespace

TEST_CASE("cuda expert parallel MoE Llama: each rank's loss, the shared gradients summed and each rank's experts' "
          "gradients match the whole cpu model over every rank's micro-batch",
          "[cuda][expert][mpi]") {
  std::string why;
  if (!device_job("expert", &why)) LLMTRAIN_SKIP(why);
  compare_model("softmax", 0.0, DType::f32);
  compare_model("sigmoid", 0.0, DType::f32);
  compare_model("softmax", 0.75, DType::f32);  // capacity: some slots dropped on their own rank
  compare_model("softmax", 0.0, DType::bf16);
}
