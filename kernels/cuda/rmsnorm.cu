// RMSNorm (Llama's norm): one warp per row, 8 rows per block, 128-bit loads when C is a multiple
// of the vector width and the pointers are aligned; float sums with warp shuffles; the weight
// gradient is a deterministic column sum (reduce.cuh), as in layernorm.cu. bf16: the same kernels
// on bf16 activations and weight (8 per 128-bit access), fp32 rstd, arithmetic and weight
// gradient. CPU reference: kernels/cpu/rmsnorm.cpp. qk_norm (model.qk_norm): the same per query and
// key head of a packed qkv, one warp per (token, head), value heads copied; scalar loads (a head is
// 64 or 128 elements: two or four per lane).
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

// One warp per (token, head) of qkv (N, H HS), H = NH + 2 NKV: query heads by q_weight, key heads
// by k_weight, value heads copied.
template <class Elem>
__global__ void qk_norm_forward_kernel(Elem* out, float* rstd /* (N, NH + NKV) */, const Elem* inp,
                                       const Elem* q_weight /* (HS) */, const Elem* k_weight /* (HS) */,
                                       std::int64_t N, int NH, int NKV, int HS, float eps) {
  const int H = NH + 2 * NKV;
  const std::int64_t row = std::int64_t(blockIdx.x) * rows_per_block + threadIdx.x / warp_size;
  if (row >= N * H) return;  // the whole warp
  const int lane = threadIdx.x % warp_size;
  const std::int64_t n = row / H;
  const int h = int(row % H);
  const Elem* x = inp + row * HS;
  Elem* y = out + row * HS;
  if (h >= NH + NKV) {
    for (int c = lane; c < HS; c += warp_size) y[c] = x[c];
    return;
  }
  const Elem* w = h < NH ? q_weight : k_weight;
  float sum_squares = 0.0f;
  for (int c = lane; c < HS; c += warp_size) sum_squares += to_float(x[c]) * to_float(x[c]);
  const float s = 1.0f / sqrtf(warp_reduce(sum_squares, SumOp{}) / float(HS) + eps);
  for (int c = lane; c < HS; c += warp_size) y[c] = from_float<Elem>(to_float(x[c]) * s * to_float(w[c]));
  if (lane == 0) rstd[n * (NH + NKV) + h] = s;
}

template <class Elem>
__global__ void qk_norm_backward_kernel(Elem* dinp, const Elem* dout, const Elem* inp, const Elem* q_weight,
                                        const Elem* k_weight, const float* rstd, std::int64_t N, int NH, int NKV,
                                        int HS) {
  const int H = NH + 2 * NKV;
  const std::int64_t row = std::int64_t(blockIdx.x) * rows_per_block + threadIdx.x / warp_size;
  if (row >= N * H) return;  // the whole warp
  const int lane = threadIdx.x % warp_size;
  const std::int64_t n = row / H;
  const int h = int(row % H);
  const Elem* x = inp + row * HS;
  const Elem* dy = dout + row * HS;
  Elem* dx = dinp + row * HS;
  if (h >= NH + NKV) {
    for (int c = lane; c < HS; c += warp_size) dx[c] = dy[c];
    return;
  }
  const Elem* w = h < NH ? q_weight : k_weight;
  const float s = rstd[n * (NH + NKV) + h];
  float dot = 0.0f;
  for (int c = lane; c < HS; c += warp_size) dot += to_float(w[c]) * to_float(dy[c]) * to_float(x[c]) * s;
  dot = warp_reduce(dot, SumOp{}) / float(HS);
  for (int c = lane; c < HS; c += warp_size) {
    dx[c] = from_float<Elem>(s * (to_float(w[c]) * to_float(dy[c]) - to_float(x[c]) * s * dot));
  }
}

// Per (row, channel) of the query (first) or key heads, row = token x heads + head: x rstd dy.
template <class Elem>
struct QkNormWeightGrad {
  const Elem* dout;   // (N, H HS)
  const Elem* inp;    // (N, H HS)
  const float* rstd;  // (N, NH + NKV)
  int heads, first, H, normed, HS;  // the heads summed: first .. first + heads - 1
  __device__ void operator()(std::int64_t i, int c, float (&v)[1]) const {
    const std::int64_t n = i / heads;
    const int h = first + int(i % heads);
    const std::int64_t at = (n * H + h) * HS + c;
    v[0] = to_float(inp[at]) * rstd[n * normed + h] * to_float(dout[at]);
  }
};

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

template <class Act>
void qk_norm_forward(Act* out, float* rstd, const Act* inp, const Act* q_weight, const Act* k_weight, std::int64_t N,
                     int NH, int NKV, int HS, float eps, cudaStream_t stream) {
  const std::int64_t rows = N * (NH + 2 * NKV);
  if (rows <= 0) return;
  qk_norm_forward_kernel<Act><<<row_blocks(rows), rows_per_block * warp_size, 0, stream>>>(
      out, rstd, inp, q_weight, k_weight, N, NH, NKV, HS, eps);
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
}
LLMTRAIN_INSTANTIATE_ACTIVATIONS(qk_norm_forward)

template <class Act>
void qk_norm_backward(Act* dinp, float* dq_weight, float* dk_weight, const Act* dout, const Act* inp,
                      const Act* q_weight, const Act* k_weight, const float* rstd, std::int64_t N, int NH, int NKV,
                      int HS, cudaStream_t stream) {
  const int H = NH + 2 * NKV;
  if (N <= 0) return;
  qk_norm_backward_kernel<Act><<<row_blocks(N * H), rows_per_block * warp_size, 0, stream>>>(
      dinp, dout, inp, q_weight, k_weight, rstd, N, NH, NKV, HS);
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
  column_sums<1>(ColumnOutputs<1>{{dq_weight}}, QkNormWeightGrad<Act>{dout, inp, rstd, NH, 0, H, NH + NKV, HS},
                 N * NH, HS, stream);
  column_sums<1>(ColumnOutputs<1>{{dk_weight}}, QkNormWeightGrad<Act>{dout, inp, rstd, NKV, NH, H, NH + NKV, HS},
                 N * NKV, HS, stream);
}
LLMTRAIN_INSTANTIATE_ACTIVATIONS(qk_norm_backward)

}  // namespace llmtrain::cuda
