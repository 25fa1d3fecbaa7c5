// GPT-2 and Llama against the golden files of independent PyTorch models
// (scripts/gen_reference.py, float64; its Llama is also checked there against transformers'
// LlamaForCausalLM): logits, loss, every parameter gradient, and ten AdamW steps with clipping.
#include <algorithm>
#include <cmath>
#include <limits>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "catch_compat.h"
#include "checkpoint/safetensors.h"
#include "core/bf16.h"
#include "golden_reference.h"
#include "model/gpt2.h"
#include "model/llama.h"
#include "ops/buffer.h"
#include "ops/ops.h"
#include "optim/adamw.h"
#include "plan/memory_plan.h"
#include "split_backward.h"
#include "weights_compare.h"

using namespace llmtrain;
using namespace llmtrain::test::golden;  // read, read_i32, relative_error

namespace {


struct Golden {
  checkpoint::SafetensorsReader file;
  config::Config config;
  int B, T;
  std::vector<std::int32_t> inputs, targets;

  explicit Golden(const std::string& arch)
      : file(LLMTRAIN_SOURCE_DIR "/tests/data/" + arch + "_reference.safetensors") {
    const auto& meta = file.metadata();
    config.model.arch = *config::parse_choice<config::Arch>(arch);
    B = std::stoi(meta.at("B"));
    T = std::stoi(meta.at("T"));
    config.model.vocab_size = std::stoi(meta.at("V"));
    config.model.context_length = std::stoi(meta.at("maxT"));
    config.model.n_layer = std::stoi(meta.at("L"));
    config.model.n_head = std::stoi(meta.at("NH"));
    config.model.n_kv_head = meta.contains("NKV") ? std::stoi(meta.at("NKV")) : config.model.n_head;
    config.model.tie_embeddings = arch == "gpt2";
    if (arch == "llama") {
      config.model.rope_theta = std::stod(meta.at("rope_theta"));
      config.model.norm_eps = std::stod(meta.at("norm_eps"));
    }
    config.model.d_model = std::stoi(meta.at("C"));
    config.model.ffn_hidden = std::stoi(meta.at("F"));
    config.optim.lr = std::stod(meta.at("lr"));
    config.optim.beta1 = std::stod(meta.at("beta1"));
    config.optim.beta2 = std::stod(meta.at("beta2"));
    config.optim.eps = std::stod(meta.at("eps"));
    config.optim.weight_decay = std::stod(meta.at("weight_decay"));
    config.train.grad_clip = std::stod(meta.at("grad_clip"));
    inputs = read_i32(file, "inputs");
    targets = read_i32(file, "targets");
  }

  std::unique_ptr<model::Model> make_model(model::Recompute recompute = model::Recompute::none) const {
    auto m = model::make_model(config.model, Device::cpu, recompute);
    for (const auto& info : m->param_infos()) {
      file.read_f32("param/" + info.name, std::span<float>(m->param(info).as<float>(), std::size_t(info.numel)));
    }
    return m;
  }
};

void check_forward_backward(const std::string& arch, model::Recompute recompute = model::Recompute::none) {
  const Golden g(arch);
  const auto owner = g.make_model(recompute);
  model::Model& m = *owner;
  const double n = double(g.B) * g.T;

  const double loss = m.forward(g.inputs.data(), g.targets.data(), g.B, g.T, 0.0f) / n;
  const float reference_loss = read(g.file, "loss")[0];
  CAPTURE(loss, reference_loss);
  CHECK(std::abs(loss - reference_loss) / reference_loss < 1e-5);
  CHECK(relative_error(m.logits().as<float>(), read(g.file, "logits")) < 1e-5);

  // Twice, so that a second backward over reused scratch memory is checked too.
  for (int round = 0; round < 2; ++round) {
    m.zero_grads();
    m.forward(g.inputs.data(), g.targets.data(), g.B, g.T, float(1.0 / n));
    m.backward();
    for (const auto& info : m.param_infos()) {
      CAPTURE(round, info.name);
      const double error = relative_error(m.grad(info).as<float>(), read(g.file, "grad/" + info.name));
      CAPTURE(error);
      CHECK(error < 1e-4);
    }
  }
}

void check_adamw_steps(const std::string& arch) {
  const Golden g(arch);
  const auto owner = g.make_model();
  model::Model& m = *owner;
  optim::AdamW optimizer({{0, m.num_params(), 0}}, g.config.optim);
  const auto reference = read(g.file, "adamw_losses");
  const double n = double(g.B) * g.T;
  for (std::size_t step = 1; step <= reference.size(); ++step) {
    m.zero_grads();
    const double loss = m.forward(g.inputs.data(), g.targets.data(), g.B, g.T, float(1.0 / n)) / n;
    m.backward();
    CAPTURE(step, loss, reference[step - 1]);
    CHECK(std::abs(loss - reference[step - 1]) / reference[step - 1] < 1e-4);
    const double norm = std::sqrt(ops::sum_squares(m.grads()));
    optimizer.update({m.param_infos(), m.params(), m.grads(), norm, g.config.train.grad_clip, g.config.optim.lr,
                      std::int64_t(step)});
  }
  for (const auto& info : m.param_infos()) {
    const std::vector<float> got(m.param(info).as<float>(), m.param(info).as<float>() + info.numel);
    bool key_bias_ok = false;
    const double error = test::weights_relative_error(info.name, got, read(g.file, "adamw_final/" + info.name),
                                                      g.config.model.d_model, 10 * g.config.optim.lr, &key_bias_ok);
    CAPTURE(info.name, error);
    CHECK(error < 1e-4);
    CHECK(key_bias_ok);
  }
}

void check_decoding(const std::string& arch) {
  const Golden g(arch);
  const auto owner = g.make_model();
  model::Model& m = *owner;
  m.forward(g.inputs.data(), nullptr, 1, g.T, 0.0f);  // the first sequence, all positions at once
  const std::vector<float> full(m.logits().as<float>(), m.logits().as<float>() + m.logits().numel());
  const std::int64_t V = g.config.model.vocab_size;
  for (int round = 0; round < 2; ++round) {  // the second sequence restarts at position 0
    for (int pos = 0; pos < g.T; ++pos) {
      const Tensor step = m.decode_step(g.inputs[std::size_t(pos)], pos);
      const std::vector<float> expected(full.begin() + pos * V, full.begin() + (pos + 1) * V);
      CAPTURE(round, pos);
      CHECK(relative_error(step.as<float>(), expected) < 1e-5);
    }
  }
}

}  // namespace

TEST_CASE("GPT-2 logits, loss and gradients match the PyTorch golden file", "[model][golden]") {
  check_forward_backward("gpt2");
}

TEST_CASE("Llama logits, loss and gradients match the PyTorch golden file", "[model][golden][llama]") {
  check_forward_backward("llama");
}

TEST_CASE("recomputed activations give the same gradients", "[model][golden][llama]") {
  for (const std::string arch : {"gpt2", "llama"}) {
    CAPTURE(arch);
    check_forward_backward(arch, model::Recompute::mlp);
    check_forward_backward(arch, model::Recompute::full);
  }
}

TEST_CASE("backward split into input and weight gradients gives the whole backward's gradients, bit for bit",
          "[model][golden]") {
  // Two micro-batches in two activation slots, as a pipeline stage runs them: F0 F1 B0 B1, the
  // whole backwards, against F0 F1 B0 B1 W0 W1 with the linear layers' weight gradients deferred
  // (zero-bubble's split). f32 and bf16, GPT-2 (biases, the fused GELU) and Llama.
  for (const std::string arch : {"gpt2", "llama"}) {
    for (const DType compute : {DType::f32, DType::bf16}) {
      CAPTURE(arch, dtype_name(compute));
      const Golden g(arch);
      const double n = double(g.B) * g.T;
      std::vector<std::int32_t> reversed = g.inputs;  // another micro-batch
      std::reverse(reversed.begin(), reversed.end());
      const auto run = [&](bool split) {
        auto m = model::make_model(g.config.model, Device::cpu, model::Recompute::none, compute);
        m->init_weights(7);
        const test::TwoSlotRun r = test::run_two_slots(*m, split, [&](int slot) {
          return m->forward((slot ? reversed : g.inputs).data(), g.targets.data(), g.B, g.T, float(1.0 / n));
        });
        return std::pair(r.after_backward, r.gradients);
      };
      const auto [whole, whole_grads] = run(false);
      const auto [inputs_only, split_grads] = run(true);
      CHECK(whole == whole_grads);      // nothing deferred: backward_weights adds nothing
      CHECK(inputs_only != split_grads);  // the weight gradients came after
      CHECK(split_grads == whole_grads);
    }
  }
}

TEST_CASE("ten AdamW steps follow the PyTorch loss curve", "[model][golden][optim]") { check_adamw_steps("gpt2"); }

TEST_CASE("ten AdamW steps of Llama follow the PyTorch loss curve", "[model][golden][optim][llama]") {
  check_adamw_steps("llama");
}

TEST_CASE("the flat buffers put the last layers first and every parameter once", "[model]") {
  config::ModelConfig c;
  c.vocab_size = 10;
  c.context_length = 6;
  c.n_layer = 3;
  c.n_head = 2;
  c.n_kv_head = 2;
  c.d_model = 4;
  c.ffn_hidden = 16;
  const model::Gpt2 m(c, Device::cpu);
  const auto& infos = m.param_infos();
  CHECK(infos.front().name == "transformer.ln_f.weight");
  CHECK(infos[2].name == "transformer.h.2.ln_1.weight");
  CHECK(infos.back().name == "transformer.wte.weight");
  std::int64_t expected_offset = 0;
  for (const auto& info : infos) {
    CHECK(info.offset == expected_offset);
    expected_offset += info.numel;
    CHECK(info.decay == (info.shape.size() == 2));
  }
  // wte (V C) + wpe (T C) + per layer: two LayerNorms (4 C), qkv (3C C + 3C), attention projection
  // (C C + C), MLP (F C + F + C F + C); + ln_f (2 C).
  const std::int64_t C = 4, F = 16, L = 3;
  const std::int64_t per_layer = 4 * C + 3 * C * C + 3 * C + C * C + C + F * C + F + C * F + C;
  CHECK(m.num_params() == 10 * C + 6 * C + L * per_layer + 2 * C);
}

TEST_CASE("decoding with the KV cache gives the logits of the full forward pass", "[model][generate]") {
  check_decoding("gpt2");
}

TEST_CASE("Llama decoding with the grouped KV cache gives the logits of the full forward pass",
          "[model][generate][llama]") {
  check_decoding("llama");
}

TEST_CASE("plan's parameter count and activation memory agree with the models' own layouts", "[model][plan]") {
  for (const std::string arch : {"gpt2", "llama"}) {
    for (const auto recompute : {config::Recompute::none, config::Recompute::mlp, config::Recompute::full}) {
      config::ModelConfig c;
      c.arch = *config::parse_choice<config::Arch>(arch);
      c.vocab_size = 37;
      c.context_length = 12;
      c.n_layer = 3;
      c.n_head = 4;
      c.n_kv_head = arch == "llama" ? 2 : 4;
      c.d_model = 16;
      c.ffn_hidden = arch == "llama" ? 40 : 64;
      c.tie_embeddings = arch == "gpt2";
      CAPTURE(arch, config::to_string(recompute));
      const auto m = model::make_model(c, Device::cpu, recompute);
      CHECK(plan::parameter_count(c) == m->num_params());
      const int B = 3;
      const auto planned = B * plan::activation_bytes_per_sequence(c, false, recompute);
      const auto actual = std::int64_t(m->activation_bytes(B, int(c.context_length)));
      // The model rounds each of its (at most 40 + 20 L) buffers up to 64 bytes, at B sequences;
      // the plan measures one sequence (rounded the same way) and multiplies.
      CAPTURE(planned, actual);
      CHECK(actual >= planned);
      CHECK(actual - planned <= 64 * (40 + 20 * c.n_layer));
      // One sequence: the plan is the model's own buffer, byte for byte, in fp32 and in bf16
      // (whose statistics stay f32).
      for (const bool bf16 : {false, true}) {
        CAPTURE(bf16);
        const auto mixed = model::make_model(c, Device::cpu, recompute, bf16 ? DType::bf16 : DType::f32);
        CHECK(plan::activation_bytes_per_sequence(c, bf16, recompute) ==
              std::int64_t(mixed->activation_bytes(1, int(c.context_length))));
      }
    }
  }
}

TEST_CASE("bf16 mixed precision follows the float64 reference to bf16 accuracy", "[model][golden][bf16]") {
  for (const std::string arch : {"gpt2", "llama"}) {
    CAPTURE(arch);
    const Golden g(arch);
    const auto f32 = g.make_model();
    auto m = model::make_model(g.config.model, Device::cpu, model::Recompute::none, DType::bf16);
    ops::copy(m->params(), f32->params());
    const double n = double(g.B) * g.T;
    m->zero_grads();
    const double loss = m->forward(g.inputs.data(), g.targets.data(), g.B, g.T, float(1.0 / n)) / n;
    const float reference_loss = read(g.file, "loss")[0];
    CAPTURE(loss, reference_loss);
    CHECK(std::abs(loss - reference_loss) / reference_loss < 1e-2);
    m->backward();
    // Gradients in f32, from bf16 activations: a few bf16 ulps (2^-8) of error, summed over layers.
    for (const auto& info : m->param_infos()) {
      const double error = relative_error(m->grad(info).as<float>(), read(g.file, "grad/" + info.name));
      CAPTURE(info.name, error);
      CHECK(error < 5e-2);
    }
    // The master weights stay f32 and untouched; the working copy is their bf16 rounding.
    CHECK(m->params().dtype == DType::f32);
    CHECK(std::memcmp(m->params().data, f32->params().data, f32->params().bytes()) == 0);
  }
}

TEST_CASE("convert rounds to the nearest bf16, ties to even", "[ops][bf16]") {
  const std::vector<float> in = {1.0f, 1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, -2.5f, 1e-40f, 65536.0f * 65536.0f,
                                 std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()};
  std::vector<std::uint16_t> bits(in.size());
  ops::convert(Tensor(bits.data(), DType::bf16, Device::cpu, {std::int64_t(in.size())}),
               Tensor(const_cast<float*>(in.data()), DType::f32, Device::cpu, {std::int64_t(in.size())}));
  // 1 + 2^-8 is halfway between 1 (even mantissa) and 1 + 2^-7: to 1. 1 + 3 2^-8 is halfway
  // between 1 + 2^-7 (odd) and 1 + 2^-6: up.
  CHECK(bits[0] == 0x3F80);
  CHECK(bits[1] == 0x3F80);
  CHECK(bits[2] == 0x3F82);
  CHECK(bits[3] == 0xC020);
  CHECK(bits[5] == 0x4F80);
  CHECK(bits[6] == 0x7F80);
  CHECK((bits[7] & 0x7F80) == 0x7F80);
  CHECK((bits[7] & 0x007F) != 0);  // still a NaN
  std::vector<float> back(in.size());
  ops::convert(Tensor(back.data(), DType::f32, Device::cpu, {std::int64_t(in.size())}),
               Tensor(bits.data(), DType::bf16, Device::cpu, {std::int64_t(in.size())}));
  CHECK(back[2] == 1.0f + 0x1p-6f);
  CHECK(back[3] == -2.5f);
  CHECK(back[4] == 0x1p-133f);  // 1e-40 = 1.09 x 2^-133, a float subnormal: bf16 keeps multiples of 2^-133
}

TEST_CASE("mixed precision: the optimizer writes the bf16 working copy, and forward sees params() writes",
          "[model][optim][bf16]") {
  const Golden g("gpt2");
  const auto f32_model = g.make_model();
  const auto make_bf16 = [&] {
    auto m = model::make_model(g.config.model, Device::cpu, model::Recompute::none, DType::bf16);
    ops::copy(m->params(), f32_model->params());
    return m;
  };
  const auto owner = make_bf16(), twin_owner = make_bf16();
  model::Model &m = *owner, &twin = *twin_owner;
  const std::int64_t P = m.num_params();
  const double n = double(g.B) * g.T;
  const auto loss_of = [&](model::Model& model) {
    return model.forward(g.inputs.data(), g.targets.data(), g.B, g.T, 0.0f);
  };
  optim::AdamW optimizer({{0, P, 0}}, g.config.optim);
  for (std::int64_t step = 1; step <= 3; ++step) {
    m.zero_grads();
    m.forward(g.inputs.data(), g.targets.data(), g.B, g.T, float(1.0 / n));
    m.backward();
    const double norm = std::sqrt(ops::sum_squares(m.grads()));
    optimizer.update({m.param_infos(), m.params(), m.grads(), norm, g.config.train.grad_clip, g.config.optim.lr, step,
                      m.working_weights()});
    m.working_weights_written();
    // The next forward uses the copy as the optimizer left it: the loss of a model that converts
    // the same master weights afresh.
    const double loss = loss_of(m);
    ops::copy(twin.params(), m.params());
    CAPTURE(step);
    CHECK(loss == loss_of(twin));
  }
  // Every element of the copy is its master weight rounded to nearest even.
  const Tensor working = m.working_weights();
  REQUIRE(working.numel() == P);
  std::int64_t wrong = 0;
  for (std::int64_t i = 0; i < P; ++i) {
    wrong += working.as<std::uint16_t>()[i] != float_to_bf16_bits(m.params().as<float>()[i]);
  }
  CHECK(wrong == 0);
  // A write through params() (a load, a copy) is seen by the next forward without being announced.
  const double before = loss_of(m);
  float* w = m.params().as<float>();
  for (std::int64_t i = 0; i < P; ++i) w[i] *= 0.5f;
  const double after = loss_of(m);
  ops::copy(twin.params(), m.params());
  CHECK(after != before);
  CHECK(after == loss_of(twin));
  // An f32 model has no working copy.
  CHECK(f32_model->working_weights().data == nullptr);
}
