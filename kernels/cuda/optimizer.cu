// The optimizer's ops. sum_squares (for the global gradient norm) is a deterministic two-pass
// reduction in double (reduce.cuh): a grid fixed by N, per-thread double sums, block partials
// added in a fixed order, the scalar copied back (synchronising the stream). adamw_update is
// elementwise (128-bit accesses, elementwise_launch.cuh); the bias corrections are computed on
// the host exactly as the CPU reference computes them.
//
// adamw_update_chunks is the multi-tensor AdamW the trainer uses: the whole update in ONE
// launch instead of one or two per parameter tensor (GPT-2 124M has 148 tensors, and a launch
// over a 768-element LayerNorm weight leaves the GPU idle for longer than it computes). The host
// cuts every run of the update (a parameter's part, decayed or not) into chunks of at most
// adamw_chunk_elements once (ops::AdamWPlan) and keeps that table in device memory; block b
// updates chunk b, with 128-bit accesses when the chunk starts on a multiple of 4 elements and
// the arrays are aligned, scalar ones otherwise. In the same pass it writes the bf16 working copy
// of the weights it updated (mixed precision), so that forward no longer converts all the master
// weights again.
#include <cmath>

#include "cuda_check.h"
#include "elementwise_launch.cuh"
#include "llmtrain/kernels/cuda.h"
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

// Muon's momentum: buf <- buf + (1 - momentum)(g - buf), u = g + momentum (buf - g) (nesterov) or
// buf, with g = grad * grad_scale; the same arithmetic as the CPU reference, in the same order.
struct MuonMomentum {
  float* buf;         // (N)
  const float* grad;  // (N)
  float* u;           // (N)
  float momentum, grad_scale;
  int nesterov;
  template <int W>
  __device__ void apply(std::int64_t i) const {
    const Chunk<float, W> g = load_chunk<W>(grad + i);
    Chunk<float, W> b = load_chunk<W>(buf + i), out;
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const float gs = grad_scale * g.e[k];
      b.e[k] += (1.0f - momentum) * (gs - b.e[k]);
      out.e[k] = nesterov ? gs + momentum * (b.e[k] - gs) : b.e[k];
    }
    store_chunk<W>(buf + i, b);
    store_chunk<W>(u + i, out);
  }
};

// Muon's weight update: param <- param keep - step o, and the bf16 working copy when given.
struct MuonApply {
  float* param;    // (N)
  const float* o;  // (N)
  bf16* working;   // (N) or null
  float keep, step;
  template <int W>
  __device__ void apply(std::int64_t i) const {
    Chunk<float, W> p = load_chunk<W>(param + i);
    const Chunk<float, W> x = load_chunk<W>(o + i);
#pragma unroll
    for (int k = 0; k < W; ++k) p.e[k] = p.e[k] * keep - step * x.e[k];
    store_chunk<W>(param + i, p);
    if (working) {
      Chunk<bf16, W> w;
#pragma unroll
      for (int k = 0; k < W; ++k) w.e[k] = from_float<bf16>(p.e[k]);
      store_chunk<W>(working + i, w);
    }
  }
};

struct AdamWChunkArgs {
  float* param;        // (N)
  const float* grad;   // (N)
  float* m;            // (N)
  float* v;            // (N)
  bf16* working;       // (N) or null
  float lr, beta1, beta2, eps, weight_decay, grad_scale, m_correction, v_correction;
};

/// Elements [i, i + W) of one chunk, whose moments are [s, s + W) of m and v: the same arithmetic
/// as AdamW<float>, in the same order.
template <int W>
__device__ __forceinline__ void adamw_elements(const AdamWChunkArgs& a, std::int64_t i, std::int64_t s,
                                               float weight_decay) {
  const Chunk<float, W> g = load_chunk<W>(a.grad + i);
  Chunk<float, W> p = load_chunk<W>(a.param + i);
  Chunk<float, W> mv = load_chunk<W>(a.m + s), vv = load_chunk<W>(a.v + s);
#pragma unroll
  for (int k = 0; k < W; ++k) {
    const float gs = g.e[k] * a.grad_scale;
    mv.e[k] = a.beta1 * mv.e[k] + (1.0f - a.beta1) * gs;
    vv.e[k] = a.beta2 * vv.e[k] + (1.0f - a.beta2) * gs * gs;
    const float m_hat = mv.e[k] * a.m_correction, v_hat = vv.e[k] * a.v_correction;
    const float x = p.e[k];
    p.e[k] = x - a.lr * (m_hat / (sqrtf(v_hat) + a.eps) + weight_decay * x);
  }
  store_chunk<W>(a.m + s, mv);
  store_chunk<W>(a.v + s, vv);
  store_chunk<W>(a.param + i, p);
  if (a.working) {
    Chunk<bf16, W> w;
#pragma unroll
    for (int k = 0; k < W; ++k) w.e[k] = from_float<bf16>(p.e[k]);
    store_chunk<W>(a.working + i, w);  // 4 bf16: 8 bytes, aligned when the floats are
  }
}

constexpr int adamw_block = 256;
constexpr int adamw_width = 4;  // floats per 128-bit access
static_assert(adamw_chunk_elements % (adamw_block * adamw_width) == 0, "a chunk is whole passes of the block");

/// `aligned`: every array is 16-byte aligned, so a chunk whose weights and moments both start on a
/// multiple of 4 elements takes 128-bit accesses (the whole block decides alike: one branch per
/// chunk).
__global__ void __launch_bounds__(adamw_block)
    adamw_chunks_kernel(AdamWChunkArgs a, const AdamWChunk* chunks /* (n_chunks) */, bool aligned) {
  const AdamWChunk chunk = chunks[blockIdx.x];
  const float weight_decay = chunk.decay ? a.weight_decay : 0.0f;
  if (aligned && chunk.begin % adamw_width == 0 && chunk.state % adamw_width == 0) {
    const int body = chunk.length / adamw_width * adamw_width;
    for (int i = threadIdx.x * adamw_width; i < body; i += adamw_block * adamw_width) {
      adamw_elements<adamw_width>(a, chunk.begin + i, chunk.state + i, weight_decay);
    }
    for (int i = body + int(threadIdx.x); i < chunk.length; i += adamw_block) {
      adamw_elements<1>(a, chunk.begin + i, chunk.state + i, weight_decay);
    }
  } else {
    for (int i = threadIdx.x; i < chunk.length; i += adamw_block) {
      adamw_elements<1>(a, chunk.begin + i, chunk.state + i, weight_decay);
    }
  }
}

}  // namespace

double sum_squares(const float* x, std::int64_t N, double* into, cudaStream_t stream) {
  if (into) {
    sum_into_device(into, x, N, Square{}, stream);
    return 0.0;
  }
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

void adamw_update_chunks(float* param, const float* grad, float* m, float* v, bf16* working,
                         const AdamWChunk* chunks, std::int64_t n_chunks, float lr, float beta1, float beta2,
                         float eps, float weight_decay, int step, float grad_scale, cudaStream_t stream) {
  if (n_chunks <= 0) return;
  if (n_chunks > INT32_MAX) throw kernels::Error("cuda::adamw_update_chunks: more than 2^31 - 1 chunks");
  const AdamWChunkArgs a{param,
                         grad,
                         m,
                         v,
                         working,
                         lr,
                         beta1,
                         beta2,
                         eps,
                         weight_decay,
                         grad_scale,
                         1.0f / (1.0f - std::pow(beta1, float(step))),
                         1.0f / (1.0f - std::pow(beta2, float(step)))};
  adamw_chunks_kernel<<<unsigned(n_chunks), adamw_block, 0, stream>>>(a, chunks,
                                                                     aligned16({param, grad, m, v, working}));
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
}

void muon_momentum(float* buf, const float* grad, float* u, std::int64_t N, float momentum, int nesterov,
                   float grad_scale, cudaStream_t stream) {
  const MuonMomentum op{buf, grad, u, momentum, grad_scale, nesterov};
  launch_elementwise<float>(op, N, aligned16({buf, grad, u}), stream);
}

void muon_apply(float* param, const float* o, bf16* working, std::int64_t N, float keep, float step,
                cudaStream_t stream) {
  const MuonApply op{param, o, working, keep, step};
  // 4 floats per access, 4 bf16 (8 bytes) of the working copy: aligned when the floats are.
  const bool aligned = aligned16({param, o}) && (!working || reinterpret_cast<std::uintptr_t>(working) % 8 == 0);
  launch_elementwise<float>(op, N, aligned, stream);
}

}  // namespace llmtrain::cuda
