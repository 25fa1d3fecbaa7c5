// Every op's backward against central finite differences of its forward, at three shapes
// (odd sizes included); the remaining ops against hand computations.
#include <array>
#include <cmath>
#include <functional>
#include <random>
#include <vector>

#include "catch_compat.h"
#include "grad_check.h"
#include "llmtrain/kernels/cpu.h"
#include "ops/moe_ops.h"
#include "ops/ops.h"

using namespace llmtrain;

using namespace llmtrain::test;

TEST_CASE("encoder backward matches finite differences", "[ops][grad]") {
  std::mt19937 rng(1);
  for (const auto s : shapes) {
    const int V = 11, maxT = s.T + 2;
    Vec wte = random_vec(rng, V * s.C), wpe = random_vec(rng, maxT * s.C), out(s.B * s.T * s.C);
    std::vector<std::int32_t> inp(s.B * s.T);
    for (auto& i : inp) i = std::int32_t(rng() % V);
    inp[0] = inp[1 % inp.size()];  // a repeated token: its gradient rows add up
    const Vec R = random_vec(rng, out.size());
    const auto loss = [&] {
      ops::encoder_forward(t(out, {s.B, s.T, s.C}), ti(inp, {s.B, s.T}), t(wte, {V, s.C}), t(wpe, {maxT, s.C}));
      return weighted_sum(out, R);
    };
    Vec dwte(wte.size(), 0.0f), dwpe(wpe.size(), 0.0f), dout = R;
    ops::encoder_backward(t(dwte, {V, s.C}), t(dwpe, {maxT, s.C}), t(dout, {s.B, s.T, s.C}), ti(inp, {s.B, s.T}));
    check_gradient("wte", wte, dwte, loss);
    check_gradient("wpe", wpe, dwpe, loss);
  }
}

TEST_CASE("layernorm backward matches finite differences", "[ops][grad]") {
  std::mt19937 rng(2);
  for (const auto s : shapes) {
    const std::int64_t N = s.B * s.T;
    Vec x = random_vec(rng, N * s.C, 2.0f, 0.5f), w = random_vec(rng, s.C, 0.3f, 1.0f), b = random_vec(rng, s.C);
    Vec out(x.size()), mean(N), rstd(N);
    const Vec R = random_vec(rng, out.size());
    const auto loss = [&] {
      ops::layernorm_forward(t(out, {N, s.C}), t(mean, {N}), t(rstd, {N}), t(x, {N, s.C}), t(w, {s.C}), t(b, {s.C}));
      return weighted_sum(out, R);
    };
    loss();
    Vec dx(x.size(), 0.0f), dw(s.C, 0.0f), db(s.C, 0.0f), dout = R;
    ops::layernorm_backward(t(dx, {N, s.C}), t(dw, {s.C}), t(db, {s.C}), t(dout, {N, s.C}), t(x, {N, s.C}),
                            t(w, {s.C}), t(mean, {N}), t(rstd, {N}));
    check_gradient("x", x, dx, loss, 1e-3);
    check_gradient("weight", w, dw, loss, 1e-3);
    check_gradient("bias", b, db, loss, 1e-3);
  }
}

TEST_CASE("matmul backward matches finite differences", "[ops][grad]") {
  std::mt19937 rng(3);
  for (const auto s : shapes) {
    const std::int64_t N = s.B * s.T;
    const int OC = 2 * s.C + 1;
    Vec x = random_vec(rng, N * s.C), w = random_vec(rng, OC * s.C), b = random_vec(rng, OC), out(N * OC);
    const Vec R = random_vec(rng, out.size());
    const auto loss = [&] {
      ops::matmul_forward(t(out, {N, OC}), t(x, {N, s.C}), t(w, {OC, s.C}), t(b, {OC}));
      return weighted_sum(out, R);
    };
    Vec dx(x.size(), 0.0f), dw(w.size(), 0.0f), db(b.size(), 0.0f), dout = R;
    ops::matmul_backward(t(dx, {N, s.C}), t(dw, {OC, s.C}), t(db, {OC}), t(dout, {N, OC}), t(x, {N, s.C}),
                         t(w, {OC, s.C}));
    check_gradient("x", x, dx, loss);
    check_gradient("weight", w, dw, loss);
    check_gradient("bias", b, db, loss);
  }
}

TEST_CASE("matmul backward split into its input part and its weight part gives the whole call's bits",
          "[ops][grad]") {
  // The input gradient alone (no dweight), then the weight gradients alone (no dinp): what a
  // zero-bubble schedule runs apart. Both accumulate into non-zero gradients; the fused GELU
  // backward likewise. Shapes large enough for the packed GEMM and its threads.
  std::mt19937 rng(5);
  for (const auto& [N, C, OC] : std::vector<std::array<std::int64_t, 3>>{{3, 5, 7}, {64, 96, 130}, {257, 128, 64}}) {
    CAPTURE(N, C, OC);
    const Vec x = random_vec(rng, std::size_t(N * C)), w = random_vec(rng, std::size_t(OC * C)),
              dout = random_vec(rng, std::size_t(N * OC)), dx0 = random_vec(rng, std::size_t(N * C)),
              dw0 = random_vec(rng, std::size_t(OC * C)), db0 = random_vec(rng, std::size_t(OC));
    Vec xi = x, wi = w, douti = dout;
    Vec dx = dx0, dw = dw0, db = db0, sx = dx0, sw = dw0, sb = db0;
    ops::matmul_backward(t(dx, {N, C}), t(dw, {OC, C}), t(db, {OC}), t(douti, {N, OC}), t(xi, {N, C}), t(wi, {OC, C}));
    ops::matmul_backward(t(sx, {N, C}), Tensor(), Tensor(), t(douti, {N, OC}), t(xi, {N, C}), t(wi, {OC, C}));
    CHECK(sw == dw0);  // untouched by the input part
    ops::matmul_backward(Tensor(), t(sw, {OC, C}), t(sb, {OC}), t(douti, {N, OC}), t(xi, {N, C}), t(wi, {OC, C}));
    CHECK(sx == dx);
    CHECK(sw == dw);
    CHECK(sb == db);
    CHECK(dw != dw0);
    // Through the GELU: dpre and the bias gradient of pre now, the weight's later.
    Vec pre = random_vec(rng, std::size_t(N * C)), dpre(std::size_t(N * C)), spre(std::size_t(N * C));
    Vec dpb = random_vec(rng, std::size_t(C)), spb = dpb;
    dw = dw0, db = db0, sw = dw0, sb = db0;
    ops::matmul_backward_dgelu(t(dpre, {N, C}), t(dw, {OC, C}), t(db, {OC}), t(dpb, {C}), t(douti, {N, OC}),
                               t(xi, {N, C}), t(pre, {N, C}), t(wi, {OC, C}));
    ops::matmul_backward_dgelu(t(spre, {N, C}), Tensor(), Tensor(), t(spb, {C}), t(douti, {N, OC}), t(xi, {N, C}),
                               t(pre, {N, C}), t(wi, {OC, C}));
    ops::matmul_backward(Tensor(), t(sw, {OC, C}), t(sb, {OC}), t(douti, {N, OC}), t(xi, {N, C}), t(wi, {OC, C}));
    CHECK(spre == dpre);
    CHECK(spb == dpb);
    CHECK(sw == dw);
    CHECK(sb == db);
  }
  // The experts' grouped product: 3 experts over 11 rows (the middle one with none).
  {
    const int E = 3, C = 6, OC = 5, R = 11;
    Vec x = random_vec(rng, R * C), w = random_vec(rng, E * OC * C), dout = random_vec(rng, R * OC);
    std::vector<std::int32_t> offsets{0, 4, 4, R};
    const Vec dx0 = random_vec(rng, R * C), dw0 = random_vec(rng, E * OC * C);
    Vec dx = dx0, dw = dw0, sx = dx0, sw = dw0;
    const Tensor off(offsets.data(), DType::i32, Device::cpu, {E + 1});
    ops::grouped_matmul_backward(t(dx, {R, C}), t(dw, {E, OC, C}), t(dout, {R, OC}), t(x, {R, C}), t(w, {E, OC, C}), off);
    ops::grouped_matmul_backward(t(sx, {R, C}), Tensor(), t(dout, {R, OC}), t(x, {R, C}), t(w, {E, OC, C}), off);
    CHECK(sw == dw0);
    ops::grouped_matmul_backward(Tensor(), t(sw, {E, OC, C}), t(dout, {R, OC}), t(x, {R, C}), t(w, {E, OC, C}), off);
    CHECK(sx == dx);
    CHECK(sw == dw);
    CHECK(dw != dw0);
  }
  // Neither part, or a bias gradient without the weight's: refused.
  Vec a(4), b(4), c(4);
  CHECK_THROWS(ops::matmul_backward(Tensor(), Tensor(), Tensor(), t(a, {2, 2}), t(b, {2, 2}), t(c, {2, 2})));
  Vec bias(2);
  CHECK_THROWS(ops::matmul_backward(t(a, {2, 2}), Tensor(), t(bias, {2}), t(b, {2, 2}), t(c, {2, 2}), t(c, {2, 2})));
}

TEST_CASE("attention backward matches finite differences", "[ops][grad]") {
  std::mt19937 rng(4);
  for (const auto s : shapes) {
    Vec qkv = random_vec(rng, s.B * s.T * 3 * s.C), out(s.B * s.T * s.C), att(s.B * s.NH * s.T * s.T);
    const Vec R = random_vec(rng, out.size());
    const auto loss = [&] {
      cpu::attention_forward(out.data(), att.data(), qkv.data(), s.B, s.T, s.C, s.NH, s.NH);
      return weighted_sum(out, R);
    };
    loss();
    Vec dqkv(qkv.size(), 0.0f), dout = R;
    cpu::attention_backward(dqkv.data(), dout.data(), qkv.data(), att.data(), s.B, s.T, s.C, s.NH, s.NH);
    check_gradient("qkv", qkv, dqkv, loss, 1e-3);
  }
}

TEST_CASE("attention is causal and its rows are probabilities", "[ops]") {
  std::mt19937 rng(5);
  const int B = 2, T = 5, C = 6, NH = 2;
  Vec qkv = random_vec(rng, B * T * 3 * C), out(B * T * C), att(B * NH * T * T);
  cpu::attention_forward(out.data(), att.data(), qkv.data(), B, T, C, NH, NH);
  for (int row = 0; row < B * NH * T; ++row) {
    const int query = row % T;
    double sum = 0.0;
    for (int key = 0; key < T; ++key) {
      if (key > query) REQUIRE(att[row * T + key] == 0.0f);
      sum += att[row * T + key];
    }
    REQUIRE(std::abs(sum - 1.0) < 1e-5);
  }
  // The first position attends only to itself: its output is its own value vector.
  for (int h = 0; h < NH; ++h) {
    for (int i = 0; i < C / NH; ++i) CHECK(out[h * (C / NH) + i] == qkv[2 * C + h * (C / NH) + i]);
  }
}

TEST_CASE("gelu and residual backward match finite differences", "[ops][grad]") {
  std::mt19937 rng(6);
  for (const int n : {1, 7, 100}) {
    Vec x = random_vec(rng, n, 2.0f), out(n);
    const Vec R = random_vec(rng, n);
    const auto gelu_loss = [&] {
      ops::gelu_forward(t(out, {n}), t(x, {n}));
      return weighted_sum(out, R);
    };
    Vec dx(n, 0.0f), dout = R;
    ops::gelu_backward(t(dx, {n}), t(x, {n}), t(dout, {n}));
    check_gradient("gelu", x, dx, gelu_loss, 1e-3);

    Vec a = random_vec(rng, n), b = random_vec(rng, n);
    const auto residual_loss = [&] {
      ops::residual_forward(t(out, {n}), t(a, {n}), t(b, {n}));
      return weighted_sum(out, R);
    };
    Vec da(n, 0.0f), db(n, 0.0f);
    ops::residual_backward(t(da, {n}), t(db, {n}), t(dout, {n}));
    check_gradient("residual a", a, da, residual_loss);
    check_gradient("residual b", b, db, residual_loss);
  }
  // GELU at hand-computed points: gelu(0) = 0, gelu(1) = 0.841192 (tanh form).
  Vec x = {0.0f, 1.0f, -1.0f}, y(3);
  ops::gelu_forward(t(y, {3}), t(x, {3}));
  CHECK(y[0] == 0.0f);
  CHECK(std::abs(y[1] - 0.8411920f) < 1e-6f);
  CHECK(std::abs(y[2] + 0.1588080f) < 1e-6f);
}

TEST_CASE("fused classifier: loss and gradient", "[ops][grad]") {
  std::mt19937 rng(7);
  for (const auto& [N, V] : {std::pair{1, 2}, std::pair{3, 5}, std::pair{6, 33}}) {
    Vec logits = random_vec(rng, N * V, 2.0f), losses(N), work(logits.size());
    std::vector<std::int32_t> targets(N);
    for (auto& y : targets) y = std::int32_t(rng() % V);
    const auto loss = [&] {
      work = logits;
      return ops::fused_classifier(t(work, {N, V}), t(losses, {N}), ti(targets, {N}), 0.0f);
    };
    // Hand computation for row 0: log(sum exp) - logit[target].
    double lse = 0.0;
    for (int v = 0; v < V; ++v) lse += std::exp(double(logits[v]));
    const double total = loss();
    CHECK(std::abs(losses[0] - (std::log(lse) - logits[targets[0]])) < 1e-5);
    CHECK(work == logits);  // no gradient asked: logits untouched
    Vec grad = logits;
    const double same = ops::fused_classifier(t(grad, {N, V}), t(losses, {N}), ti(targets, {N}), 1.0f);
    CHECK(same == total);
    check_gradient("logits", logits, grad, loss, 1e-3);
  }
}

TEST_CASE("sum of squares and AdamW match hand computations", "[ops]") {
  Vec x = {1.0f, -2.0f, 3.0f};
  CHECK(ops::sum_squares(t(x, {3})) == 14.0);
  std::vector<float> big(100001, 0.5f);
  CHECK(ops::sum_squares(t(big, {100001})) == 100001 * 0.25);

  // One step from m = v = 0 at step 1: m_hat = g, v_hat = g^2, so p -= lr (sign(g) g/(|g|+eps) + wd p).
  Vec p = {1.0f, -1.0f}, g = {0.5f, -2.0f}, m = {0.0f, 0.0f}, v = {0.0f, 0.0f};
  ops::adamw_update(t(p, {2}), t(g, {2}), t(m, {2}), t(v, {2}), {0.1f, 0.9f, 0.95f, 0.0f, 0.01f, 1, 2.0f});
  CHECK(std::abs(p[0] - (1.0f - 0.1f * (1.0f + 0.01f * 1.0f))) < 1e-6f);
  CHECK(std::abs(p[1] - (-1.0f - 0.1f * (-1.0f + 0.01f * -1.0f))) < 1e-6f);
  CHECK(std::abs(m[0] - 0.1f * 1.0f) < 1e-7f);  // (1 - beta1) * grad_scale * g
  CHECK(std::abs(v[1] - 0.05f * 16.0f) < 1e-6f);  // (1 - beta2) * (2 * -2)^2
}
