// RMSNorm (Llama's norm): one row per loop iteration, the sum of squares in double; the weight
// gradient summed per channel over the rows in order.
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

}  // namespace llmtrain::cpu
