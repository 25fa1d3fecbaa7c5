// The optimizer's ops. sum_squares (for the global gradient norm) is a deterministic two-pass
// reduction in double (reduce.cuh): a grid fixed by N, per-thread double sums, block partials
// added in a fixed order, the scalar copied back (synchronising the stream). adamw_update is
// elementwise (128-bit accesses, elementwise_launch.cuh); the bias corrections are computed on
// the host exactly as the CPU reference computes them.
#include <cmath>

#include "cuda_check.h"
#include "elementwise_launch.cuh"
#include "kernels.h"
#include "reduce.cuh"
#include "vector_io.cuh"

namespace llmtrain::cuda {
namespace {

struct Square {
  __device__ double operator()(float x) const { return double(x) * double(x); }
};

// param -= lr (m_hat / (sqrt(v_hat) + eps) + weight_decay param), with the moments updated
// from g = grad * grad_scale.
template <class Elem>
struct AdamW {
  Elem* param;       // (N)
  const Elem* grad;  // (N)
  float* m;          // (N)
  float* v;          // (N)
  float lr, beta1, beta2, eps, weight_decay, grad_scale, m_correction, v_correction;
  template <int W>
  __device__ void apply(std::int64_t i) const {
    const Chunk<Elem, W> g = load_chunk<W>(grad + i);
    Chunk<Elem, W> p = load_chunk<W>(param + i);
    Chunk<float, W> mv = load_chunk<W>(m + i), vv = load_chunk<W>(v + i);
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const float gs = to_float(g.e[k]) * grad_scale;
      mv.e[k] = beta1 * mv.e[k] + (1.0f - beta1) * gs;
      vv.e[k] = beta2 * vv.e[k] + (1.0f - beta2) * gs * gs;
      const float m_hat = mv.e[k] * m_correction, v_hat = vv.e[k] * v_correction;
      const float x = to_float(p.e[k]);
      p.e[k] = from_float<Elem>(x - lr * (m_hat / (sqrtf(v_hat) + eps) + weight_decay * x));
    }
    store_chunk<W>(m + i, mv);
    store_chunk<W>(v + i, vv);
    store_chunk<W>(param + i, p);
  }
};

}  // namespace

double sum_squares(const float* x, std::int64_t N, cudaStream_t stream) {
  return sum_to_host(x, N, Square{}, stream);
}

void adamw_update(float* param, const float* grad, float* m, float* v, std::int64_t N, float lr, float beta1,
                  float beta2, float eps, float weight_decay, int step, float grad_scale,
                  cudaStream_t stream) {
  const float m_correction = 1.0f / (1.0f - std::pow(beta1, float(step)));
  const float v_correction = 1.0f / (1.0f - std::pow(beta2, float(step)));
  const AdamW<float> op{param,      grad,         m,           v, lr, beta1, beta2, eps, weight_decay,
                        grad_scale, m_correction, v_correction};
  launch_elementwise<float>(op, N, aligned16({param, grad, m, v}), stream);
}

}  // namespace llmtrain::cuda
