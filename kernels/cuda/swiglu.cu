// SwiGLU (Llama's MLP activation), an elementwise op of elementwise.def: out = silu(gate) * up,
// the CPU reference's formulas (kernels/cpu/swiglu.cpp), one pass with 128-bit loads and stores
// (elementwise_launch.cuh), computing in float with the accurate expf. The backward adds into
// dgate, then into dup, as the CPU loop does (so dgate == dup adds both). bf16: the same ops on
// bf16 arrays (8 elements per 128-bit access), one rounding per store.
#include "cuda_check.h"
#include "elementwise_launch.cuh"
#include "instantiate.cuh"
#include "llmtrain/kernels/cuda.h"
#include "vector_io.cuh"

namespace llmtrain::cuda {
namespace {

template <class Elem>
struct SwigluForward {
  Elem* out;         // (N)
  const Elem* gate;  // (N)
  const Elem* up;    // (N)
  template <int W>
  __device__ void apply(std::int64_t i) const {
    const Chunk<Elem, W> g = load_chunk<W>(gate + i), u = load_chunk<W>(up + i);
    Chunk<Elem, W> y;
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const float x = to_float(g.e[k]);
      y.e[k] = from_float<Elem>(x / (1.0f + expf(-x)) * to_float(u.e[k]));
    }
    store_chunk<W>(out + i, y);
  }
};

template <class Elem>
struct SwigluBackward {
  Elem* dgate;       // (N)
  Elem* dup;         // (N)
  const Elem* dout;  // (N)
  const Elem* gate;  // (N)
  const Elem* up;    // (N)
  template <int W>
  __device__ void apply(std::int64_t i) const {
    const Chunk<Elem, W> dy = load_chunk<W>(dout + i), g = load_chunk<W>(gate + i), u = load_chunk<W>(up + i);
    float d_gate[W], d_up[W];
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const float x = to_float(g.e[k]);
      const float s = 1.0f / (1.0f + expf(-x));
      d_gate[k] = to_float(dy.e[k]) * to_float(u.e[k]) * s * (1.0f + x * (1.0f - s));
      d_up[k] = to_float(dy.e[k]) * (x * s);
    }
    Chunk<Elem, W> acc = load_chunk<W>(dgate + i);
#pragma unroll
    for (int k = 0; k < W; ++k) acc.e[k] = from_float<Elem>(to_float(acc.e[k]) + d_gate[k]);
    store_chunk<W>(dgate + i, acc);
    acc = load_chunk<W>(dup + i);  // after the store, as the CPU loop (dgate == dup adds both)
#pragma unroll
    for (int k = 0; k < W; ++k) acc.e[k] = from_float<Elem>(to_float(acc.e[k]) + d_up[k]);
    store_chunk<W>(dup + i, acc);
  }
};

}  // namespace

template <class Act>
void swiglu_forward(Act* out, const Act* gate, const Act* up, std::int64_t N, cudaStream_t stream) {
  launch_elementwise<Act>(SwigluForward<Act>{out, gate, up}, N, aligned16({out, gate, up}), stream);
}
LLMTRAIN_INSTANTIATE_ACTIVATIONS(swiglu_forward)

template <class Act>
void swiglu_backward(Act* dgate, Act* dup, const Act* dout, const Act* gate, const Act* up, std::int64_t N,
                     cudaStream_t stream) {
  launch_elementwise<Act>(SwigluBackward<Act>{dgate, dup, dout, gate, up}, N, aligned16({dgate, dup, dout, gate, up}),
                          stream);
}
LLMTRAIN_INSTANTIATE_ACTIVATIONS(swiglu_backward)

}  // namespace llmtrain::cuda
