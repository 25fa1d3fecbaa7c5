#include <cmath>
#include <vector>

#include "llmtrain/kernels/cpu.h"
#include "llmtrain/kernels/vec_math.h"

namespace llmtrain::cpu {

double sum_squares(const float* x, std::int64_t N, double* into) {
  // Fixed chunks summed in order: the same result for any thread count.
  constexpr std::int64_t chunk = 1 << 14;
  const std::int64_t chunks = (N + chunk - 1) / chunk;
  std::vector<double> partial(std::size_t(chunks), 0.0);
#pragma omp parallel for if (worth_threads(N))
  for (std::int64_t k = 0; k < chunks; ++k) {
    double s = 0.0;
    const std::int64_t end = std::min(N, (k + 1) * chunk);
    for (std::int64_t i = k * chunk; i < end; ++i) s += double(x[i]) * x[i];
    partial[k] = s;
  }
  double total = 0.0;
  for (const double p : partial) total += p;
  if (into) {
    *into += total;
    return 0.0;
  }
  return total;
}

void adamw_update(float* param, const float* grad, float* m, float* v, std::int64_t N, float lr, float beta1,
                  float beta2, float eps, float weight_decay, int step, float grad_scale) {
  const float m_correction = 1.0f / (1.0f - std::pow(beta1, float(step)));
  const float v_correction = 1.0f / (1.0f - std::pow(beta2, float(step)));
#pragma omp parallel for simd if (worth_threads(N * 12))
  for (std::int64_t i = 0; i < N; ++i) {
    const float g = grad[i] * grad_scale;
    m[i] = beta1 * m[i] + (1.0f - beta1) * g;
    v[i] = beta2 * v[i] + (1.0f - beta2) * g * g;
    const float m_hat = m[i] * m_correction;
    const float v_hat = v[i] * v_correction;
    param[i] -= lr * (m_hat / (std::sqrt(v_hat) + eps) + weight_decay * param[i]);
  }
}

void muon_momentum(float* buf, const float* grad, float* u, std::int64_t N, float momentum, int nesterov,
                   float grad_scale) {
#pragma omp parallel for simd if (worth_threads(N * 4))
  for (std::int64_t i = 0; i < N; ++i) {
    const float g = grad_scale * grad[i];
    buf[i] += (1.0f - momentum) * (g - buf[i]);
    u[i] = nesterov ? g + momentum * (buf[i] - g) : buf[i];
  }
}

void muon_apply(float* param, const float* o, std::int64_t N, float keep, float step) {
#pragma omp parallel for simd if (worth_threads(N * 3))
  for (std::int64_t i = 0; i < N; ++i) param[i] = param[i] * keep - step * o[i];
}

}  // namespace llmtrain::cpu
