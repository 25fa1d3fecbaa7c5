// GELU and the residual add. Memory-bound: each op is one pass with 128-bit loads and stores
// (elementwise_launch.cuh), computing in float. GELU uses the same formula as the CPU
// reference, x * logistic(2u) with u = sqrt(2/pi) (x + 0.044715 x^3), with the accurate expf
// (no fast-math), so the two agree to a few ulp. Backward ops add into their outputs; where two
// outputs could alias, each is read, added to and stored in turn, as the CPU loop does. bf16:
// the same ops on bf16 arrays (8 elements per 128-bit access), fp32 arithmetic, one rounding per
// store.
#include "cuda_check.h"
#include "elementwise_launch.cuh"
#include "instantiate.cuh"
#include "llmtrain/kernels/cuda.h"
#include "vector_io.cuh"

namespace llmtrain::cuda {
namespace {

constexpr float sqrt_2_over_pi = 0.7978845608028654f;
constexpr float gelu_cubic = 0.044715f;

__device__ __forceinline__ float gelu(float x) {
  const float u = sqrt_2_over_pi * (x + gelu_cubic * x * x * x);
  return x / (1.0f + expf(-2.0f * u));
}

// d/dx [x s(2u)] = s + 2 x s (1 - s) u', s = logistic(2u).
__device__ __forceinline__ float gelu_derivative(float x) {
  const float u = sqrt_2_over_pi * (x + gelu_cubic * x * x * x);
  const float s = 1.0f / (1.0f + expf(-2.0f * u));
  const float du_dx = sqrt_2_over_pi * (1.0f + 3.0f * gelu_cubic * x * x);
  return s + 2.0f * x * s * (1.0f - s) * du_dx;
}

template <class Elem>
struct GeluForward {
  Elem* out;        // (N)
  const Elem* inp;  // (N)
  template <int W>
  __device__ void apply(std::int64_t i) const {
    const Chunk<Elem, W> x = load_chunk<W>(inp + i);
    Chunk<Elem, W> y;
#pragma unroll
    for (int k = 0; k < W; ++k) y.e[k] = from_float<Elem>(gelu(to_float(x.e[k])));
    store_chunk<W>(out + i, y);
  }
};

template <class Elem>
struct GeluBackward {
  Elem* dinp;        // (N)
  const Elem* inp;   // (N)
  const Elem* dout;  // (N)
  template <int W>
  __device__ void apply(std::int64_t i) const {
    const Chunk<Elem, W> x = load_chunk<W>(inp + i), dy = load_chunk<W>(dout + i);
    Chunk<Elem, W> dx = load_chunk<W>(dinp + i);
#pragma unroll
    for (int k = 0; k < W; ++k) {
      dx.e[k] = from_float<Elem>(to_float(dx.e[k]) + gelu_derivative(to_float(x.e[k])) * to_float(dy.e[k]));
    }
    store_chunk<W>(dinp + i, dx);
  }
};

template <class Elem>
struct ResidualForward {
  Elem* out;      // (N)
  const Elem* a;  // (N)
  const Elem* b;  // (N)
  template <int W>
  __device__ void apply(std::int64_t i) const {
    const Chunk<Elem, W> x = load_chunk<W>(a + i), y = load_chunk<W>(b + i);
    Chunk<Elem, W> z;
#pragma unroll
    for (int k = 0; k < W; ++k) z.e[k] = from_float<Elem>(to_float(x.e[k]) + to_float(y.e[k]));
    store_chunk<W>(out + i, z);
  }
};

template <class Elem>
struct ResidualBackward {
  Elem* da;          // (N)
  Elem* db;          // (N)
  const Elem* dout;  // (N)
  template <int W>
  __device__ void apply(std::int64_t i) const {
    const Chunk<Elem, W> dy = load_chunk<W>(dout + i);
    Chunk<Elem, W> g = load_chunk<W>(da + i);
#pragma unroll
    for (int k = 0; k < W; ++k) g.e[k] = from_float<Elem>(to_float(g.e[k]) + to_float(dy.e[k]));
    store_chunk<W>(da + i, g);
    g = load_chunk<W>(db + i);  // after the store: da == db adds twice, as on the CPU
#pragma unroll
    for (int k = 0; k < W; ++k) g.e[k] = from_float<Elem>(to_float(g.e[k]) + to_float(dy.e[k]));
    store_chunk<W>(db + i, g);
  }
};

}  // namespace

template <class Act>
void gelu_forward(Act* out, const Act* inp, std::int64_t N, cudaStream_t stream) {
  launch_elementwise<Act>(GeluForward<Act>{out, inp}, N, aligned16({out, inp}), stream);
}
LLMTRAIN_INSTANTIATE_ACTIVATIONS(gelu_forward)

template <class Act>
void gelu_backward(Act* dinp, const Act* inp, const Act* dout, std::int64_t N, cudaStream_t stream) {
  launch_elementwise<Act>(GeluBackward<Act>{dinp, inp, dout}, N, aligned16({dinp, inp, dout}), stream);
}
LLMTRAIN_INSTANTIATE_ACTIVATIONS(gelu_backward)

template <class Act>
void residual_forward(Act* out, const Act* a, const Act* b, std::int64_t N, cudaStream_t stream) {
  launch_elementwise<Act>(ResidualForward<Act>{out, a, b}, N, aligned16({out, a, b}), stream);
}
LLMTRAIN_INSTANTIATE_ACTIVATIONS(residual_forward)

template <class Act>
void residual_backward(Act* da, Act* db, const Act* dout, std::int64_t N, cudaStream_t stream) {
  launch_elementwise<Act>(ResidualBackward<Act>{da, db, dout}, N, aligned16({da, db, dout}), stream);
}
LLMTRAIN_INSTANTIATE_ACTIVATIONS(residual_backward)

}  // namespace llmtrain::cuda
