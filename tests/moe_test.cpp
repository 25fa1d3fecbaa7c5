// The Mixture-of-Experts kernels and layer: hand-computed router, capacity and loss cases, and the
// layer's gradients (router, experts, shared experts, the load-balancing and z losses) against
// central finite differences.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "catch_compat.h"
#include "grad_check.h"
#include "model/model.h"
#include "model/moe_layer.h"
#include "ops/moe_ops.h"
#include "split_backward.h"

using namespace llmtrain;
using test::random_vec;
using test::t;
using test::ti;
using test::Vec;

namespace {

struct Router {
  Vec probs, weights, counts, pbar, losses{0, 0, 0};
  std::vector<std::int32_t> experts;
};

Router route(Vec logits, int N, int E, int k, ops::RouterKind kind, Vec bias = {}) {
  Router r{Vec(std::size_t(N * E)), Vec(std::size_t(N * k)), Vec(std::size_t(E)), Vec(std::size_t(E)), Vec(3),
           std::vector<std::int32_t>(std::size_t(N * k))};
  ops::moe_router_forward(t(r.probs, {N, E}), ti(r.experts, {N, k}), t(r.weights, {N, k}), t(r.counts, {E}),
                          t(r.pbar, {E}), t(r.losses, {3}), t(logits, {N, E}), bias.empty() ? Tensor() : t(bias, {E}), kind);
  return r;
}

}  // namespace

TEST_CASE("moe router: softmax top-k with ties to the lower index, with and without renormalisation") {
  const Vec logits{0.0f, 2.0f, 2.0f, 1.0f};
  const double Z = 1.0 + 2.0 * std::exp(2.0) + std::exp(1.0), p1 = std::exp(2.0) / Z, p3 = std::exp(1.0) / Z;
  const Router one = route(logits, 1, 4, 1, {false, true, 1.0f});
  CHECK(one.experts[0] == 1);  // experts 1 and 2 tie: the lower index
  CHECK(one.weights[0] == Approx(1.0));
  const Router two = route(logits, 1, 4, 3, {false, true, 1.0f});
  CHECK(two.experts == std::vector<std::int32_t>{1, 2, 3});
  CHECK(two.weights[0] == Approx(p1 / (2 * p1 + p3)));
  CHECK(two.weights[2] == Approx(p3 / (2 * p1 + p3)));
  const Router raw = route(logits, 1, 4, 3, {false, false, 1.0f});  // Qwen3-MoE's norm_topk_prob false
  CHECK(raw.weights[0] == Approx(p1));
  CHECK(raw.weights[2] == Approx(p3));
  CHECK(raw.probs[0] == Approx(1.0 / Z));
}

TEST_CASE("moe router: sigmoid scores, chosen on score plus bias, weighted by the scores times route_scale") {
  const Vec logits{0.0f, 1.0f, -1.0f, 2.0f};
  const auto sig = [](double x) { return 1.0 / (1.0 + std::exp(-x)); };
  // Scores 0.5, 0.731, 0.269, 0.881; the bias lifts expert 2 to the top.
  const Router r = route(logits, 1, 4, 2, {true, false, 2.5f}, Vec{0.0f, 0.0f, 3.0f, 0.0f});
  CHECK(r.experts == std::vector<std::int32_t>{2, 3});
  const double s2 = sig(-1.0), s3 = sig(2.0);
  CHECK(r.weights[0] == Approx(2.5 * s2 / (s2 + s3)));
  CHECK(r.weights[1] == Approx(2.5 * s3 / (s2 + s3)));
  const Router plain = route(logits, 1, 4, 2, {true, false, 1.0f});
  CHECK(plain.experts == std::vector<std::int32_t>{3, 1});
  // Pbar is the scores normalised over the experts: aux = (E/k) sum_e (c_e / N) Pbar_e.
  const double sum = sig(0.0) + sig(1.0) + sig(-1.0) + sig(2.0);
  CHECK(plain.losses[0] == Approx(4.0 / 2.0 * (sig(1.0) + sig(2.0)) / sum));
  CHECK(plain.pbar[3] == Approx(sig(2.0) / sum));
}

TEST_CASE("moe router: load-balancing loss, z-loss and load imbalance by hand") {
  const float l3 = float(std::log(3.0));
  // Balanced: token 0 prefers expert 1 (p .25, .75), token 1 expert 0: counts 1, 1, Pbar .5, .5.
  const Router even = route({0.0f, l3, l3, 0.0f}, 2, 2, 1, {false, true, 1.0f});
  CHECK(even.losses[0] == Approx(2.0 * (0.5 * 0.5 + 0.5 * 0.5)));
  CHECK(even.losses[2] == Approx(1.0));
  // Skewed: both choose expert 1: counts 0, 2, Pbar .25, .75: aux = 2 (1 x .75) = 1.5.
  const Router skew = route({0.0f, l3, 0.0f, l3}, 2, 2, 1, {false, true, 1.0f});
  CHECK(skew.losses[0] == Approx(1.5));
  CHECK(skew.losses[1] == Approx(std::log(4.0) * std::log(4.0)));  // lse = ln 4 for both
  CHECK(skew.losses[2] == Approx(2.0));
  CHECK(skew.counts == Vec{0.0f, 2.0f});
  CHECK(skew.pbar[0] == Approx(0.25));
  CHECK(skew.pbar[1] == Approx(0.75));
}

TEST_CASE("moe dispatch: capacity drops the later slots in token order, and a large factor equals dropless") {
  std::vector<std::int32_t> experts{0, 1, 0, 0, 0, 1, 0, 0};  // N = 4 tokens, k = 2
  const auto plan = [&](std::int64_t capacity) {
    std::vector<std::int32_t> offsets(3), row_slot(8), slot_row(8);
    Vec dropped(1);
    ops::moe_dispatch(ti(offsets, {3}), ti(row_slot, {8}), ti(slot_row, {8}), t(dropped, {1}), ti(experts, {4, 2}),
                      capacity);
    return std::tuple(offsets, slot_row, dropped[0]);
  };
  config::MoeConfig moe;
  moe.experts = 2;
  moe.top_k = 2;
  moe.capacity_factor = 0.5;  // ceil(0.5 x 4 x 2 / 2) = 2 slots per expert
  CHECK(model::moe_capacity(moe, 4) == 2);
  const auto [offsets, slot_row, dropped] = plan(model::moe_capacity(moe, 4));
  // Expert 0 is chosen by slots 0, 2, 3, 4, 6, 7: it keeps 0 and 2; expert 1 keeps 1 and 5.
  CHECK(offsets == std::vector<std::int32_t>{0, 2, 4});
  CHECK(slot_row == std::vector<std::int32_t>{0, 2, 1, -1, -1, 3, -1, -1});
  CHECK(dropped == Approx(4.0 / 8.0));
  const auto [o0, s0, d0] = plan(0);
  const auto [o9, s9, d9] = plan(model::moe_capacity({true, 2, 2, 1, 0, 0, 0, "softmax", true, 1, 0, 0, 0, 100.0}, 4));
  CHECK(o0 == std::vector<std::int32_t>{0, 6, 8});
  CHECK(s0 == std::vector<std::int32_t>{0, 6, 1, 2, 3, 7, 4, 5});
  CHECK(d0 == 0.0f);
  CHECK(o9 == o0);
  CHECK(s9 == s0);
  CHECK(d9 == 0.0f);
}

namespace {

// One MoE layer over std::vectors: its weights, activations and scratch, forward and backward.
struct Layer {
  config::MoeConfig moe;
  std::int64_t N, C;
  Vec router, gate, up, down, sgate, sup, sdown, bias;
  std::vector<char> acts, grads;
  model::MoeActs a;
  model::MoeGrads g;

  Layer(config::MoeConfig m, std::int64_t n, std::int64_t c, std::mt19937& rng) : moe(m), N(n), C(c) {
    const std::int64_t E = m.experts, I = m.ffn_hidden, S = m.shared_experts * m.shared_ffn_hidden;
    router = random_vec(rng, std::size_t(E * C), 0.8f);
    gate = random_vec(rng, std::size_t(E * I * C), 0.5f);
    up = random_vec(rng, std::size_t(E * I * C), 0.5f);
    down = random_vec(rng, std::size_t(E * C * I), 0.5f);
    sgate = random_vec(rng, std::size_t(S * C), 0.5f);
    sup = random_vec(rng, std::size_t(S * C), 0.5f);
    sdown = random_vec(rng, std::size_t(C * S), 0.5f);
    bias = random_vec(rng, std::size_t(E), 0.3f);
    config::ModelConfig mc;
    mc.d_model = C;
    mc.moe = m;
    model::Carver measure = model::Carver::measuring();
    model::ActsCarver take{measure, DType::f32};
    model::lay_out_moe_acts(take, mc, N, a);
    model::lay_out_moe_grads(take, mc, N, g);
    acts.resize(measure.used + 64);
    model::Carver carve{acts.data() + (64 - std::uintptr_t(acts.data()) % 64) % 64, Device::cpu};
    model::ActsCarver into{carve, DType::f32};
    model::lay_out_moe_acts(into, mc, N, a);
    model::lay_out_moe_grads(into, mc, N, g);
  }
  model::MoeWeights weights(Vec& r, Vec& gt, Vec& u, Vec& d, Vec& sg, Vec& su, Vec& sd, bool with_bias) {
    const std::int64_t E = moe.experts, I = moe.ffn_hidden, S = moe.shared_experts * moe.shared_ffn_hidden;
    model::MoeWeights w{t(r, {E, C}), with_bias ? t(bias, {E}) : Tensor(), t(gt, {E, I, C}), t(u, {E, I, C}),
                        t(d, {E, C, I}), Tensor(), Tensor(), Tensor()};
    if (S > 0) {
      w.shared_gate = t(sg, {S, C});
      w.shared_up = t(su, {S, C});
      w.shared_down = t(sd, {C, S});
    }
    return w;
  }
  model::MoeWeights params() { return weights(router, gate, up, down, sgate, sup, sdown, true); }
};

}  // namespace

TEST_CASE("moe layer: gradients of the input, router, experts and shared experts, with the aux and z losses, "
          "match finite differences") {
  struct Case {
    const char* name;
    config::MoeConfig moe;
  };
  //                                        enabled E  k  I  S  Is first router     norm scale aux  z    bias cap
  const Case cases[] = {{"softmax, renormalised", {true, 4, 2, 5, 0, 5, 0, "softmax", true, 1.0, 0.3, 0.1, 0, 0}},
                        {"softmax, raw weights, shared", {true, 3, 2, 4, 2, 3, 0, "softmax", false, 1.0, 0.2, 0.05, 0, 0}},
                        {"sigmoid, biased, scaled", {true, 4, 2, 3, 1, 4, 0, "sigmoid", true, 2.5, 0.3, 0.1, 0.1, 0}},
                        {"softmax with capacity", {true, 4, 2, 3, 0, 3, 0, "softmax", true, 1.0, 0.3, 0.1, 0, 0.75}}};
  for (const Case& c : cases) {
    SECTION(c.name) {
      std::mt19937 rng(7);
      const std::int64_t N = 6, C = 5;
      Layer layer(c.moe, N, C, rng);
      const bool with_bias = c.moe.router == "sigmoid";
      Vec ln = random_vec(rng, std::size_t(N * C));
      Vec R = random_vec(rng, std::size_t(N * C));
      Vec out(std::size_t(N * C));
      const std::int64_t capacity = model::moe_capacity(c.moe, N);
      model::Linears linears(Device::cpu);
      const auto loss = [&] {
        const model::MoeWeights w = layer.params();
        const model::MoeLayerStats s = model::moe_forward(linears, c.moe, w, layer.a,
                                                          t(ln, {N, C}), t(out, {N, C}), capacity);
        return test::weighted_sum(out, R) + c.moe.aux_loss_coef * s.aux + c.moe.z_loss_coef * s.z;
      };
      loss();
      if (c.moe.capacity_factor > 0) CHECK(layer.a.dropped.as<float>()[0] > 0.0f);  // something was dropped
      Vec d_ln(ln.size()), d_router(layer.router.size()), d_gate(layer.gate.size()), d_up(layer.up.size()),
          d_down(layer.down.size()), d_sg(layer.sgate.size()), d_su(layer.sup.size()),
          d_sd(layer.sdown.size());
      const model::MoeWeights gw = layer.weights(d_router, d_gate, d_up, d_down, d_sg, d_su, d_sd, false);
      model::moe_backward(linears, c.moe, layer.params(), gw, layer.a, layer.g,
                          t(ln, {N, C}), t(d_ln, {N, C}), t(R, {N, C}), float(c.moe.aux_loss_coef),
                          float(c.moe.z_loss_coef));
      test::check_gradient("ln", ln, d_ln, loss, 1e-3, 5e-3);
      test::check_gradient("router", layer.router, d_router, loss, 1e-3, 5e-3);
      test::check_gradient("experts.gate_proj", layer.gate, d_gate, loss, 1e-3, 5e-3);
      test::check_gradient("experts.up_proj", layer.up, d_up, loss, 1e-3, 5e-3);
      test::check_gradient("experts.down_proj", layer.down, d_down, loss, 1e-3, 5e-3);
      if (c.moe.shared_experts > 0) {
        test::check_gradient("shared gate_proj", layer.sgate, d_sg, loss, 1e-3, 5e-3);
        test::check_gradient("shared down_proj", layer.sdown, d_sd, loss, 1e-3, 5e-3);
      }
      (void)with_bias;
    }
  }
}

TEST_CASE("moe layer: the router's aux and z loss gradients alone match finite differences") {
  // dweights 0: only the losses reach the logits (the experts' outputs ignored).
  for (const bool sigmoid : {false, true}) {
    std::mt19937 rng(3);
    const int N = 5, E = 4, k = 2;
    Vec logits = random_vec(rng, std::size_t(N * E));
    const ops::RouterKind kind{sigmoid, true, 1.0f};
    const auto loss = [&] {
      const Router r = route(logits, N, E, k, kind);
      return 0.7 * r.losses[0] + 0.3 * r.losses[1];
    };
    const Router r = route(logits, N, E, k, kind);
    Vec dlogits(logits.size()), dweights(std::size_t(N * k), 0.0f);
    std::vector<std::int32_t> experts = r.experts;
    Vec probs = r.probs, counts = r.counts;
    ops::moe_router_backward(t(dlogits, {N, E}), t(dweights, {N, k}), t(logits, {N, E}), t(probs, {N, E}),
                             ti(experts, {N, k}), t(counts, {E}), kind, 0.7f, 0.3f);
    test::check_gradient(sigmoid ? "sigmoid logits" : "softmax logits", logits, dlogits, loss, 1e-3, 5e-3);
  }
}

namespace {

// A Llama of 3 layers (the first dense) on a vocabulary of 37 and a context of 12, its MoE layers `moe`'s.
config::ModelConfig tiny_moe_llama(const config::MoeConfig& moe) {
  config::ModelConfig c;
  c.arch = config::Arch::llama;
  c.vocab_size = 37;
  c.context_length = 12;
  c.n_layer = 3;
  c.n_head = 2;
  c.n_kv_head = 1;
  c.d_model = 16;
  c.ffn_hidden = 20;
  c.tie_embeddings = false;
  c.moe = moe;
  return c;
}

}  // namespace

TEST_CASE("moe model: decode_step with the KV cache gives the full forward's logits, position by position") {
  const config::ModelConfig c = tiny_moe_llama({true, 4, 2, 8, 1, 6, 1, "sigmoid", true, 2.0, 0.01, 0.0, 0.0, 0.0});
  auto m = model::make_model(c, Device::cpu);
  m->init_weights(11);
  std::mt19937 rng(4);
  std::vector<std::int32_t> tokens(12);
  for (auto& tok : tokens) tok = std::int32_t(rng() % 37);
  m->forward(tokens.data(), nullptr, 1, 12, 0.0f);
  const Vec full(m->logits().as<float>(), m->logits().as<float>() + m->logits().numel());
  double worst = 0.0, scale = 0.0;
  for (int pos = 0; pos < 12; ++pos) {
    const Tensor step = m->decode_step(tokens[std::size_t(pos)], pos);
    for (int v = 0; v < 37; ++v) {
      worst = std::max(worst, double(std::fabs(step.as<float>()[v] - full[std::size_t(pos * 37 + v)])));
      scale = std::max(scale, double(std::fabs(full[std::size_t(pos * 37 + v)])));
    }
  }
  CAPTURE(worst, scale);
  CHECK(scale > 0.01);
  CHECK(worst < 1e-5 * scale + 1e-6);
}

TEST_CASE("moe model: train.recompute mlp and full, and the backward split into input and weight gradients, give "
          "the whole backward's loss, gradients and router statistics, bit for bit") {
  // A dense first layer and two MoE layers; a softmax router with a shared expert and a capacity
  // that drops slots, then a sigmoid router with an expert bias. Two micro-batches accumulate.
  for (const bool sigmoid : {false, true}) {
    const config::ModelConfig c =
        tiny_moe_llama(sigmoid ? config::MoeConfig{true, 4, 2, 8, 0, 8, 1, "sigmoid", true, 2.0, 0.0, 0.001, 0.01, 0.0}
                               : config::MoeConfig{true, 4, 2, 8, 1, 6, 1, "softmax", true, 1.0, 0.01, 0.001, 0.0, 0.75});
    const int B = 2, T = 12;
    std::mt19937 rng(9);
    std::vector<std::int32_t> inputs(2 * B * T), targets(2 * B * T);
    for (auto& tok : inputs) tok = std::int32_t(rng() % 37);
    for (auto& tok : targets) tok = std::int32_t(rng() % 37);
    struct Result {
      std::vector<double> losses;
      Vec grads;
      model::MoeStats stats;
    };
    const auto run = [&](model::Recompute recompute) {
      auto m = model::make_model(c, Device::cpu, recompute);
      m->init_weights(5);
      m->zero_grads();
      Result r;
      for (int micro = 0; micro < 2; ++micro) {
        const std::size_t at = std::size_t(micro * B * T);
        r.losses.push_back(m->forward(inputs.data() + at, targets.data() + at, B, T, 1.0f / float(2 * B * T)));
        m->backward();
      }
      r.grads.assign(m->grads().as<float>(), m->grads().as<float>() + m->num_params());
      r.stats = m->take_moe_stats();
      return r;
    };
    const Result none = run(model::Recompute::none);
    {  // the backward split into input and weight gradients (a zero-bubble schedule's), in two slots
      auto m = model::make_model(c, Device::cpu);
      m->init_weights(5);
      const test::TwoSlotRun split = test::run_two_slots(*m, true, [&](int slot) {
        const std::size_t at = std::size_t(slot * B * T);
        return m->forward(inputs.data() + at, targets.data() + at, B, T, 1.0f / float(2 * B * T));
      });
      CHECK(split.losses == none.losses);
      CHECK(split.after_backward != split.gradients);
      // The same sums in the same order as F0 B0 F1 B1: each weight gradient adds micro-batch 0's, then 1's.
      CHECK(split.gradients == none.grads);
    }
    CHECK(none.stats.forwards == 2);
    if (!sigmoid) CHECK(none.stats.dropped > 0.0);  // the capacity drops slots
    CHECK(std::any_of(none.grads.begin(), none.grads.end(), [](float g) { return g != 0.0f; }));
    for (const auto recompute : {model::Recompute::mlp, model::Recompute::full}) {
      CAPTURE(sigmoid, config::to_string(recompute));
      const Result again = run(recompute);
      CHECK(again.losses == none.losses);
      CHECK(again.grads == none.grads);
      CHECK(again.stats.forwards == none.stats.forwards);
      CHECK(again.stats.aux == none.stats.aux);
      CHECK(again.stats.z == none.stats.z);
      CHECK(again.stats.dropped == none.stats.dropped);
      CHECK(again.stats.loads == none.stats.loads);
    }
  }
}
