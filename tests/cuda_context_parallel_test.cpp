// Context parallelism on the CUDA device, one context rank per process under mpirun (2 or 4 ranks):
// each rank holds the head and tail chunks of every sequence, and its device attention goes through
// the ring of key/value blocks (or the all-gather) to the rows of the whole sequence's attention.
//   - The attention alone: every rank's out, log-sum-exp and input gradient (dq, and the dk, dv its
//     key/value block collected from the other ranks) against one-rank CPU flash attention on the
//     whole sequence, for the ring and the all-gather, grouped-query heads.
//   - Whole models: a GPT-2 (learned positions) and a Llama (rotary embeddings at each token's true
//     position, GQA) on the device, ring and all-gather, fp32 and bf16, with full recomputation:
//     the ranks' loss sums add up to the whole CPU model's, and so do their gradients. A
//     Mixture-of-Experts Llama likewise, its router's statistics summed over the group: every
//     rank's load-balancing and z losses, load imbalance and expert loads are the whole model's.
//
// The exchanges are the trainer's own (CommContextGroup) through a communicator that stages
// each device buffer through host memory (MPI between the processes): the ranks may share one GPU,
// and the CUDA emulator (dev/cuda_emu) runs them. So this covers the device path of context
// parallelism but NCCL's transport, which test_nccl (test_nccl_emu: a ring exchange on 3 ranks)
// checks.
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "catch_compat.h"
#include "cuda_compare.h"
#include "dist/communicator.h"
#include "parallel/context_attention.h"
#include "model/model.h"
#include "ops/buffer.h"
#include "ops/ops.h"
#include "parallel/context_parallel_comm.h"
#include "staged_communicator.h"

using namespace llmtrain;
using llmtrain::test::relative_error;
using llmtrain::test::device_job;
using llmtrain::test::job;
using llmtrain::test::to_host;

namespace {

// Rows of a (B,T,W) array that chunks `at` name, in their order: (B, at.rows(), W).
std::vector<float> rows_of(const std::vector<float>& whole, int B, int T, int W, ops::Chunks at) {
  const int Tl = at.rows();
  std::vector<float> out(std::size_t(B) * Tl * W);
  for (int b = 0; b < B; ++b) {
    for (int i = 0; i < at.count(); ++i) {
      for (int t = 0; t < at.len; ++t) {
        for (int w = 0; w < W; ++w) {
          out[(std::size_t(b) * Tl + std::size_t(i) * at.len + t) * W + w] =
              whole[(std::size_t(b) * T + at.start(i) + t) * W + w];
        }
      }
    }
  }
  return out;
}

std::vector<float> random_values(std::mt19937& rng, std::size_t n) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

Tensor host(std::vector<float>& v, std::initializer_list<std::int64_t> shape) {
  return Tensor(v.data(), DType::f32, Device::cpu, shape);
}

// Device attention of this rank's rows against one-rank CPU flash attention over the whole
// sequence. CHECK only: a rank that stopped early would leave the others in an exchange.
void compare_attention(bool ring, int B, int T, int NH, int NKV, int HS) {
  dist::Communicator& world = job();
  const int rank = world.rank(), N = world.world_size();
  const int C = NH * HS, W = C + 2 * NKV * HS, Tl = T / N;
  CAPTURE(ring, N, rank, B, T, NH, NKV, HS);
  std::mt19937 rng(5 + T + NH);  // the same on every rank
  std::vector<float> qkv = random_values(rng, std::size_t(B) * T * W), dout = random_values(rng, std::size_t(B) * T * C);
  std::vector<float> out(std::size_t(B) * T * C), lse(std::size_t(B) * NH * T), dqkv(qkv.size());
  ops::flash_attention_forward(host(out, {B, T, C}), host(lse, {B, NH, T}), host(qkv, {B, T, W}), NH, NKV);
  ops::flash_attention_backward(host(dqkv, {B, T, W}), host(dout, {B, T, C}), host(qkv, {B, T, W}),
                                host(out, {B, T, C}), host(lse, {B, NH, T}), NH, NKV, ops::AttentionKernels::flash,
                                ops::Accumulate::no);

  parallel::ContextAttention cp(rank, N, ring, Device::cuda, DType::f32);
  test::StagedCommunicator staged(world);
  parallel::CommContextGroup group(staged, staged);
  cp.set_group(&group);
  const ops::Chunks at = cp.rows(T);
  const test::DeviceArray<float> d_qkv(rows_of(qkv, B, T, W, at)), d_dout(rows_of(dout, B, T, C, at));
  const test::DeviceArray<float> d_out(std::vector<float>(std::size_t(B) * Tl * C, NAN));
  const test::DeviceArray<float> d_lse(std::vector<float>(std::size_t(B) * NH * Tl, NAN));
  const test::DeviceArray<float> d_dqkv(std::vector<float>(std::size_t(B) * Tl * W, NAN));
  cp.attention_forward(d_out.tensor({B, Tl, C}), d_lse.tensor({B, NH, Tl}), d_qkv.tensor({B, Tl, W}), NH, NKV, Tensor(),
                       Tensor());
  cp.attention_backward(d_dqkv.tensor({B, Tl, W}), d_dout.tensor({B, Tl, C}), d_qkv.tensor({B, Tl, W}),
                        d_out.tensor({B, Tl, C}), d_lse.tensor({B, NH, Tl}), NH, NKV, Tensor(), Tensor());
  // lse (B,NH,T) as rows of (B*NH, T, 1).
  const std::vector<float> want_out = rows_of(out, B, T, C, at), want_dqkv = rows_of(dqkv, B, T, W, at);
  const std::vector<float> want_lse = rows_of(lse, B * NH, T, 1, at);
  const std::vector<float> got_out = d_out.to_host(), got_lse = d_lse.to_host(), got_dqkv = d_dqkv.to_host();
  bool finite = true;
  const double e_out = relative_error(got_out.data(), want_out.data(), std::int64_t(got_out.size()), &finite);
  const double e_lse = relative_error(got_lse.data(), want_lse.data(), std::int64_t(got_lse.size()), &finite);
  const double e_dqkv = relative_error(got_dqkv.data(), want_dqkv.data(), std::int64_t(got_dqkv.size()), &finite);
  CAPTURE(e_out, e_lse, e_dqkv);
  CHECK(finite);
  CHECK(e_out < 1e-5);
  CHECK(e_lse < 1e-5);
  CHECK(e_dqkv < 1e-4);
  // The key/value columns alone (the blocks' gradients sent back to their owner).
  std::vector<float> got_kv, want_kv;
  for (std::size_t r = 0; r < got_dqkv.size() / std::size_t(W); ++r) {
    for (int w = C; w < W; ++w) {
      got_kv.push_back(got_dqkv[r * std::size_t(W) + std::size_t(w)]);
      want_kv.push_back(want_dqkv[r * std::size_t(W) + std::size_t(w)]);
    }
  }
  const double e_kv = relative_error(got_kv.data(), want_kv.data(), std::int64_t(got_kv.size()), &finite);
  CAPTURE(e_kv);
  CHECK(e_kv < 1e-4);
}

config::ModelConfig tiny(const std::string& name) {
  const std::string arch = name == "moe" ? "llama" : name;
  config::ModelConfig c;
  c.arch = *config::parse_choice<config::Arch>(arch);
  c.vocab_size = 97;
  c.context_length = 16;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_kv_head = arch == "llama" ? 2 : 4;
  c.d_model = 128;  // head size 32
  c.ffn_hidden = arch == "llama" ? 352 : 512;
  c.tie_embeddings = arch == "gpt2";
  if (name == "moe") {  // layer 0 dense, layer 1 MoE: 4 experts, top 2, a shared expert
    c.moe.enabled = true;
    c.moe.experts = 4;
    c.moe.top_k = 2;
    c.moe.ffn_hidden = 64;
    c.moe.shared_experts = 1;
    c.moe.shared_ffn_hidden = 64;
    c.moe.first_dense_layers = 1;
    c.moe.aux_loss_coef = 0.01;
    c.moe.z_loss_coef = 0.001;
  }
  return c;
}

// The device model of this context rank against the whole CPU model over two micro-steps: the
// ranks' loss sums and gradients summed over the group are the whole model's. Tolerances as
// test_cuda_tensor_parallel's (fp32 loss 1e-5 and gradients 1e-4; bf16 1e-2 and 5e-2).
void compare_model(const std::string& arch, bool ring, DType dtype, model::Recompute recompute) {
  dist::Communicator& world = job();
  const int rank = world.rank(), N = world.world_size();
  CAPTURE(arch, ring, N, rank, dtype_name(dtype), config::to_string(recompute));
  const auto c = tiny(arch);
  const auto whole = model::make_model(c, Device::cpu);
  whole->init_weights(11);
  test::StagedCommunicator staged(world);
  parallel::CommContextGroup group(staged, world);  // host-memory sums (MoE routers') over MPI, as in training
  parallel::ContextAttention sequences(rank, N, ring, Device::cuda, dtype);
  sequences.set_group(&group);
  const auto part = model::make_model(c, Device::cuda, recompute, dtype, ops::AttentionKernels::flash);
  part->attach_sequences(&sequences);
  CHECK(part->num_params() == whole->num_params());
  ops::copy(part->params(), whole->params());

  const double loss_tol = dtype == DType::f32 ? 1e-5 : 1e-2, grad_tol = dtype == DType::f32 ? 1e-4 : 5e-2;
  const int B = 2, T = 16;  // 8 or 4 tokens per rank: chunks of 4 or 2
  const double n = double(B) * T;
  whole->zero_grads();
  part->zero_grads();
  for (int micro = 0; micro < 2; ++micro) {
    std::vector<std::int32_t> inputs(std::size_t(B) * T), targets(inputs.size());
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      inputs[i] = std::int32_t((i * 31 + std::size_t(micro) * 13) % std::size_t(c.vocab_size));
      targets[i] = std::int32_t((i * 17 + 3 + std::size_t(micro) * 7) % std::size_t(c.vocab_size));
    }
    const double expected = whole->forward(inputs.data(), targets.data(), B, T, float(1.0 / n)) / n;
    float mine = float(part->forward(inputs.data(), targets.data(), B, T, float(1.0 / n)) / n);
    world.all_reduce_sum(&mine, 1);
    CAPTURE(micro, expected, mine);
    CHECK(std::abs(mine - expected) <= loss_tol * std::abs(expected));
    whole->backward();
    part->backward();
  }
  if (c.moe.enabled) {  // the router's statistics are the whole micro-batches', on every rank
    const model::MoeStats want = whole->take_moe_stats(), got = part->take_moe_stats();
    CAPTURE(want.aux, got.aux, want.z, got.z, want.imbalance, got.imbalance);
    CHECK(got.forwards == want.forwards);
    CHECK(std::abs(got.aux - want.aux) <= loss_tol * want.aux);
    CHECK(std::abs(got.z - want.z) <= loss_tol * want.z);
    CHECK(std::abs(got.imbalance - want.imbalance) <= 1e-6 * want.imbalance);
    CHECK(got.loads == want.loads);
  }
  std::vector<float> grads = to_host(part->grads());
  world.all_reduce_sum(grads.data(), std::int64_t(grads.size()));
  const float* reference = whole->grads().as<float>();
  bool finite = true;
  const double all = relative_error(grads.data(), reference, std::int64_t(grads.size()), &finite);
  CAPTURE(all);
  CHECK(all < grad_tol);
  CHECK(finite);
  for (const auto& info : part->param_infos()) {
    const double error = relative_error(grads.data() + info.offset, reference + info.offset, info.numel, &finite);
    CAPTURE(info.name, error);
    CHECK(error < grad_tol);
  }
}

}  // namespace

TEST_CASE("cuda context parallel attention: ring and all-gather over the job's ranks give one-rank attention rows",
          "[cuda][context][mpi]") {
  std::string why;
  if (!device_job("context", &why)) LLMTRAIN_SKIP(why);
  for (const bool ring : {true, false}) {
    compare_attention(ring, 2, 24, 4, 2, 16);  // GQA; chunks of 6 (2 ranks) or 3 (4 ranks)
    compare_attention(ring, 1, 16, 2, 2, 32);
  }
}

TEST_CASE("cuda context parallel GPT-2 (learned positions): ranks' losses and gradients sum to the whole cpu model's",
          "[cuda][context][mpi]") {
  std::string why;
  if (!device_job("context", &why)) LLMTRAIN_SKIP(why);
  compare_model("gpt2", true, DType::f32, model::Recompute::none);
  compare_model("gpt2", false, DType::f32, model::Recompute::none);
  compare_model("gpt2", true, DType::bf16, model::Recompute::none);
}

TEST_CASE("cuda context parallel Mixture-of-Experts Llama: ranks' losses, gradients and router statistics are the whole cpu model's",
          "[cuda][context][mpi][moe]") {
  std::string why;
  if (!device_job("context", &why)) LLMTRAIN_SKIP(why);
  compare_model("moe", true, DType::f32, model::Recompute::none);
  compare_model("moe", false, DType::f32, model::Recompute::none);
}

TEST_CASE("cuda context parallel Llama (rotary positions, GQA): ranks' losses and gradients sum to the whole cpu model's",
          "[cuda][context][mpi][llama]") {
  std::string why;
  if (!device_job("context", &why)) LLMTRAIN_SKIP(why);
  compare_model("llama", true, DType::f32, model::Recompute::none);
  compare_model("llama", false, DType::f32, model::Recompute::none);
  compare_model("llama", true, DType::bf16, model::Recompute::none);
  // Backward recomputes each layer's forward, with its ring again.
  compare_model("llama", true, DType::f32, model::Recompute::full);
}
