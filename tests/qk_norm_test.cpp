// model.qk_norm on the CPU, through the whole Llama model: the gradients of the q_norm and k_norm
// weights and of the projections they follow against central finite differences of the model's
// loss; the loss unchanged when a query or key head's projection rows are scaled (what the
// per-head norm removes); recompute "full" the same gradients; KV-cache decoding the same logits
// as the whole-sequence forward.
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "catch_compat.h"
#include "config/config.h"
#include "model/model.h"
#include "ops/ops.h"

using namespace llmtrain;

namespace {

config::ModelConfig qk_llama() {
  config::ModelConfig c;
  c.arch = config::Arch::llama;
  c.vocab_size = 23;
  c.context_length = 9;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_kv_head = 2;
  c.d_model = 16;  // head size 4
  c.ffn_hidden = 24;
  c.tie_embeddings = false;
  c.qk_norm = true;
  c.norm_eps = 1e-6;
  return c;
}

// Weights large enough that attention is far from uniform (the norms' gradients are then not tiny).
void randomise(model::Model& m, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.4f);
  for (const auto& info : m.param_infos()) {
    float* p = m.param(info).as<float>();
    const bool norm = info.shape.size() == 1;
    for (std::int64_t i = 0; i < info.numel; ++i) p[i] = norm ? 1.0f + 0.5f * normal(rng) : normal(rng);
  }
}

struct Batch {
  int B = 2, T = 7;
  std::vector<std::int32_t> inputs, targets;
  Batch() {
    for (int i = 0; i < B * T; ++i) {
      inputs.push_back(std::int32_t(i * 7 % 23));
      targets.push_back(std::int32_t((i * 5 + 3) % 23));
    }
  }
};

const model::ParamInfo& info_named(const model::Model& m, const std::string& name) {
  for (const auto& info : m.param_infos()) {
    if (info.name == name) return info;
  }
  FAIL("no parameter " + name);
  throw 0;
}

}  // namespace

TEST_CASE("qk_norm: the Llama model's gradients equal finite differences of its loss", "[model][llama][grad]") {
  const auto m = model::make_model(qk_llama(), Device::cpu);
  randomise(*m, 3);
  const Batch b;
  const auto loss = [&] { return m->forward(b.inputs.data(), b.targets.data(), b.B, b.T, 0.0f); };
  m->zero_grads();
  m->forward(b.inputs.data(), b.targets.data(), b.B, b.T, 1.0f);
  m->backward();
  for (const std::string name : {"model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight",
                                 "model.layers.1.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight",
                                 "model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
                                 "model.layers.0.self_attn.v_proj.weight"}) {
    CAPTURE(name);
    const auto& info = info_named(*m, name);
    float* w = m->param(info).as<float>();
    const float* g = m->grad(info).as<float>();
    double diff2 = 0.0, ref2 = 0.0;
    const double eps = 1e-2;
    for (std::int64_t i = 0; i < info.numel; i += std::max<std::int64_t>(1, info.numel / 24)) {
      const float saved = w[i];
      w[i] = saved + float(eps);
      const double plus = loss();
      w[i] = saved - float(eps);
      const double minus = loss();
      w[i] = saved;
      const double numeric = (plus - minus) / (2 * eps);
      diff2 += (numeric - g[i]) * (numeric - g[i]);
      ref2 += numeric * numeric;
    }
    CAPTURE(std::sqrt(diff2), std::sqrt(ref2));
    REQUIRE(ref2 > 1e-6);  // not trivially zero
    CHECK(std::sqrt(diff2 / ref2) < 5e-3);
  }
}

TEST_CASE("qk_norm: scaling a head's query or key projection rows leaves the loss; without it, not",
          "[model][llama]") {
  for (const bool qk_norm : {true, false}) {
    CAPTURE(qk_norm);
    auto c = qk_llama();
    c.qk_norm = qk_norm;
    const auto m = model::make_model(c, Device::cpu);
    randomise(*m, 5);
    const Batch b;
    const double before = m->forward(b.inputs.data(), b.targets.data(), b.B, b.T, 0.0f);
    // Query head 1 and key head 0 of layer 0 (head size 4: rows 4..7 of q_proj, 0..3 of k_proj).
    float* q = m->param(info_named(*m, "model.layers.0.self_attn.q_proj.weight")).as<float>();
    float* k = m->param(info_named(*m, "model.layers.0.self_attn.k_proj.weight")).as<float>();
    for (int i = 4 * 16; i < 8 * 16; ++i) q[i] *= 3.0f;
    for (int i = 0; i < 4 * 16; ++i) k[i] *= 0.25f;
    const double after = m->forward(b.inputs.data(), b.targets.data(), b.B, b.T, 0.0f);
    CAPTURE(before, after);
    if (qk_norm) {
      CHECK(std::abs(after - before) < 1e-4 * std::abs(before));
    } else {
      CHECK(std::abs(after - before) > 1e-2 * std::abs(before));
    }
  }
}

TEST_CASE("qk_norm: recompute full gives the same gradients; KV-cache decoding the forward's logits",
          "[model][llama][generate]") {
  const auto c = qk_llama();
  const auto plain = model::make_model(c, Device::cpu);
  const auto full = model::make_model(c, Device::cpu, model::Recompute::full);
  randomise(*plain, 7);
  ops::copy(full->params(), plain->params());
  const Batch b;
  for (model::Model* m : {plain.get(), full.get()}) {
    m->zero_grads();
    m->forward(b.inputs.data(), b.targets.data(), b.B, b.T, 1.0f / float(b.B * b.T));
    m->backward();
  }
  const float* g1 = plain->grads().as<float>();
  const float* g2 = full->grads().as<float>();
  double max_diff = 0.0, max_grad = 0.0;
  for (std::int64_t i = 0; i < plain->grads().numel(); ++i) {
    max_diff = std::max(max_diff, double(std::abs(g1[i] - g2[i])));
    max_grad = std::max(max_grad, double(std::abs(g1[i])));
  }
  CAPTURE(max_diff, max_grad);
  CHECK(max_grad > 0.0);
  CHECK(max_diff <= 1e-6 * max_grad);

  // The first sequence's logits, position by position, against the whole-sequence forward's.
  plain->forward(b.inputs.data(), nullptr, 1, b.T, 0.0f);
  const Tensor whole = plain->logits();  // (1, T, V)
  std::vector<float> expected(whole.as<float>(), whole.as<float>() + whole.numel());
  for (int pos = 0; pos < b.T; ++pos) {
    const Tensor step = plain->decode_step(b.inputs[std::size_t(pos)], pos);
    double worst = 0.0;
    for (std::int64_t v = 0; v < c.vocab_size; ++v) {
      worst = std::max(worst, double(std::abs(step.as<float>()[v] - expected[std::size_t(pos * c.vocab_size + v)])));
    }
    CAPTURE(pos, worst);
    CHECK(worst < 1e-4);
  }
}
