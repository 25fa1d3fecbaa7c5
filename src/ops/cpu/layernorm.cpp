#include <cmath>

#include "ops/cpu/reference.h"

namespace llmtrain::cpu {

namespace {
constexpr float layernorm_eps = 1e-5f;  // GPT-2's
}

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                       const float* bias, std::int64_t N, int C) {
#pragma omp parallel for
  for (std::int64_t i = 0; i < N; ++i) {
    const float* x = inp + i * C;
    double sum = 0.0;
    for (int c = 0; c < C; ++c) sum += x[c];
    const float m = float(sum / C);
    double var = 0.0;
    for (int c = 0; c < C; ++c) var += double(x[c] - m) * (x[c] - m);
    const float s = 1.0f / std::sqrt(float(var / C) + layernorm_eps);
    float* y = out + i * C;
    for (int c = 0; c < C; ++c) y[c] = (x[c] - m) * s * weight[c] + bias[c];
    mean[i] = m;
    rstd[i] = s;
  }
}

void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, std::int64_t N, int C) {
  // dinp, row by row: dx = rstd (dnorm - mean(dnorm) - norm mean(dnorm norm)), dnorm = w dy.
#pragma omp parallel for
  for (std::int64_t i = 0; i < N; ++i) {
    const float* x = inp + i * C;
    const float* dy = dout + i * C;
    float dnorm_mean = 0.0f, dnorm_norm_mean = 0.0f;
    for (int c = 0; c < C; ++c) {
      const float norm = (x[c] - mean[i]) * rstd[i];
      const float dnorm = weight[c] * dy[c];
      dnorm_mean += dnorm;
      dnorm_norm_mean += dnorm * norm;
    }
    dnorm_mean /= C;
    dnorm_norm_mean /= C;
    float* dx = dinp + i * C;
    for (int c = 0; c < C; ++c) {
      const float norm = (x[c] - mean[i]) * rstd[i];
      dx[c] += (weight[c] * dy[c] - dnorm_mean - norm * dnorm_norm_mean) * rstd[i];
    }
  }
  // dweight, dbias: each thread owns a slice of channels and sums over rows in order.
#pragma omp parallel for
  for (int c = 0; c < C; ++c) {
    float dw = 0.0f, db = 0.0f;
    for (std::int64_t i = 0; i < N; ++i) {
      const float dy = dout[i * C + c];
      dw += (inp[i * C + c] - mean[i]) * rstd[i] * dy;
      db += dy;
    }
    dweight[c] += dw;
    dbias[c] += db;
  }
}

}  // namespace llmtrain::cpu
