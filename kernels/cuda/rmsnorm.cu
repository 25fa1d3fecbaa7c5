// RMSNorm (Llama's norm): one warp per row, 8 rows per block, 128-bit loads when C is a multiple
// of the vector width and the pointers are aligned; float sums with warp shuffles; the weight
// gradient is a deterministic column sum (reduce.cuh), as in layernorm.cu. bf16: the same kernels
// on bf16 activations and weight (8 per 128-bit access), fp32 rstd, arithmetic and weight
// gradient. CPU reference: kernels/cpu/rmsnorm.cpp.
#include "cuda_check.h"
#include "instantiate.cuh"
#include "launch.cuh"
#include "llmtrain/kernels/cuda.h"
#include "reduce.cuh"
#include "vector_io.cuh"

namespace llmtrain::cuda {
namespace {

constexpr int rows_per_block = 8;  // one warp each

unsigned row_blocks(std::int64_t N) {
  return unsigned((N + rows_per_block - 1) / rows_per_block);
}

template <class Elem, int W>
__global__ void rmsnorm_forward_kernel(Elem* out /* (N,C) */, float* rstd /* (N) */,
                                       const Elem* inp /* (N,C) */, const Elem* weight /* (C) */,
                                       std::int64_t N, int C, float eps) {
  const std::int64_t row = std::int64_t(blockIdx.x) * rows_per_block + threadIdx.x / warp_size;
  if (row >= N) return;  // the whole warp: the shuffles below always see 32 lanes
  const int lane = threadIdx.x % warp_size;
  const Elem* x = inp + row * C;
  float sum_squares = 0.0f;
  for (int c = lane * W; c < C; c += warp_size * W) {
    const Chunk<Elem, W> v = load_chunk<W>(x + c);
#pragma unroll
    for (int k = 0; k < W; ++k) sum_squares += to_float(v.e[k]) * to_float(v.e[k]);
  }
  const float s = 1.0f / sqrtf(warp_reduce(sum_squares, SumOp{}) / float(C) + eps);
  Elem* y = out + row * C;
  for (int c = lane * W; c < C; c += warp_size * W) {
    const Chunk<Elem, W> v = load_chunk<W>(x + c), w = load_chunk<W>(weight + c);
    Chunk<Elem, W> r;
#pragma unroll
    for (int k = 0; k < W; ++k) r.e[k] = from_float<Elem>(to_float(v.e[k]) * s * to_float(w.e[k]));
    store_chunk<W>(y + c, r);
  }
  if (lane == 0) rstd[row] = s;
}

// y = w n, n = x s: dx = s (w dy - n mean(w dy n)).
template <class Elem, int W>
__global__ void rmsnorm_backward_kernel(Elem* dinp /* (N,C) */, const Elem* dout /* (N,C) */,
                                        const Elem* inp /* (N,C) */, const Elem* weight /* (C) */,
                                        const float* rstd /* (N) */, std::int64_t N, int C) {
  const std::int64_t row = std::int64_t(blockIdx.x) * rows_per_block + threadIdx.x / warp_size;
  if (row >= N) return;  // the whole warp
  const int lane = threadIdx.x % warp_size;
  const Elem* x = inp + row * C;
  const Elem* dy = dout + row * C;
  const float s = rstd[row];
  float dot = 0.0f;
  for (int c = lane * W; c < C; c += warp_size * W) {
    const Chunk<Elem, W> xv = load_chunk<W>(x + c), gv = load_chunk<W>(dy + c),
                         wv = load_chunk<W>(weight + c);
#pragma unroll
    for (int k = 0; k < W; ++k) dot += to_float(wv.e[k]) * to_float(gv.e[k]) * to_float(xv.e[k]) * s;
  }
  dot = warp_reduce(dot, SumOp{}) / float(C);
  Elem* dx = dinp + row * C;
  for (int c = lane * W; c < C; c += warp_size * W) {
    const Chunk<Elem, W> xv = load_chunk<W>(x + c), gv = load_chunk<W>(dy + c),
                         wv = load_chunk<W>(weight + c);
    Chunk<Elem, W> r = load_chunk<W>(dx + c);
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const float g = s * (to_float(wv.e[k]) * to_float(gv.e[k]) - to_float(xv.e[k]) * s * dot);
      r.e[k] = from_float<Elem>(to_float(r.e[k]) + g);
    }
    store_chunk<W>(dx + c, r);
  }
}

// Per (row, channel): the weight gradient term x rstd dy.
template <class Elem>
struct RmsnormWeightGrad {
  const Elem* dout;   // (N,C)
  const Elem* inp;    // (N,C)
  const float* rstd;  // (N)
  int C;
  __device__ void operator()(std::int64_t i, int c, float (&v)[1]) const {
    const std::int64_t at = i * C + c;
    v[0] = to_float(inp[at]) * rstd[i] * to_float(dout[at]);
  }
};

template <class Elem>
void rmsnorm_forward_dispatch(Elem* out, float* rstd, const Elem* inp, const Elem* weight, std::int64_t N,
                              int C, float eps, cudaStream_t stream) {
  if (N <= 0) return;
  constexpr int block = rows_per_block * warp_size;
  if (C % vec_width<Elem> == 0 && aligned16({out, inp, weight})) {
    rmsnorm_forward_kernel<Elem, vec_width<Elem>>
        <<<row_blocks(N), block, 0, stream>>>(out, rstd, inp, weight, N, C, eps);
  } else {
    rmsnorm_forward_kernel<Elem, 1><<<row_blocks(N), block, 0, stream>>>(out, rstd, inp, weight, N, C, eps);
  }
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
}

template <class Elem>
void rmsnorm_backward_dispatch(Elem* dinp, float* dweight, const Elem* dout, const Elem* inp,
                               const Elem* weight, const float* rstd, std::int64_t N, int C,
                               cudaStream_t stream) {
  if (N <= 0) return;
  constexpr int block = rows_per_block * warp_size;
  if (C % vec_width<Elem> == 0 && aligned16({dinp, dout, inp, weight})) {
    rmsnorm_backward_kernel<Elem, vec_width<Elem>>
        <<<row_blocks(N), block, 0, stream>>>(dinp, dout, inp, weight, rstd, N, C);
  } else {
    rmsnorm_backward_kernel<Elem, 1>
        <<<row_blocks(N), block, 0, stream>>>(dinp, dout, inp, weight, rstd, N, C);
  }
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
  column_sums<1>(ColumnOutputs<1>{{dweight}}, RmsnormWeightGrad<Elem>{dout, inp, rstd, C}, N, C, stream);
}

}  // namespace

template <class Act>
void rmsnorm_forward(Act* out, float* rstd, const Act* inp, const Act* weight, std::int64_t N, int C, float eps,
                     cudaStream_t stream) {
  rmsnorm_forward_dispatch(out, rstd, inp, weight, N, C, eps, stream);
}
LLMTRAIN_INSTANTIATE_ACTIVATIONS(rmsnorm_forward)

template <class Act>
void rmsnorm_backward(Act* dinp, float* dweight, const Act* dout, const Act* inp, const Act* weight,
                      const float* rstd, std::int64_t N, int C, cudaStream_t stream) {
  rmsnorm_backward_dispatch(dinp, dweight, dout, inp, weight, rstd, N, C, stream);
}
LLMTRAIN_INSTANTIATE_ACTIVATIONS(rmsnorm_backward)

}  // namespace llmtrain::cuda
