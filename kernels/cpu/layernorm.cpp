// LayerNorm, row by row. Reductions are float `omp simd` reductions (several partial sums, then
// added: vectorised and at least as accurate as one running sum); the weight gradients are summed
// over rows by one thread per slice of channels, rows outer, so that each pass reads whole rows.
#include <algorithm>
#include <cmath>

#include "llmtrain/kernels/cpu.h"
#include "llmtrain/kernels/vec_math.h"

namespace llmtrain::cpu {

namespace {
constexpr float layernorm_eps = 1e-5f;  // GPT-2's
constexpr int channel_slice = 64;       // channels per task of the weight-gradient sums
}  // namespace

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                       const float* bias, std::int64_t N, int C) {
#pragma omp parallel for if (worth_threads(N * C * 4))
  for (std::int64_t i = 0; i < N; ++i) {
    const float* x = inp + i * C;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int c = 0; c < C; ++c) sum += x[c];
    const float m = sum / float(C);
    float var = 0.0f;  // two passes: no cancellation for rows far from zero
#pragma omp simd reduction(+ : var)
    for (int c = 0; c < C; ++c) var += (x[c] - m) * (x[c] - m);
    const float s = 1.0f / std::sqrt(var / float(C) + layernorm_eps);
    float* y = out + i * C;
#pragma omp simd
    for (int c = 0; c < C; ++c) y[c] = (x[c] - m) * s * weight[c] + bias[c];
    mean[i] = m;
    rstd[i] = s;
  }
}

void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, std::int64_t N, int C) {
  const bool threads = worth_threads(N * C * 6);
  // dinp, row by row: dx = rstd (dnorm - mean(dnorm) - norm mean(dnorm norm)), dnorm = w dy.
#pragma omp parallel for if (threads)
  for (std::int64_t i = 0; i < N; ++i) {
    const float* x = inp + i * C;
    const float* dy = dout + i * C;
    const float m = mean[i], s = rstd[i];
    float dnorm_sum = 0.0f, dnorm_norm_sum = 0.0f;
#pragma omp simd reduction(+ : dnorm_sum, dnorm_norm_sum)
    for (int c = 0; c < C; ++c) {
      const float dnorm = weight[c] * dy[c];
      dnorm_sum += dnorm;
      dnorm_norm_sum += dnorm * ((x[c] - m) * s);
    }
    const float dnorm_mean = dnorm_sum / float(C), dnorm_norm_mean = dnorm_norm_sum / float(C);
    float* dx = dinp + i * C;
#pragma omp simd
    for (int c = 0; c < C; ++c) {
      const float norm = (x[c] - m) * s;
      dx[c] += (weight[c] * dy[c] - dnorm_mean - norm * dnorm_norm_mean) * s;
    }
  }
  // dweight, dbias: each task owns a slice of channels and adds the rows in order.
  const int slices = (C + channel_slice - 1) / channel_slice;
#pragma omp parallel for if (threads)
  for (int slice = 0; slice < slices; ++slice) {
    const int c0 = slice * channel_slice, c1 = std::min(C, c0 + channel_slice);
    float dw[channel_slice] = {}, db[channel_slice] = {};
    for (std::int64_t i = 0; i < N; ++i) {
      const float* x = inp + i * C;
      const float* dy = dout + i * C;
      const float m = mean[i], s = rstd[i];
#pragma omp simd
      for (int c = c0; c < c1; ++c) {
        dw[c - c0] += (x[c] - m) * s * dy[c];
        db[c - c0] += dy[c];
      }
    }
    for (int c = c0; c < c1; ++c) {
      dweight[c] += dw[c - c0];
      dbias[c] += db[c - c0];
    }
  }
}

// The two ops in sequence: the unfused model's results, bit for bit.
void layernorm_residual_forward(float* residual, float* out, float* mean, float* rstd, const float* a, const float* b,
                                const float* weight, const float* bias, std::int64_t N, int C) {
  residual_forward(residual, a, b, N * C);
  layernorm_forward(out, mean, rstd, residual, weight, bias, N, C);
}

}  // namespace llmtrain::cpu
