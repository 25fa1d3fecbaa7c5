// LayerNorm (GPT-2). Forward and the input gradient: one warp per row (C up to a few thousand
// is 1-2 dozen elements per lane), 8 rows per block, 128-bit loads when C is a multiple of 4
// and the pointers are aligned. The row statistics are float sums reduced with warp shuffles;
// the variance is two-pass, sum((x - mean)^2), as on the CPU (no E[x^2] - mean^2
// cancellation); re-reading the row hits L1/L2.
//  - layernorm_residual_forward adds the residual first (residual = a + b, rounded to the
//    activation type, then normalised): one kernel instead of residual_forward's read of a and b,
//    write of the sum, and LayerNorm's read of it back from memory.
//  - Backward: the weight and bias gradients are column sums over the N rows, taken in the same
//    kernel as the input gradient, from the values it has loaded anyway: each warp keeps its lanes'
//    columns' sums in registers over its rows (up to 32 values per lane: C <= 1024 on the 128-bit
//    paths, 256 on the scalar one) and writes one partial row per warp; a fixed-order pass adds
//    the partials (reduce.cuh's column_finish_kernel: no atomics, deterministic). That saves the
//    separate column-sum kernel's re-read of dout and inp (2 N C elements). Wider rows keep that
//    kernel (column_sums: slab partials then the same fixed-order pass).
// bf16 (mixed precision): the same kernels on bf16 rows, weight and bias (8 per 128-bit access,
// C % 8 == 0), fp32 statistics and arithmetic, fp32 weight and bias gradients.
#include <algorithm>

#include "cuda_check.h"
#include "instantiate.cuh"
#include "launch.cuh"
#include "llmtrain/kernels/cuda.h"
#include "reduce.cuh"
#include "vector_io.cuh"

namespace llmtrain::cuda {
namespace {

constexpr float layernorm_eps = 1e-5f;  // GPT-2's, as the CPU reference
constexpr int rows_per_block = 8;       // one warp each

// With a residual (a and b non-null), inp = a + b is written first (the residual stream) and
// normalised as read back (rounded to Elem, as the unfused ops see it): each lane re-reads only
// what it wrote itself.
template <class Elem, int W>
__global__ void layernorm_forward_kernel(Elem* out /* (N,C) */, float* mean /* (N) */, float* rstd /* (N) */,
                                         Elem* inp /* (N,C) */, const Elem* weight /* (C) */,
                                         const Elem* bias /* (C) */, const Elem* a /* (N,C) or null */,
                                         const Elem* b /* (N,C) or null */, std::int64_t N, int C) {
  const std::int64_t row = std::int64_t(blockIdx.x) * rows_per_block + threadIdx.x / warp_size;
  if (row >= N) return;  // the whole warp: the shuffles below always see 32 lanes
  const int lane = threadIdx.x % warp_size;
  Elem* x = inp + row * C;

  float sum = 0.0f;
  for (int c = lane * W; c < C; c += warp_size * W) {
    Chunk<Elem, W> v;
    if (a) {
      const Chunk<Elem, W> av = load_chunk<W>(a + row * C + c), bv = load_chunk<W>(b + row * C + c);
#pragma unroll
      for (int k = 0; k < W; ++k) v.e[k] = from_float<Elem>(to_float(av.e[k]) + to_float(bv.e[k]));
      store_chunk<W>(x + c, v);
    } else {
      v = load_chunk<W>(x + c);
    }
#pragma unroll
    for (int k = 0; k < W; ++k) sum += to_float(v.e[k]);
  }
  const float m = warp_reduce(sum, SumOp{}) / float(C);

  float var = 0.0f;
  for (int c = lane * W; c < C; c += warp_size * W) {
    const Chunk<Elem, W> v = load_chunk<W>(x + c);
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const float d = to_float(v.e[k]) - m;
      var += d * d;
    }
  }
  const float s = 1.0f / sqrtf(warp_reduce(var, SumOp{}) / float(C) + layernorm_eps);

  Elem* y = out + row * C;
  for (int c = lane * W; c < C; c += warp_size * W) {
    const Chunk<Elem, W> v = load_chunk<W>(x + c), w = load_chunk<W>(weight + c), b = load_chunk<W>(bias + c);
    Chunk<Elem, W> r;
#pragma unroll
    for (int k = 0; k < W; ++k) {
      r.e[k] = from_float<Elem>((to_float(v.e[k]) - m) * s * to_float(w.e[k]) + to_float(b.e[k]));
    }
    store_chunk<W>(y + c, r);
  }
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = s;
  }
}

// dx = rstd (dnorm - mean(dnorm) - norm mean(dnorm norm)), dnorm = w dy, norm = (x - mean) rstd.
template <class Elem, int W>
__global__ void layernorm_backward_kernel(Elem* dinp /* (N,C) */, const Elem* dout /* (N,C) */,
                                          const Elem* inp /* (N,C) */, const Elem* weight /* (C) */,
                                          const float* mean /* (N) */, const float* rstd /* (N) */,
                                          std::int64_t N, int C) {
  const std::int64_t row = std::int64_t(blockIdx.x) * rows_per_block + threadIdx.x / warp_size;
  if (row >= N) return;  // the whole warp
  const int lane = threadIdx.x % warp_size;
  const Elem* x = inp + row * C;
  const Elem* dy = dout + row * C;
  const float m = mean[row], s = rstd[row];

  float dnorm_sum = 0.0f, dnorm_norm_sum = 0.0f;
  for (int c = lane * W; c < C; c += warp_size * W) {
    const Chunk<Elem, W> xv = load_chunk<W>(x + c), gv = load_chunk<W>(dy + c),
                         wv = load_chunk<W>(weight + c);
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const float norm = (to_float(xv.e[k]) - m) * s;
      const float dnorm = to_float(wv.e[k]) * to_float(gv.e[k]);
      dnorm_sum += dnorm;
      dnorm_norm_sum += dnorm * norm;
    }
  }
  const float dnorm_mean = warp_reduce(dnorm_sum, SumOp{}) / float(C);
  const float dnorm_norm_mean = warp_reduce(dnorm_norm_sum, SumOp{}) / float(C);

  Elem* dx = dinp + row * C;
  for (int c = lane * W; c < C; c += warp_size * W) {
    const Chunk<Elem, W> xv = load_chunk<W>(x + c), gv = load_chunk<W>(dy + c),
                         wv = load_chunk<W>(weight + c);
    Chunk<Elem, W> r = load_chunk<W>(dx + c);
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const float norm = (to_float(xv.e[k]) - m) * s;
      const float g = (to_float(wv.e[k]) * to_float(gv.e[k]) - dnorm_mean - norm * dnorm_norm_mean) * s;
      r.e[k] = from_float<Elem>(to_float(r.e[k]) + g);
    }
    store_chunk<W>(dx + c, r);
  }
}

// The input gradient as layernorm_backward_kernel, and the weight and bias gradients' partial sums
// over this warp's rows (warp w of the grid: rows w, w + warps, ...) in registers: lane l holds
// the columns (l + 32 j) W + e, j < Chunks, e < W. partials (warps, 2, C): warp w's dweight then
// dbias sums. The rows each warp takes depend only on N and the grid: deterministic.
template <class Elem, int W, int Chunks>
__global__ void layernorm_backward_fused_kernel(Elem* dinp /* (N,C) */, float* partials /* (warps, 2, C) */,
                                                const Elem* dout /* (N,C) */, const Elem* inp /* (N,C) */,
                                                const Elem* weight /* (C) */, const float* mean /* (N) */,
                                                const float* rstd /* (N) */, std::int64_t N, int C) {
  const int lane = threadIdx.x % warp_size;
  const std::int64_t warp = std::int64_t(blockIdx.x) * rows_per_block + threadIdx.x / warp_size;
  const std::int64_t warps = std::int64_t(gridDim.x) * rows_per_block;
  float dw[Chunks][W] = {}, db[Chunks][W] = {};
  for (std::int64_t row = warp; row < N; row += warps) {  // the whole warp together
    const Elem* x = inp + row * C;
    const Elem* dy = dout + row * C;
    const float m = mean[row], s = rstd[row];
    float dnorm_sum = 0.0f, dnorm_norm_sum = 0.0f;
#pragma unroll
    for (int j = 0; j < Chunks; ++j) {
      const int c = (lane + j * warp_size) * W;
      if (c < C) {
        const Chunk<Elem, W> xv = load_chunk<W>(x + c), gv = load_chunk<W>(dy + c), wv = load_chunk<W>(weight + c);
#pragma unroll
        for (int k = 0; k < W; ++k) {
          const float norm = (to_float(xv.e[k]) - m) * s;
          const float dnorm = to_float(wv.e[k]) * to_float(gv.e[k]);
          dnorm_sum += dnorm;
          dnorm_norm_sum += dnorm * norm;
        }
      }
    }
    const float dnorm_mean = warp_reduce(dnorm_sum, SumOp{}) / float(C);
    const float dnorm_norm_mean = warp_reduce(dnorm_norm_sum, SumOp{}) / float(C);
    Elem* dx = dinp + row * C;
#pragma unroll
    for (int j = 0; j < Chunks; ++j) {
      const int c = (lane + j * warp_size) * W;
      if (c < C) {
        const Chunk<Elem, W> xv = load_chunk<W>(x + c), gv = load_chunk<W>(dy + c), wv = load_chunk<W>(weight + c);
        Chunk<Elem, W> r = load_chunk<W>(dx + c);
#pragma unroll
        for (int k = 0; k < W; ++k) {
          const float norm = (to_float(xv.e[k]) - m) * s;
          const float g = to_float(gv.e[k]);
          const float d = (to_float(wv.e[k]) * g - dnorm_mean - norm * dnorm_norm_mean) * s;
          r.e[k] = from_float<Elem>(to_float(r.e[k]) + d);
          dw[j][k] += norm * g;
          db[j][k] += g;
        }
        store_chunk<W>(dx + c, r);
      }
    }
  }
  float* dw_out = partials + warp * 2 * C;
  float* db_out = dw_out + C;
#pragma unroll
  for (int j = 0; j < Chunks; ++j) {
    const int c = (lane + j * warp_size) * W;
    if (c < C) {
#pragma unroll
      for (int k = 0; k < W; ++k) {
        dw_out[c + k] = dw[j][k];
        db_out[c + k] = db[j][k];
      }
    }
  }
}

// Per (row, channel): {dweight term, dbias term}.
template <class Elem>
struct LayernormParamGrads {
  const Elem* dout;   // (N,C)
  const Elem* inp;    // (N,C)
  const float* mean;  // (N)
  const float* rstd;  // (N)
  int C;
  __device__ void operator()(std::int64_t i, int c, float (&v)[2]) const {
    const std::int64_t at = i * C + c;
    const float dy = to_float(dout[at]);
    v[0] = (to_float(inp[at]) - mean[i]) * rstd[i] * dy;
    v[1] = dy;
  }
};

unsigned row_blocks(std::int64_t N) {
  return unsigned((N + rows_per_block - 1) / rows_per_block);
}

template <class Elem>
void layernorm_forward_dispatch(Elem* out, float* mean, float* rstd, const Elem* inp, const Elem* weight,
                                const Elem* bias, const Elem* a, const Elem* b, std::int64_t N, int C,
                                cudaStream_t stream) {
  if (N <= 0) return;
  constexpr int block = rows_per_block * warp_size;
  // The kernel writes inp only with a residual (then inp is the residual output).
  Elem* x = const_cast<Elem*>(inp);
  if (C % vec_width<Elem> == 0 && aligned16({out, inp, weight, bias, a, b})) {
    layernorm_forward_kernel<Elem, vec_width<Elem>>
        <<<row_blocks(N), block, 0, stream>>>(out, mean, rstd, x, weight, bias, a, b, N, C);
  } else {
    layernorm_forward_kernel<Elem, 1><<<row_blocks(N), block, 0, stream>>>(out, mean, rstd, x, weight, bias, a, b, N, C);
  }
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
}

// The fused backward for W-wide accesses with Chunks per lane (W Chunks 32 >= C).
template <class Elem, int W, int Chunks>
void layernorm_backward_fused(Elem* dinp, float* dweight, float* dbias, const Elem* dout, const Elem* inp,
                              const Elem* weight, const float* mean, const float* rstd, std::int64_t N, int C,
                              cudaStream_t stream) {
  // About 16 rows per warp, at most 2048 warps (256 blocks: two per SM on 132 SMs, and partials
  // of 2048 x 2C floats, a few percent of the rows' bytes); fixed by N alone.
  const std::int64_t blocks =
      std::clamp<std::int64_t>((N + 16 * rows_per_block - 1) / (16 * rows_per_block), 1, 256);
  const std::int64_t warps = blocks * rows_per_block;
  const StreamScratch scratch(std::size_t(warps) * 2 * std::size_t(C) * sizeof(float), stream);
  layernorm_backward_fused_kernel<Elem, W, Chunks><<<unsigned(blocks), rows_per_block * warp_size, 0, stream>>>(
      dinp, scratch.at<float>(), dout, inp, weight, mean, rstd, N, C);
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
  constexpr int finish_block = 256;
  column_finish_kernel<2><<<unsigned((2 * std::int64_t(C) + finish_block - 1) / finish_block), finish_block, 0,
                            stream>>>(ColumnOutputs<2>{{dweight, dbias}}, scratch.at<float>(), int(warps), C);
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
}

// The fused backward with the smallest per-lane chunk count (Chunks, doubled up to MaxChunks)
// that covers C with W-wide accesses; false, having launched nothing, when none does.
template <class Elem, int W, int Chunks, int MaxChunks>
bool layernorm_backward_fused_fit(Elem* dinp, float* dweight, float* dbias, const Elem* dout, const Elem* inp,
                                  const Elem* weight, const float* mean, const float* rstd, std::int64_t N, int C,
                                  cudaStream_t stream) {
  if (C <= Chunks * W * warp_size) {
    layernorm_backward_fused<Elem, W, Chunks>(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C, stream);
    return true;
  }
  if constexpr (Chunks < MaxChunks) {
    return layernorm_backward_fused_fit<Elem, W, Chunks * 2, MaxChunks>(dinp, dweight, dbias, dout, inp, weight,
                                                                        mean, rstd, N, C, stream);
  }
  return false;
}

template <class Elem>
void layernorm_backward_dispatch(Elem* dinp, float* dweight, float* dbias, const Elem* dout, const Elem* inp,
                                 const Elem* weight, const float* mean, const float* rstd, std::int64_t N,
                                 int C, cudaStream_t stream) {
  if (N <= 0) return;
  constexpr int block = rows_per_block * warp_size;
  constexpr int V = vec_width<Elem>;
  const bool vectors = C % V == 0 && aligned16({dinp, dout, inp, weight});
  if (vectors ? layernorm_backward_fused_fit<Elem, V, 1, 32 / V>(dinp, dweight, dbias, dout, inp, weight, mean, rstd,
                                                                 N, C, stream)
              : layernorm_backward_fused_fit<Elem, 1, 1, 8>(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N,
                                                            C, stream)) {
    return;
  }
  if (vectors) {
    layernorm_backward_kernel<Elem, vec_width<Elem>>
        <<<row_blocks(N), block, 0, stream>>>(dinp, dout, inp, weight, mean, rstd, N, C);
  } else {
    layernorm_backward_kernel<Elem, 1>
        <<<row_blocks(N), block, 0, stream>>>(dinp, dout, inp, weight, mean, rstd, N, C);
  }
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
  column_sums<2>(ColumnOutputs<2>{{dweight, dbias}}, LayernormParamGrads<Elem>{dout, inp, mean, rstd, C}, N,
                 C, stream);
}

}  // namespace

template <class Act>
void layernorm_forward(Act* out, float* mean, float* rstd, const Act* inp, const Act* weight, const Act* bias,
                       std::int64_t N, int C, cudaStream_t stream) {
  layernorm_forward_dispatch<Act>(out, mean, rstd, inp, weight, bias, nullptr, nullptr, N, C, stream);
}
LLMTRAIN_INSTANTIATE_ACTIVATIONS(layernorm_forward)

template <class Act>
void layernorm_backward(Act* dinp, float* dweight, float* dbias, const Act* dout, const Act* inp, const Act* weight,
                        const float* mean, const float* rstd, std::int64_t N, int C, cudaStream_t stream) {
  layernorm_backward_dispatch(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C, stream);
}
LLMTRAIN_INSTANTIATE_ACTIVATIONS(layernorm_backward)

template <class Act>
void layernorm_residual_forward(Act* residual, Act* out, float* mean, float* rstd, const Act* a, const Act* b,
                                const Act* weight, const Act* bias, std::int64_t N, int C, cudaStream_t stream) {
  layernorm_forward_dispatch<Act>(out, mean, rstd, residual, weight, bias, a, b, N, C, stream);
}
LLMTRAIN_INSTANTIATE_ACTIVATIONS(layernorm_residual_forward)

}  // namespace llmtrain::cuda
