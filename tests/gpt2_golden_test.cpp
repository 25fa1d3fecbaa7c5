// GPT-2 against the golden file of an independent PyTorch model (scripts/gen_reference.py,
// float64): logits, loss, every parameter gradient, and ten AdamW steps with clipping.
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "catch_compat.h"
#include "checkpoint/safetensors.h"
#include "model/gpt2.h"
#include "train/adamw.h"
#include "weights_compare.h"

using namespace llmtrain;

namespace {

const std::string golden_path = LLMTRAIN_SOURCE_DIR "/tests/data/gpt2_reference.safetensors";

std::vector<float> read(const checkpoint::SafetensorsReader& r, const std::string& name) {
  const auto* info = r.find(name);
  REQUIRE(info != nullptr);
  std::vector<float> out(std::size_t(info->numel()));
  r.read_f32(name, out);
  return out;
}

std::vector<std::int32_t> read_i32(const checkpoint::SafetensorsReader& r, const std::string& name) {
  const auto* info = r.find(name);
  REQUIRE(info != nullptr);
  const auto bytes = r.data(*info);
  std::vector<std::int32_t> out(bytes.size() / 4);
  std::memcpy(out.data(), bytes.data(), bytes.size());
  return out;
}

// |a - b| / |b| over whole tensors.
double relative_error(const float* a, const std::vector<float>& b) {
  double diff = 0.0, ref = 0.0;
  for (std::size_t i = 0; i < b.size(); ++i) {
    diff += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    ref += double(b[i]) * b[i];
  }
  return std::sqrt(diff / ref);
}

struct Golden {
  checkpoint::SafetensorsReader file{golden_path};
  config::Config config;
  int B, T;
  std::vector<std::int32_t> inputs, targets;

  Golden() {
    const auto& meta = file.metadata();
    B = std::stoi(meta.at("B"));
    T = std::stoi(meta.at("T"));
    config.model.vocab_size = std::stoi(meta.at("V"));
    config.model.context_length = std::stoi(meta.at("maxT"));
    config.model.n_layer = std::stoi(meta.at("L"));
    config.model.n_head = std::stoi(meta.at("NH"));
    config.model.n_kv_head = config.model.n_head;
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

  void load_params(model::Gpt2& m) const {
    for (const auto& info : m.param_infos()) {
      file.read_f32("param/" + info.name, std::span<float>(m.param(info).as<float>(), std::size_t(info.numel)));
    }
  }
};

}  // namespace

TEST_CASE("GPT-2 logits, loss and gradients match the PyTorch golden file", "[model][golden]") {
  const Golden g;
  model::Gpt2 m(g.config.model, Device::cpu);
  g.load_params(m);
  const double n = double(g.B) * g.T;

  const double loss = m.forward(g.inputs.data(), g.targets.data(), g.B, g.T, 0.0f) / n;
  const float reference_loss = read(g.file, "loss")[0];
  CAPTURE(loss, reference_loss);
  CHECK(std::abs(loss - reference_loss) / reference_loss < 1e-5);
  CHECK(relative_error(m.logits().as<float>(), read(g.file, "logits")) < 1e-5);

  m.zero_grads();
  m.forward(g.inputs.data(), g.targets.data(), g.B, g.T, float(1.0 / n));
  m.backward();
  for (const auto& info : m.param_infos()) {
    CAPTURE(info.name);
    const double error = relative_error(m.grad(info).as<float>(), read(g.file, "grad/" + info.name));
    CAPTURE(error);
    CHECK(error < 1e-4);
  }
}

TEST_CASE("ten AdamW steps follow the PyTorch loss curve", "[model][golden][optim]") {
  const Golden g;
  model::Gpt2 m(g.config.model, Device::cpu);
  g.load_params(m);
  train::AdamW optimizer(0, m.num_params());
  const auto reference = read(g.file, "adamw_losses");
  const double n = double(g.B) * g.T;
  for (std::size_t step = 1; step <= reference.size(); ++step) {
    m.zero_grads();
    const double loss = m.forward(g.inputs.data(), g.targets.data(), g.B, g.T, float(1.0 / n)) / n;
    m.backward();
    CAPTURE(step, loss, reference[step - 1]);
    CHECK(std::abs(loss - reference[step - 1]) / reference[step - 1] < 1e-4);
    optimizer.update(m, g.config.optim, g.config.train.grad_clip, g.config.optim.lr, std::int64_t(step));
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
  const Golden g;
  model::Gpt2 m(g.config.model, Device::cpu);
  g.load_params(m);
  m.forward(g.inputs.data(), nullptr, 1, g.T, 0.0f);  // the first sequence, all positions at once
  const std::vector<float> full(m.logits().as<float>(), m.logits().as<float>() + m.logits().numel());
  const std::int64_t V = g.config.model.vocab_size;
  for (int pos = 0; pos < g.T; ++pos) {
    const Tensor step = m.decode_step(g.inputs[std::size_t(pos)], pos);
    const std::vector<float> expected(full.begin() + pos * V, full.begin() + (pos + 1) * V);
    CAPTURE(pos);
    CHECK(relative_error(step.as<float>(), expected) < 1e-5);
  }
}
