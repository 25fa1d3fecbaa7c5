// Helpers shared by the flash-attention tests (flash_attention_test.cpp, flash_attention_bf16_test.cpp):
// attention shapes, the CPU flash forward and backward, NaN-filled arrays and column slices.
#pragma once

#include <algorithm>
#include <cstddef>
#include <limits>
#include <vector>

#include "grad_check.h"
#include "ops/ops.h"

namespace llmtrain::test {

// Attention shapes: qkv (B,T,(NH+2NKV)HS), out (B,T,NH HS), lse (B,NH,T).
struct AttnShape {
  int B, T, NH, NKV, HS;
  int C() const { return NH * HS; }
  int width() const { return (NH + 2 * NKV) * HS; }
  std::size_t n_qkv() const { return std::size_t(B) * T * width(); }
  std::size_t n_out() const { return std::size_t(B) * T * C(); }
  std::size_t n_lse() const { return std::size_t(B) * NH * T; }
};

// The flash forward and backward on the CPU: out, lse and dqkv (starting from `dqkv0`).
struct FlashResult {
  Vec out, lse, dqkv;
};
inline FlashResult cpu_flash(const AttnShape& s, Vec& qkv, Vec& dout, const Vec& dqkv0) {
  const int B = s.B, T = s.T, NH = s.NH, C = s.C(), W = s.width();
  FlashResult r{Vec(s.n_out()), Vec(s.n_lse()), dqkv0};
  ops::flash_attention_forward(t(r.out, {B, T, C}), t(r.lse, {B, NH, T}), t(qkv, {B, T, W}), NH, s.NKV);
  ops::flash_attention_backward(t(r.dqkv, {B, T, W}), t(dout, {B, T, C}), t(qkv, {B, T, W}), t(r.out, {B, T, C}),
                                t(r.lse, {B, NH, T}), NH, s.NKV);
  return r;
}

inline Vec nan_vec(std::size_t n) { return Vec(n, std::numeric_limits<float>::quiet_NaN()); }

// The columns [from, to) of every row of x (rows, W), minus the same of `base`.
inline Vec increment(const Vec& x, const Vec& base, int W, int from, int to) {
  Vec r;
  for (std::size_t row = 0; row < x.size() / std::size_t(W); ++row) {
    for (int i = from; i < to; ++i) r.push_back(x[row * W + i] - base[row * W + i]);
  }
  return r;
}

inline bool all_zero(const Vec& v) {
  return std::all_of(v.begin(), v.end(), [](float x) { return x == 0.0f; });
}

}  // namespace llmtrain::test
