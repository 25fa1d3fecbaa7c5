#include <cmath>

#include "ops/cpu/nn.h"

namespace llmtrain::cpu {

namespace {
constexpr float sqrt_2_over_pi = 0.7978845608028654f;
constexpr float gelu_cubic = 0.044715f;
}  // namespace

void gelu_forward(float* out, const float* inp, std::int64_t N) {
#pragma omp parallel for
  for (std::int64_t i = 0; i < N; ++i) {
    const float x = inp[i];
    out[i] = 0.5f * x * (1.0f + std::tanh(sqrt_2_over_pi * (x + gelu_cubic * x * x * x)));
  }
}

void gelu_backward(float* dinp, const float* inp, const float* dout, std::int64_t N) {
#pragma omp parallel for
  for (std::int64_t i = 0; i < N; ++i) {
    const float x = inp[i];
    const float u = sqrt_2_over_pi * (x + gelu_cubic * x * x * x);
    const float th = std::tanh(u);
    const float sech2 = 1.0f - th * th;
    const float du_dx = sqrt_2_over_pi * (1.0f + 3.0f * gelu_cubic * x * x);
    dinp[i] += (0.5f * (1.0f + th) + 0.5f * x * sech2 * du_dx) * dout[i];
  }
}

void residual_forward(float* out, const float* a, const float* b, std::int64_t N) {
#pragma omp parallel for
  for (std::int64_t i = 0; i < N; ++i) out[i] = a[i] + b[i];
}

void residual_backward(float* da, float* db, const float* dout, std::int64_t N) {
#pragma omp parallel for
  for (std::int64_t i = 0; i < N; ++i) {
    da[i] += dout[i];
    db[i] += dout[i];
  }
}

}  // namespace llmtrain::cpu
