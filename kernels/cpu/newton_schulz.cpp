// Newton-Schulz's steps besides its matmuls (cpu.h): the normalisation, the transpose and the
// scaled sums of the quintic. The CUDA twins are in kernels/cuda/newton_schulz.cu.
#include <algorithm>
#include <cmath>

#include "llmtrain/kernels/cpu.h"
#include "llmtrain/kernels/vec_math.h"

namespace llmtrain::cpu {

void newton_schulz_normalise(float* x, const float* u, const double* squares, std::int64_t rows, std::int64_t cols,
                             double eps) {
  const float inv = float(1.0 / std::max(std::sqrt(*squares), eps));
  if (rows > cols) {
    transpose(x, u, rows, cols);
    for (std::int64_t i = 0; i < rows * cols; ++i) x[i] *= inv;
    return;
  }
  for (std::int64_t i = 0; i < rows * cols; ++i) x[i] = u[i] * inv;
}

void transpose(float* out, const float* inp, std::int64_t N, std::int64_t C) {
#pragma omp parallel for if (worth_threads(N * C))
  for (std::int64_t i = 0; i < N; ++i) {
    for (std::int64_t j = 0; j < C; ++j) out[j * N + i] = inp[i * C + j];
  }
}

void scaled_sum(float* out, const float* x, const float* y, std::int64_t N, float alpha, float beta) {
#pragma omp parallel for simd if (worth_threads(N * 3))
  for (std::int64_t i = 0; i < N; ++i) out[i] = alpha * x[i] + beta * y[i];
}

}  // namespace llmtrain::cpu
