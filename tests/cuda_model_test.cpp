// Whole models on the CUDA backend against the CPU reference (fp32): the same weights and batch
// give the same loss, logits and gradients (model.qk_norm's norms included; packed documents with
// data.reset_positions, with and without the document mask), and KV-cache decoding the same
// logits; a ZeRO-3
// sharded model on the device against the unsharded one; and pipeline stages (of one or two model
// chunks) on the device against the whole model.
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "catch_compat.h"
#include "core/crc32.h"
#include "cuda_compare.h"
#include "dist/communicator.h"
#include "model/model.h"
#include "ops/buffer.h"
#include "parallel/grad_sync.h"
#include "parallel/zero3.h"
#include "pipeline_stages_check.h"
#include "split_backward.h"

using namespace llmtrain;
using llmtrain::test::relative_error;
using llmtrain::test::to_host;

namespace {

config::ModelConfig tiny(const std::string& arch) {
  config::ModelConfig c;
  c.arch = *config::parse_choice<config::Arch>(arch);
  c.vocab_size = 97;  // odd sizes everywhere
  c.context_length = 33;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_kv_head = arch == "llama" ? 2 : 4;
  c.d_model = 64;  // head size 16
  c.ffn_hidden = arch == "llama" ? 168 : 256;
  c.tie_embeddings = arch == "gpt2";
  return c;
}

// A Mixture-of-Experts Llama: a dense layer, then one of 4 experts (top 2) and a shared one, with
// the router's losses; `router` "softmax" or "sigmoid" (with an expert bias), `capacity` 0
// (dropless) or a capacity factor that drops slots.
config::ModelConfig tiny_moe(const std::string& router, double capacity) {
  config::ModelConfig c = tiny("llama");
  c.moe.enabled = true;
  c.moe.experts = 4;
  c.moe.top_k = 2;
  c.moe.ffn_hidden = 40;
  c.moe.shared_experts = 1;
  c.moe.shared_ffn_hidden = 24;
  c.moe.first_dense_layers = 1;
  c.moe.router = router;
  c.moe.normalize_top_k = router == "softmax";
  c.moe.aux_loss_coef = 0.01;
  c.moe.z_loss_coef = 0.001;
  c.moe.bias_update_rate = router == "sigmoid" ? 0.01 : 0.0;
  c.moe.capacity_factor = capacity;
  return c;
}

// `documents`: packed sequences on both models (the inputs then hold its end-of-text id in places;
// decoding, which ignores documents, is not compared). `moe`: the model's config, when it is not
// tiny(arch) (its MoE layers' router statistics are compared too).
void compare_model(const std::string& arch, model::Recompute recompute, bool qk_norm = false,
                   const model::Model::Documents& documents = {}, const config::ModelConfig* moe = nullptr) {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);
  auto c = moe ? *moe : tiny(arch);
  c.qk_norm = qk_norm;
  const auto cpu = model::make_model(c, Device::cpu, recompute);
  const auto gpu = model::make_model(c, Device::cuda, recompute);
  cpu->set_documents(documents);
  gpu->set_documents(documents);
  cpu->init_weights(7);
  if (moe) {  // an expert bias other than 0, so that a bias left out of the choice would show
    for (const auto& info : cpu->param_infos()) {
      if (!info.name.ends_with("e_score_correction_bias")) continue;
      float* w = cpu->param(info).as<float>();
      for (std::int64_t i = 0; i < info.numel; ++i) w[i] = 0.02f * float((i * 7 + info.offset) % 5) - 0.04f;
    }
  }
  if (qk_norm) {  // norm weights other than 1, so that a query norm used for keys would show
    for (const auto& info : cpu->param_infos()) {
      if (info.shape.size() != 1) continue;
      float* w = cpu->param(info).as<float>();
      for (std::int64_t i = 0; i < info.numel; ++i) w[i] = 1.0f + 0.3f * std::sin(float(i + info.offset));
    }
  }
  ops::copy(gpu->params(), cpu->params());

  const int B = 3, T = 29;
  std::vector<std::int32_t> inputs(std::size_t(B) * T), targets(inputs.size());
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    inputs[i] = std::int32_t(i * 31 % std::size_t(c.vocab_size));
    targets[i] = std::int32_t((i * 17 + 5) % std::size_t(c.vocab_size));
  }
  if (documents.active()) {
    // Documents of different lengths, one sequence's first token an end-of-text, another's last.
    for (const std::size_t at : {std::size_t(0), std::size_t(5), std::size_t(6), std::size_t(17), std::size_t(T + 11),
                                 std::size_t(2 * T + 3), std::size_t(3 * T - 1)}) {
      inputs[at] = documents.eot;
    }
  }
  const double n = double(B) * T;
  bool finite = true;

  // Logits without targets, then loss and gradients (twice: accumulation over reused scratch).
  cpu->forward(inputs.data(), nullptr, B, T, 0.0f);
  gpu->forward(inputs.data(), nullptr, B, T, 0.0f);
  CHECK(relative_error(to_host(gpu->logits()), to_host(cpu->logits()), &finite) < 1e-5);
  CHECK(finite);
  cpu->zero_grads();
  gpu->zero_grads();
  for (int round = 0; round < 2; ++round) {
    const double cpu_loss = cpu->forward(inputs.data(), targets.data(), B, T, float(1.0 / n)) / n;
    const double gpu_loss = gpu->forward(inputs.data(), targets.data(), B, T, float(1.0 / n)) / n;
    CAPTURE(round, cpu_loss, gpu_loss);
    CHECK(std::abs(gpu_loss - cpu_loss) <= 1e-5 * std::abs(cpu_loss));
    if (moe) {  // the router's losses, each expert's load in each layer, the dropped slots
      const model::MoeStats want = cpu->take_moe_stats(), got = gpu->take_moe_stats();
      CAPTURE(want.aux, got.aux, want.z, got.z, want.dropped, got.dropped);
      REQUIRE(want.forwards == got.forwards);
      REQUIRE(!want.loads.empty());
      CHECK(want.aux > 0.0);
      CHECK(std::abs(got.aux - want.aux) <= 1e-5 * want.aux);
      CHECK(std::abs(got.z - want.z) <= 1e-5 * std::abs(want.z));
      CHECK(got.loads == want.loads);  // the same experts chosen for every token
      CHECK(got.dropped == want.dropped);
      CHECK((c.moe.capacity_factor > 0) == (want.dropped > 0));
    }
    cpu->backward();
    gpu->backward();
  }
  for (const auto& info : cpu->param_infos()) {
    CAPTURE(info.name);
    const double error = relative_error(to_host(gpu->grad(info)), to_host(cpu->grad(info)), &finite);
    CAPTURE(error);
    CHECK(error < 1e-4);
    CHECK(finite);
  }
  if (documents.active()) return;
  // Incremental decoding of the first sequence.
  for (int pos = 0; pos < 8; ++pos) {
    const auto expected = to_host(cpu->decode_step(inputs[std::size_t(pos)], pos));
    const auto got = to_host(gpu->decode_step(inputs[std::size_t(pos)], pos));
    CAPTURE(pos);
    CHECK(relative_error(got, expected, &finite) < 1e-5);
    CHECK(finite);
  }
}

}  // namespace

TEST_CASE("cuda the replica check's checksum of device weights, copied in chunks, is the host's", "[cuda][dist]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);
  std::vector<float> w(300007);
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = float(i % 613) * 0.29f - 7.0f;
  const test::DeviceArray<float> d(w);
  const Tensor t = d.tensor({std::int64_t(w.size())});
  const std::uint32_t whole = crc32(w.data(), w.size() * sizeof(float));
  for (const std::int64_t chunk : {std::int64_t(1) << 20, std::int64_t(65536), std::int64_t(1000)}) {
    CAPTURE(chunk);
    CHECK(parallel::weights_crc32(t, chunk) == whole);
  }
}

TEST_CASE("cuda GPT-2 forward, backward and decoding match the cpu reference", "[cuda][model]") {
  compare_model("gpt2", model::Recompute::none);
}

TEST_CASE("cuda Llama forward, backward and decoding match the cpu reference", "[cuda][model][llama]") {
  compare_model("llama", model::Recompute::none);
  compare_model("llama", model::Recompute::full);
}

TEST_CASE("cuda Llama with model.qk_norm: forward, backward and decoding match the cpu reference",
          "[cuda][model][llama]") {
  compare_model("llama", model::Recompute::none, true);
  compare_model("llama", model::Recompute::full, true);
}

// data.reset_positions: learned positions (GPT-2) and rotary ones (Llama) counted from each
// document's first token, alone and with the document mask, with full recomputation too.
TEST_CASE("cuda packed documents with reset positions: forward and backward match the cpu reference",
          "[cuda][model][documents]") {
  const int eot = 3;
  for (const bool mask : {false, true}) {
    CAPTURE(mask);
    const model::Model::Documents documents{eot, mask, true};
    compare_model("gpt2", model::Recompute::none, false, documents);
    compare_model("llama", model::Recompute::none, false, documents);
    compare_model("llama", model::Recompute::full, false, documents);
  }
}

TEST_CASE("cuda Mixture-of-Experts Llama: forward, backward, router statistics and decoding match the cpu reference",
          "[cuda][model][moe]") {
  for (const auto& [router, capacity] : {std::pair<std::string, double>{"softmax", 0.0}, {"sigmoid", 0.0},
                                         {"softmax", 0.75}}) {
    CAPTURE(router, capacity);
    const config::ModelConfig c = tiny_moe(router, capacity);
    compare_model("llama", model::Recompute::none, false, {}, &c);
  }
}

TEST_CASE("cuda bf16 mixed precision: loss within 1e-2 of the fp32 cpu reference", "[cuda][model][bf16]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);
  // Head size 32: the CUDA-core flash kernels; 64: the tensor-core ones (the model's tensors are
  // 64-byte aligned).
  for (const auto& [arch, head_size] : {std::pair<std::string, int>{"gpt2", 32}, {"llama", 32}, {"gpt2", 64},
                                        {"llama", 64}, {"moe", 32}}) {
    CAPTURE(arch, head_size);
    auto c = arch == "moe" ? tiny_moe("softmax", 0.0) : tiny(arch);
    c.d_model = 4 * head_size;
    c.ffn_hidden = arch == "gpt2" ? 16 * head_size : 344 * head_size / 32;
    const auto cpu = model::make_model(c, Device::cpu);
    const auto gpu = model::make_model(c, Device::cuda, model::Recompute::none, DType::bf16);
    cpu->init_weights(11);
    ops::copy(gpu->params(), cpu->params());
    const int B = 2, T = 31;
    std::vector<std::int32_t> inputs(std::size_t(B) * T), targets(inputs.size());
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      inputs[i] = std::int32_t(i * 13 % std::size_t(c.vocab_size));
      targets[i] = std::int32_t((i * 7 + 3) % std::size_t(c.vocab_size));
    }
    const double n = double(B) * T;
    cpu->zero_grads();
    gpu->zero_grads();
    const double cpu_loss = cpu->forward(inputs.data(), targets.data(), B, T, float(1.0 / n)) / n;
    const double gpu_loss = gpu->forward(inputs.data(), targets.data(), B, T, float(1.0 / n)) / n;
    CAPTURE(cpu_loss, gpu_loss);
    CHECK(std::abs(gpu_loss - cpu_loss) <= 1e-2 * cpu_loss);
    cpu->backward();
    gpu->backward();
    bool finite = true;
    const double error = relative_error(to_host(gpu->grads()), to_host(cpu->grads()), &finite);
    CAPTURE(error);
    CHECK(error < 5e-2);  // f32 gradients from bf16 activations
    CHECK(finite);
  }
}

TEST_CASE("cuda backward split into input and weight gradients gives the whole backward's gradients, bit for bit",
          "[cuda][model]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);
  // As tests/golden_test.cpp on the CPU: two micro-batches in two slots, F0 F1 B0 B1 with the
  // whole backwards against F0 F1 B0 B1 W0 W1 (the linear layers' cuBLASLt weight GEMMs and
  // bias sums, and the experts' grouped ones, later). GPT-2 untied here, so that its head's
  // weight gradient is deferred too.
  for (const std::string arch : {"gpt2", "llama", "moe"}) {
    for (const DType compute : {DType::f32, DType::bf16}) {
      CAPTURE(arch, dtype_name(compute));
      auto c = arch == "moe" ? tiny_moe("softmax", 0.0) : tiny(arch);  // MoE: router, experts, shared expert
      c.tie_embeddings = false;
      const int B = 2, T = 17;
      std::vector<std::int32_t> inputs(std::size_t(2 * B * T)), targets(inputs.size());
      for (std::size_t i = 0; i < inputs.size(); ++i) {
        inputs[i] = std::int32_t(i * 29 % std::size_t(c.vocab_size));
        targets[i] = std::int32_t((i * 11 + 2) % std::size_t(c.vocab_size));
      }
      const auto run = [&](bool split) {
        const auto m = model::make_model(c, Device::cuda, model::Recompute::none, compute);
        const auto host = model::make_model(c, Device::cpu);
        host->init_weights(3);
        ops::copy(m->params(), host->params());
        return test::run_two_slots(*m, split, [&](int slot) {
                 const std::size_t at = std::size_t(slot * B * T);
                 return m->forward(inputs.data() + at, targets.data() + at, B, T, 1.0f / float(2 * B * T));
               })
            .gradients;
      };
      const std::vector<float> whole = run(false), split = run(true);
      CHECK(split == whole);
    }
  }
}

// ZeRO 3's device side on one rank: the sharded model's weights gathered (converted to bf16) into
// working slots, its gradients zeroed, filled and accumulated on the device, unit by unit, give
// the same losses and gradients as the unsharded model of the same weights.
TEST_CASE("cuda ZeRO 3: bf16 working slots and sharded gradients match the unsharded model", "[cuda][model][zero3]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);
  for (const auto& [arch, reshard] : {std::pair<std::string, bool>{"gpt2", true}, {"llama", false}}) {
    CAPTURE(arch, reshard);
    auto c = tiny(arch);
    const auto cpu = model::make_model(c, Device::cpu);
    cpu->init_weights(5);
    const auto whole = model::make_model(c, Device::cuda, model::Recompute::none, DType::bf16);
    ops::copy(whole->params(), cpu->params());
    const auto sharded = model::make_model(c, Device::cuda, model::Recompute::none, DType::bf16,
                                           ops::AttentionKernels::flash, model::Layout{true});
    const auto comm = dist::make_single_communicator();
    parallel::Zero3 zero3(*sharded, *comm, *comm, reshard);
    zero3.load(cpu->params().as<float>());

    const int B = 2, T = 29;
    std::vector<std::int32_t> inputs(std::size_t(B) * T), targets(inputs.size());
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      inputs[i] = std::int32_t(i * 29 % std::size_t(c.vocab_size));
      targets[i] = std::int32_t((i * 11 + 2) % std::size_t(c.vocab_size));
    }
    const double n = double(B) * T;
    whole->zero_grads();
    zero3.zero_grads();
    for (int micro = 0; micro < 2; ++micro) {  // two micro-steps: gradients accumulate
      const double expected = whole->forward(inputs.data(), targets.data(), B, T, float(1.0 / n));
      const double got = sharded->forward(inputs.data(), targets.data(), B, T, float(1.0 / n));
      CAPTURE(micro, expected, got);
      CHECK(std::abs(got - expected) <= 1e-6 * std::abs(expected));
      whole->backward();
      sharded->backward();
    }
    double loss_sum = 0.0;
    const double norm = zero3.finish(loss_sum);
    const auto expected = to_host(whole->grads());
    const auto local = to_host(zero3.grads());
    // One rank: its pieces are every unit whole, so the local gradients are the flat ones.
    std::vector<float> got(expected.size());
    for (const auto& piece : zero3.pieces()) {
      std::copy(local.begin() + piece.local, local.begin() + piece.local + piece.size(), got.begin() + piece.begin);
    }
    bool finite = true;
    const double error = relative_error(got, expected, &finite);
    CAPTURE(error, norm);
    CHECK(error < 1e-6);
    CHECK(finite);
    double squares = 0.0;
    for (const float g : expected) squares += double(g) * g;
    CHECK(std::abs(norm - std::sqrt(squares)) <= 1e-5 * std::sqrt(squares));
  }
}

TEST_CASE("cuda pipeline stages (1F1B and interleaved chunks) give the whole cpu model's losses and gradients",
          "[cuda][model][pipeline]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);
  using parallel::StageRange;
  const std::vector<std::vector<StageRange>> two_stages = {{{0, 2}}, {{2, 3}}};
  const std::vector<std::vector<StageRange>> chunked = {{{0, 2}, {3, 1}}, {{2, 1}, {4, 1}}};
  test::check_pipeline_stages("gpt2", true, two_stages, Device::cuda, 1e-4);
  test::check_pipeline_stages("gpt2", true, chunked, Device::cuda, 1e-4);
  test::check_pipeline_stages("llama", false, chunked, Device::cuda, 1e-4);
  test::check_pipeline_stages("llama", true, {{{0, 1}}, {{1, 1}}, {{2, 3}}}, Device::cuda, 1e-4);
}
