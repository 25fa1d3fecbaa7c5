// Llama's ops on the CPU: RMSNorm, rotary embeddings and SwiGLU against finite differences and
// hand computations.
#include <cmath>

#include "catch_compat.h"
#include "grad_check.h"
#include "llmtrain/kernels/cpu.h"
#include "ops/ops.h"

using namespace llmtrain;
using namespace llmtrain::test;

TEST_CASE("RMSNorm: hand values and finite differences", "[ops][llama][grad]") {
  // Row (3, 4): rms = sqrt((9 + 16) / 2) = sqrt(12.5); with weights (1, 2): (3, 8) / sqrt(12.5).
  Vec x = {3.0f, 4.0f}, w = {1.0f, 2.0f}, y(2), rstd(1);
  ops::rmsnorm_forward(t(y, {1, 2}), t(rstd, {1}), t(x, {1, 2}), t(w, {2}), 0.0f);
  CHECK(std::abs(y[0] - 3.0f / std::sqrt(12.5f)) < 1e-6f);
  CHECK(std::abs(y[1] - 8.0f / std::sqrt(12.5f)) < 1e-6f);

  std::mt19937 rng(11);
  for (const auto s : shapes) {
    const std::int64_t N = s.B * s.T;
    Vec xs = random_vec(rng, N * s.C, 1.5f, 0.3f), ws = random_vec(rng, s.C, 0.3f, 1.0f), out(xs.size()), r(N);
    const Vec R = random_vec(rng, out.size());
    const auto loss = [&] {
      ops::rmsnorm_forward(t(out, {N, s.C}), t(r, {N}), t(xs, {N, s.C}), t(ws, {s.C}), 1e-5f);
      return weighted_sum(out, R);
    };
    loss();
    Vec dx(xs.size(), 0.0f), dw(s.C, 0.0f), dout = R;
    ops::rmsnorm_backward(t(dx, {N, s.C}), t(dw, {s.C}), t(dout, {N, s.C}), t(xs, {N, s.C}), t(ws, {s.C}), t(r, {N}));
    check_gradient("x", xs, dx, loss, 1e-3);
    check_gradient("weight", ws, dw, loss, 1e-3);
  }
}

TEST_CASE("rotary embedding: rotate_half by hand, norms kept, finite differences", "[ops][llama][grad]") {
  // One head of size 4 at positions 0 and 1, theta 10000: angles (0, 0), then (1, 0.01) radians;
  // pairs are (x0, x2) and (x1, x3).
  Vec x = {1.0f, 2.0f, 3.0f, 4.0f, 1.0f, 2.0f, 3.0f, 4.0f}, y(8);
  ops::rope_forward(t(y, {1, 2, 1, 4}), t(x, {1, 2, 1, 4}), 10000.0f);
  for (int i = 0; i < 4; ++i) CHECK(y[i] == x[i]);  // position 0: unchanged
  const float c0 = std::cos(1.0f), s0 = std::sin(1.0f), c1 = std::cos(0.01f), s1 = std::sin(0.01f);
  CHECK(std::abs(y[4] - (1.0f * c0 - 3.0f * s0)) < 1e-6f);
  CHECK(std::abs(y[6] - (3.0f * c0 + 1.0f * s0)) < 1e-6f);
  CHECK(std::abs(y[5] - (2.0f * c1 - 4.0f * s1)) < 1e-6f);
  CHECK(std::abs(y[7] - (4.0f * c1 + 2.0f * s1)) < 1e-6f);
  CHECK(std::abs(y[4] * y[4] + y[6] * y[6] - 10.0f) < 1e-5f);  // a rotation keeps each pair's norm

  std::mt19937 rng(12);
  for (const auto s : shapes) {
    const int HS = 2 * (s.C / s.NH / 2 + 1);  // even head sizes 2, 4, 6 ...
    Vec in = random_vec(rng, std::size_t(s.B) * s.T * s.NH * HS), out(in.size());
    const Vec R = random_vec(rng, out.size());
    const auto loss = [&] {
      ops::rope_forward(t(out, {s.B, s.T, s.NH, HS}), t(in, {s.B, s.T, s.NH, HS}), 500.0f);
      return weighted_sum(out, R);
    };
    Vec din(in.size(), 0.0f), dout = R;
    ops::rope_backward(t(din, {s.B, s.T, s.NH, HS}), t(dout, {s.B, s.T, s.NH, HS}), 500.0f);
    check_gradient("x", in, din, loss);
  }
}

TEST_CASE("SwiGLU: hand values and finite differences", "[ops][llama][grad]") {
  Vec gate = {0.0f, 1.0f, -2.0f}, up = {5.0f, 2.0f, 3.0f}, y(3);
  ops::swiglu_forward(t(y, {3}), t(gate, {3}), t(up, {3}));
  CHECK(y[0] == 0.0f);  // silu(0) = 0
  CHECK(std::abs(y[1] - 2.0f / (1.0f + std::exp(-1.0f))) < 1e-6f);
  CHECK(std::abs(y[2] - 3.0f * -2.0f / (1.0f + std::exp(2.0f))) < 1e-6f);

  std::mt19937 rng(13);
  for (const int n : {1, 9, 200}) {
    Vec g = random_vec(rng, n, 2.0f), u = random_vec(rng, n), out(n);
    const Vec R = random_vec(rng, n);
    const auto loss = [&] {
      ops::swiglu_forward(t(out, {n}), t(g, {n}), t(u, {n}));
      return weighted_sum(out, R);
    };
    Vec dg(n, 0.0f), du(n, 0.0f), dout = R;
    ops::swiglu_backward(t(dg, {n}), t(du, {n}), t(dout, {n}), t(g, {n}), t(u, {n}));
    check_gradient("gate", g, dg, loss, 1e-3);
    check_gradient("up", u, du, loss);
  }
}

TEST_CASE("grouped-query attention: finite differences, and NKV = NH equals plain attention", "[ops][llama][grad]") {
  std::mt19937 rng(14);
  const int B = 2, T = 5, NH = 4, HS = 3, C = NH * HS;
  for (const int NKV : {1, 2, 4}) {
    CAPTURE(NKV);
    const int width = (NH + 2 * NKV) * HS;
    Vec qkv = random_vec(rng, std::size_t(B) * T * width), out(std::size_t(B) * T * C), att(std::size_t(B) * NH * T * T);
    const Vec R = random_vec(rng, out.size());
    const auto loss = [&] {
      cpu::attention_forward(out.data(), att.data(), qkv.data(), B, T, C, NH, NKV);
      return weighted_sum(out, R);
    };
    loss();
    Vec dqkv(qkv.size(), 0.0f), dout = R;
    cpu::attention_backward(dqkv.data(), dout.data(), qkv.data(), att.data(), B, T, C, NH, NKV);
    check_gradient("qkv", qkv, dqkv, loss, 1e-3);
  }
  // With one kv head, every query head attends with the same keys and values: expanding them to
  // NH copies and running plain attention gives the same output.
  const int width1 = (NH + 2) * HS;
  Vec grouped = random_vec(rng, std::size_t(B) * T * width1), expanded(std::size_t(B) * T * 3 * C);
  for (int bt = 0; bt < B * T; ++bt) {
    for (int i = 0; i < C; ++i) {
      expanded[std::size_t(bt * 3 * C + i)] = grouped[std::size_t(bt * width1 + i)];                             // q
      expanded[std::size_t(bt * 3 * C + C + i)] = grouped[std::size_t(bt * width1 + C + i % HS)];                // k
      expanded[std::size_t(bt * 3 * C + 2 * C + i)] = grouped[std::size_t(bt * width1 + C + HS + i % HS)];       // v
    }
  }
  Vec a(std::size_t(B) * T * C), b(a.size()), att(std::size_t(B) * NH * T * T);
  cpu::attention_forward(a.data(), att.data(), grouped.data(), B, T, C, NH, 1);
  cpu::attention_forward(b.data(), att.data(), expanded.data(), B, T, C, NH, NH);
  for (std::size_t i = 0; i < a.size(); ++i) REQUIRE(std::abs(a[i] - b[i]) < 1e-6f);
}

TEST_CASE("qk_norm: each query and key head normalised by hand, value heads copied, finite differences",
          "[ops][llama][grad]") {
  // One token, NH 2, NKV 1, HS 2: heads (3, 4), (1, 0) | (0, 2) | (5, 6). rms (3, 4) = sqrt(12.5),
  // rms (1, 0) = sqrt(0.5), rms (0, 2) = sqrt(2); q weights (1, 2), k weights (3, 1); eps 0.
  Vec x = {3.0f, 4.0f, 1.0f, 0.0f, 0.0f, 2.0f, 5.0f, 6.0f}, wq = {1.0f, 2.0f}, wk = {3.0f, 1.0f}, y(8), rstd(3);
  ops::qk_norm_forward(t(y, {1, 8}), t(rstd, {1, 3}), t(x, {1, 8}), t(wq, {2}), t(wk, {2}), 2, 1, 0.0f);
  const float r1 = std::sqrt(12.5f), r2 = std::sqrt(0.5f), r3 = std::sqrt(2.0f);
  const Vec expected = {3.0f / r1, 8.0f / r1, 1.0f / r2, 0.0f, 0.0f, 2.0f / r3, 5.0f, 6.0f};
  for (std::size_t i = 0; i < 8; ++i) CHECK(std::abs(y[i] - expected[i]) < 1e-6f);
  CHECK(std::abs(rstd[2] - 1.0f / r3) < 1e-6f);

  std::mt19937 rng(17);
  struct HeadShape {
    int N, NH, NKV, HS;
  };
  for (const auto s : {HeadShape{3, 2, 1, 4}, HeadShape{5, 4, 2, 6}, HeadShape{2, 1, 1, 8}}) {
    CAPTURE(s.N, s.NH, s.NKV, s.HS);
    const std::int64_t W = std::int64_t(s.NH + 2 * s.NKV) * s.HS;
    Vec xs = random_vec(rng, std::size_t(s.N * W), 1.5f, 0.3f), qw = random_vec(rng, std::size_t(s.HS), 0.3f, 1.0f),
        kw = random_vec(rng, std::size_t(s.HS), 0.3f, 1.0f), out(xs.size()), r(std::size_t(s.N * (s.NH + s.NKV)));
    const Vec R = random_vec(rng, out.size());
    const auto loss = [&] {
      ops::qk_norm_forward(t(out, {s.N, W}), t(r, {s.N, s.NH + s.NKV}), t(xs, {s.N, W}), t(qw, {s.HS}),
                           t(kw, {s.HS}), s.NH, s.NKV, 1e-5f);
      return weighted_sum(out, R);
    };
    loss();
    Vec dx(xs.size(), 7.0f), dq(std::size_t(s.HS), 0.0f), dk(std::size_t(s.HS), 0.0f), dout = R;  // dx written
    ops::qk_norm_backward(t(dx, {s.N, W}), t(dq, {s.HS}), t(dk, {s.HS}), t(dout, {s.N, W}), t(xs, {s.N, W}),
                          t(qw, {s.HS}), t(kw, {s.HS}), t(r, {s.N, s.NH + s.NKV}), s.NH, s.NKV);
    check_gradient("x", xs, dx, loss, 1e-3);
    check_gradient("q_weight", qw, dq, loss, 1e-3);
    check_gradient("k_weight", kw, dk, loss, 1e-3);
  }
}
