// LayerNorm (GPT-2). Forward and the input gradient: one warp per row (C up to a few thousand
// is 1-2 dozen elements per lane), 8 rows per block, 128-bit loads when C is a multiple of 4
// and the pointers are aligned. The row statistics are float sums reduced with warp shuffles;
// the variance is two-pass, sum((x - mean)^2), as on the CPU (no E[x^2] - mean^2
// cancellation); re-reading the row hits L1/L2. Weight and bias gradients are column sums over
// the N rows (reduce.cuh: slab partials then a fixed-order pass, no atomics, deterministic).
// bf16 (mixed precision): the same kernels on bf16 rows, weight and bias (8 per 128-bit access,
// C % 8 == 0), fp32 statistics and arithmetic, fp32 weight and bias gradients.
#include "cuda_check.h"
#include "launch.cuh"
#include "kernels.h"
#include "reduce.cuh"
#include "vector_io.cuh"

namespace llmtrain::cuda {
namespace {

constexpr float layernorm_eps = 1e-5f;  // GPT-2's, as the CPU reference
constexpr int rows_per_block = 8;       // one warp each

template <class Elem, int W>
__global__ void layernorm_forward_kernel(Elem* out /* (N,C) */, float* mean /* (N) */, float* rstd /* (N) */,
                                         const Elem* inp /* (N,C) */, const Elem* weight /* (C) */,
                                         const Elem* bias /* (C) */, std::int64_t N, int C) {
  const std::int64_t row = std::int64_t(blockIdx.x) * rows_per_block + threadIdx.x / warp_size;
  if (row >= N) return;  // the whole warp: the shuffles below always see 32 lanes
  const int lane = threadIdx.x % warp_size;
  const Elem* x = inp + row * C;

  float sum = 0.0f;
  for (int c = lane * W; c < C; c += warp_size * W) {
    const Chunk<Elem, W> v = load_chunk<W>(x + c);
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
                                const Elem* bias, std::int64_t N, int C, cudaStream_t stream) {
  if (N <= 0) return;
  constexpr int block = rows_per_block * warp_size;
  if (C % vec_width<Elem> == 0 && aligned16({out, inp, weight, bias})) {
    layernorm_forward_kernel<Elem, vec_width<Elem>>
        <<<row_blocks(N), block, 0, stream>>>(out, mean, rstd, inp, weight, bias, N, C);
  } else {
    layernorm_forward_kernel<Elem, 1>
        <<<row_blocks(N), block, 0, stream>>>(out, mean, rstd, inp, weight, bias, N, C);
  }
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
}

template <class Elem>
void layernorm_backward_dispatch(Elem* dinp, float* dweight, float* dbias, const Elem* dout, const Elem* inp,
                                 const Elem* weight, const float* mean, const float* rstd, std::int64_t N,
                                 int C, cudaStream_t stream) {
  if (N <= 0) return;
  constexpr int block = rows_per_block * warp_size;
  if (C % vec_width<Elem> == 0 && aligned16({dinp, dout, inp, weight})) {
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

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                       const float* bias, std::int64_t N, int C, cudaStream_t stream) {
  layernorm_forward_dispatch(out, mean, rstd, inp, weight, bias, N, C, stream);
}

void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, std::int64_t N, int C,
                        cudaStream_t stream) {
  layernorm_backward_dispatch(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C, stream);
}

void layernorm_forward(bf16* out, float* mean, float* rstd, const bf16* inp, const bf16* weight,
                       const bf16* bias, std::int64_t N, int C, cudaStream_t stream) {
  layernorm_forward_dispatch(out, mean, rstd, inp, weight, bias, N, C, stream);
}

void layernorm_backward(bf16* dinp, float* dweight, float* dbias, const bf16* dout, const bf16* inp,
                        const bf16* weight, const float* mean, const float* rstd, std::int64_t N, int C,
                        cudaStream_t stream) {
  layernorm_backward_dispatch(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C, stream);
}

}  // namespace llmtrain::cuda
