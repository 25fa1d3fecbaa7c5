// RMSNorm (Llama's norm): one row per loop iteration, the sum of squares in double; the weight
// gradient summed per channel over the rows in order. qk_norm: the same per query and key head of
// a packed qkv (Qwen3's q_norm and k_norm), the value heads passed through.
#include <algorithm>
#include <cmath>

#include "llmtrain/kernels/cpu.h"
#include "llmtrain/kernels/vec_math.h"

namespace llmtrain::cpu {

void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, std::int64_t N, int C, float eps) {
#pragma omp parallel for if (worth_threads(N * C * 3))
  for (std::int64_t i = 0; i < N; ++i) {
    const float* x = inp + i * C;
    double sum_squares = 0.0;
    for (int c = 0; c < C; ++c) sum_squares += double(x[c]) * x[c];
    const float s = 1.0f / std::sqrt(float(sum_squares / C) + eps);
    float* y = out + i * C;
    for (int c = 0; c < C; ++c) y[c] = x[c] * s * weight[c];
    rstd[i] = s;
  }
}

void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                      const float* rstd, std::int64_t N, int C) {
  // y = w n, n = x s, s = (mean(x^2) + eps)^-1/2: dx = s (w dy - n mean(w dy n)).
#pragma omp parallel for if (worth_threads(N * C * 6))
  for (std::int64_t i = 0; i < N; ++i) {
    const float* x = inp + i * C;
    const float* dy = dout + i * C;
    float dot = 0.0f;
    for (int c = 0; c < C; ++c) dot += weight[c] * dy[c] * x[c] * rstd[i];
    dot /= C;
    float* dx = dinp + i * C;
    for (int c = 0; c < C; ++c) dx[c] += rstd[i] * (weight[c] * dy[c] - x[c] * rstd[i] * dot);
  }
  // dweight: each thread owns channels and sums over rows in order (deterministic).
#pragma omp parallel for if (worth_threads(N * C * 3))
  for (int c = 0; c < C; ++c) {
    float dw = 0.0f;
    for (std::int64_t i = 0; i < N; ++i) dw += inp[i * C + c] * rstd[i] * dout[i * C + c];
    dweight[c] += dw;
  }
}

void qk_norm_forward(float* out, float* rstd, const float* inp, const float* q_weight, const float* k_weight,
                     std::int64_t N, int NH, int NKV, int HS, float eps) {
  const int H = NH + 2 * NKV, normed = NH + NKV;
  const std::int64_t QKV = std::int64_t(H) * HS;
#pragma omp parallel for if (worth_threads(N * QKV * 3))
  for (std::int64_t n = 0; n < N; ++n) {
    for (int h = 0; h < H; ++h) {
      const float* x = inp + n * QKV + std::int64_t(h) * HS;
      float* y = out + n * QKV + std::int64_t(h) * HS;
      if (h >= normed) {  // a value head
        std::copy_n(x, HS, y);
        continue;
      }
      const float* w = h < NH ? q_weight : k_weight;
      double sum_squares = 0.0;
      for (int c = 0; c < HS; ++c) sum_squares += double(x[c]) * x[c];
      const float s = 1.0f / std::sqrt(float(sum_squares / HS) + eps);
      for (int c = 0; c < HS; ++c) y[c] = x[c] * s * w[c];
      rstd[n * normed + h] = s;
    }
  }
}

void qk_norm_backward(float* dinp, float* dq_weight, float* dk_weight, const float* dout, const float* inp,
                      const float* q_weight, const float* k_weight, const float* rstd, std::int64_t N, int NH, int NKV,
                      int HS) {
  // Per head as rmsnorm_backward: dx = s (w dy - n mean(w dy n)); written, value heads copied.
  const int H = NH + 2 * NKV, normed = NH + NKV;
  const std::int64_t QKV = std::int64_t(H) * HS;
#pragma omp parallel for if (worth_threads(N * QKV * 6))
  for (std::int64_t n = 0; n < N; ++n) {
    for (int h = 0; h < H; ++h) {
      const std::int64_t at = n * QKV + std::int64_t(h) * HS;
      const float* x = inp + at;
      const float* dy = dout + at;
      float* dx = dinp + at;
      if (h >= normed) {
        std::copy_n(dy, HS, dx);
        continue;
      }
      const float* w = h < NH ? q_weight : k_weight;
      const float s = rstd[n * normed + h];
      float dot = 0.0f;
      for (int c = 0; c < HS; ++c) dot += w[c] * dy[c] * x[c] * s;
      dot /= HS;
      for (int c = 0; c < HS; ++c) dx[c] = s * (w[c] * dy[c] - x[c] * s * dot);
    }
  }
  // The weight gradients: each thread owns channels and sums over tokens, then heads, in order.
#pragma omp parallel for if (worth_threads(N * QKV * 3))
  for (int c = 0; c < HS; ++c) {
    float dq = 0.0f, dk = 0.0f;
    for (std::int64_t n = 0; n < N; ++n) {
      for (int h = 0; h < normed; ++h) {
        const std::int64_t at = n * QKV + std::int64_t(h) * HS + c;
        const float g = inp[at] * rstd[n * normed + h] * dout[at];
        if (h < NH) {
          dq += g;
        } else {
          dk += g;
        }
      }
    }
    dq_weight[c] += dq;
    dk_weight[c] += dk;
  }
}

}  // namespace llmtrain::cpu
