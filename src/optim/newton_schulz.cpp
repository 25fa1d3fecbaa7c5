#include "optim/newton_schulz.h"

#include <algorithm>
#include <cmath>

#include "core/bf16.h"
#include "core/tensor.h"
#include "ops/ops.h"

namespace llmtrain::optim {
namespace {

void round_bf16(float* x, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) x[i] = bf16_bits_to_float(float_to_bf16_bits(x[i]));
}

// t (n, m) = x (m, n)^T.
void transpose(const float* x, float* t, std::int64_t m, std::int64_t n) {
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t j = 0; j < n; ++j) t[j * m + i] = x[i * n + j];
  }
}

}  // namespace

void newton_schulz(const float* u, float* out, std::int64_t rows, std::int64_t cols, const NewtonSchulz& p,
                   std::vector<float>& scratch) {
  const bool tall = rows > cols;
  const std::int64_t m = tall ? cols : rows, n = tall ? rows : cols, mn = m * n;  // X is (m, n), m <= n
  scratch.resize(std::size_t(3 * mn + 2 * m * m));
  float *x = scratch.data(), *xt = x + mn, *bx = xt + mn, *gram = bx + mn, *poly = gram + m * m;
  if (tall) {
    transpose(u, x, rows, cols);
  } else {
    std::copy(u, u + mn, x);
  }
  if (p.bf16) round_bf16(x, mn);
  double squares = 0.0;
  for (std::int64_t i = 0; i < mn; ++i) squares += double(x[i]) * double(x[i]);
  const float inv = float(1.0 / std::max(std::sqrt(squares), p.eps));
  for (std::int64_t i = 0; i < mn; ++i) x[i] *= inv;
  if (p.bf16) round_bf16(x, mn);
  const Tensor none;
  const auto mat = [](float* data, std::int64_t r, std::int64_t c) { return Tensor(data, DType::f32, Device::cpu, {r, c}); };
  const float a = float(p.a), b = float(p.b), c = float(p.c);
  for (std::int64_t step = 0; step < p.steps; ++step) {
    // gram (m, m) = X X^T; poly = b gram + c gram gram (gram is symmetric: gram gram^T).
    ops::matmul_forward(mat(gram, m, m), mat(x, m, n), mat(x, m, n), none);
    if (p.bf16) round_bf16(gram, m * m);
    ops::matmul_forward(mat(poly, m, m), mat(gram, m, m), mat(gram, m, m), none);
    for (std::int64_t i = 0; i < m * m; ++i) poly[i] = b * gram[i] + c * poly[i];
    if (p.bf16) round_bf16(poly, m * m);
    // X <- a X + poly X, poly X = poly (X^T)^T.
    transpose(x, xt, m, n);
    ops::matmul_forward(mat(bx, m, n), mat(poly, m, m), mat(xt, n, m), none);
    for (std::int64_t i = 0; i < mn; ++i) x[i] = a * x[i] + bx[i];
    if (p.bf16) round_bf16(x, mn);
  }
  if (tall) {
    transpose(x, out, m, n);
  } else {
    std::copy(x, x + mn, out);
  }
}

}  // namespace llmtrain::optim
