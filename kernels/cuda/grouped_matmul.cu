// The grouped GEMM of the Mixture-of-Experts layers on the GPU (CPU reference:
// kernels/cpu/grouped_matmul.cpp): every expert's rows in ONE launch. A plain tiled SIMT kernel
// (no tensor cores): 16 x 16 output tiles, one thread per output element, the operands staged
// through shared memory 16 along the reduction at a time, fp32 accumulation (bf16 loaded as float,
// rounded once on the store). The rows are in expert order (moe_dispatch's offsets, in device
// memory, so the host does not know them): the blocks of the forward and of the input gradient walk
// the (expert, row tile) list, which each derives from the offsets, in a grid-stride loop; the
// weight gradient has one block per (output tile, expert) reducing over that expert's rows in order.
// No atomics: each output element is written by one thread.
#include "cuda_check.h"
#include "instantiate.cuh"
#include "launch.cuh"
#include "llmtrain/kernels/cuda.h"
#include "vector_io.cuh"

namespace llmtrain::cuda {
namespace {

constexpr int tile = 16;
constexpr unsigned row_tile_blocks = 128;  // blocks walking the (expert, row tile) list

struct RowTile {
  int expert;        // -1: past the last tile
  std::int64_t row;  // its first row
  std::int64_t end;  // its expert's end row
};

// The n-th tile of the list expert by expert, each expert's rows cut into tiles of `tile` rows.
__device__ RowTile find_row_tile(const std::int32_t* offsets, int E, std::int64_t n) {
  std::int64_t before = 0;
  for (int e = 0; e < E; ++e) {
    const std::int64_t rows = offsets[e + 1] - offsets[e];
    const std::int64_t tiles = (rows + tile - 1) / tile;
    if (n < before + tiles) return {e, offsets[e] + (n - before) * tile, offsets[e + 1]};
    before += tiles;
  }
  return {-1, 0, 0};
}

// out (R,OC) rows of expert e = inp rows times weight[e]^T: out[r,o] = sum_c inp[r,c] w[e,o,c].
template <class Elem>
__global__ void grouped_forward_kernel(Elem* out, const Elem* inp, const Elem* weight, const std::int32_t* offsets,
                                       int E, int C, int OC) {
  __shared__ float a[tile][tile + 1];
  __shared__ float b[tile][tile + 1];
  const int tx = threadIdx.x % tile, ty = threadIdx.x / tile;
  const int o0 = blockIdx.y * tile;
  for (std::int64_t n = blockIdx.x;; n += gridDim.x) {
    const RowTile rt = find_row_tile(offsets, E, n);
    if (rt.expert < 0) return;  // the whole block
    const std::int64_t r = rt.row + ty;
    const Elem* w = weight + std::int64_t(rt.expert) * OC * C;
    float acc = 0.0f;
    for (int c0 = 0; c0 < C; c0 += tile) {
      const std::int64_t ra = rt.row + ty;
      a[ty][tx] = ra < rt.end && c0 + tx < C ? to_float(inp[ra * C + c0 + tx]) : 0.0f;
      b[ty][tx] = o0 + ty < OC && c0 + tx < C ? to_float(w[std::int64_t(o0 + ty) * C + c0 + tx]) : 0.0f;
      __syncthreads();
#pragma unroll
      for (int i = 0; i < tile; ++i) acc += a[ty][i] * b[tx][i];
      __syncthreads();
    }
    if (r < rt.end && o0 + tx < OC) out[r * OC + o0 + tx] = from_float<Elem>(acc);
  }
}

// dinp[r,c] (+)= sum_o dout[r,o] w[e,o,c].
template <class Elem>
__global__ void grouped_dinp_kernel(Elem* dinp, const Elem* dout, const Elem* weight, const std::int32_t* offsets,
                                    int E, int C, int OC, bool accumulate) {
  __shared__ float a[tile][tile + 1];
  __shared__ float b[tile][tile + 1];
  const int tx = threadIdx.x % tile, ty = threadIdx.x / tile;
  const int c0 = blockIdx.y * tile;
  for (std::int64_t n = blockIdx.x;; n += gridDim.x) {
    const RowTile rt = find_row_tile(offsets, E, n);
    if (rt.expert < 0) return;  // the whole block
    const std::int64_t r = rt.row + ty;
    const Elem* w = weight + std::int64_t(rt.expert) * OC * C;
    float acc = 0.0f;
    for (int o0 = 0; o0 < OC; o0 += tile) {
      a[ty][tx] = r < rt.end && o0 + tx < OC ? to_float(dout[r * OC + o0 + tx]) : 0.0f;
      b[ty][tx] = o0 + ty < OC && c0 + tx < C ? to_float(w[std::int64_t(o0 + ty) * C + c0 + tx]) : 0.0f;
      __syncthreads();
#pragma unroll
      for (int i = 0; i < tile; ++i) acc += a[ty][i] * b[i][tx];
      __syncthreads();
    }
    if (r < rt.end && c0 + tx < C) {
      Elem* d = dinp + r * C + c0 + tx;
      *d = from_float<Elem>(accumulate ? to_float(*d) + acc : acc);
    }
  }
}

// dweight[e,o,c] += sum over expert e's rows r of dout[r,o] inp[r,c]; blockIdx.z the expert.
template <class Elem>
__global__ void grouped_dweight_kernel(float* dweight, const Elem* dout, const Elem* inp,
                                       const std::int32_t* offsets, int C, int OC) {
  __shared__ float g[tile][tile + 1];
  __shared__ float x[tile][tile + 1];
  const int tx = threadIdx.x % tile, ty = threadIdx.x / tile;
  const int o0 = blockIdx.y * tile, c0 = blockIdx.x * tile;
  const int e = blockIdx.z;
  const std::int64_t begin = offsets[e], end = offsets[e + 1];
  if (begin == end) return;  // the whole block; the gradient unchanged
  float acc = 0.0f;
  for (std::int64_t r0 = begin; r0 < end; r0 += tile) {
    const std::int64_t r = r0 + ty;
    g[ty][tx] = r < end && o0 + tx < OC ? to_float(dout[r * OC + o0 + tx]) : 0.0f;
    x[ty][tx] = r < end && c0 + tx < C ? to_float(inp[r * C + c0 + tx]) : 0.0f;
    __syncthreads();
#pragma unroll
    for (int i = 0; i < tile; ++i) acc += g[i][ty] * x[i][tx];
    __syncthreads();
  }
  if (o0 + ty < OC && c0 + tx < C) dweight[(std::int64_t(e) * OC + o0 + ty) * C + c0 + tx] += acc;
}

unsigned tiles(int n) {
  return unsigned((n + tile - 1) / tile);
}

}  // namespace

template <class Act>
void grouped_matmul_forward(Act* out, const Act* inp, const Act* weight, const std::int32_t* offsets, int E, int C,
                            int OC, cudaStream_t stream) {
  if (E <= 0 || OC <= 0) return;
  grouped_forward_kernel<Act><<<dim3(row_tile_blocks, tiles(OC)), tile * tile, 0, stream>>>(out, inp, weight,
                                                                                          offsets, E, C, OC);
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
}
LLMTRAIN_INSTANTIATE_ACTIVATIONS(grouped_matmul_forward)

template <class Act>
void grouped_matmul_backward(Act* dinp, float* dweight, const Act* dout, const Act* inp, const Act* weight,
                             const std::int32_t* offsets, int E, int C, int OC, bool accumulate,
                             cudaStream_t stream) {
  if (E <= 0 || OC <= 0 || C <= 0) return;
  if (dinp) {  // either part may run alone (null: skipped)
    grouped_dinp_kernel<Act><<<dim3(row_tile_blocks, tiles(C)), tile * tile, 0, stream>>>(dinp, dout, weight, offsets,
                                                                                        E, C, OC, accumulate);
    LLMTRAIN_CUDA_CHECK(cudaGetLastError());
  }
  if (dweight) {
    grouped_dweight_kernel<Act><<<dim3(tiles(C), tiles(OC), unsigned(E)), tile * tile, 0, stream>>>(
        dweight, dout, inp, offsets, C, OC);
    LLMTRAIN_CUDA_CHECK(cudaGetLastError());
  }
}
LLMTRAIN_INSTANTIATE_ACTIVATIONS(grouped_matmul_backward)

}  // namespace llmtrain::cuda
