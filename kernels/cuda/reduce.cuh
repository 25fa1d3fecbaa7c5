// Reductions shared by the kernels (device code and the launchers that use it; include from .cu
// only). Everything here is deterministic: a fixed decomposition that depends only on the
// problem size, fixed-order combination of the partial results, no atomics, so a run repeats
// bit for bit on the same GPU model. Partial sums are float in the column sums (each adds at
// most a few hundred terms) and double in sum_to_host (whole tensors, the loss and the gradient
// norm).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "cuda_check.h"
#include "launch.cuh"
#include "vector_io.cuh"

namespace llmtrain::cuda {

struct SumOp {
  template <class T>
  __device__ __forceinline__ T operator()(T a, T b) const {
    return a + b;
  }
};
struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

/// The reduction of x over the 32 lanes of a warp, returned to every lane. All 32 lanes must
/// call it (full mask). The xor butterfly gives every lane the same bits: each step combines
/// the same two values, and + and fmaxf are commutative.
template <class T, class Op>
__device__ __forceinline__ T warp_reduce(T x, Op op) {
#pragma unroll
  for (int offset = warp_size / 2; offset > 0; offset /= 2)
    x = op(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

/// The reduction of x over the block, returned to every thread. blockDim.x must be a multiple
/// of 32 (at most 1024), blockDim.y == blockDim.z == 1, and every thread must call it; it may be
/// called several times in a row (it synchronises before reusing its shared memory).
template <class T, class Op>
__device__ T block_reduce(T x, Op op, T identity) {
  __shared__ T warp_results[warp_size];
  const int lane = threadIdx.x % warp_size, warp = threadIdx.x / warp_size;
  const int warps = blockDim.x / warp_size;
  x = warp_reduce(x, op);
  __syncthreads();  // every thread is done reading the previous call's results
  if (lane == 0) warp_results[warp] = x;
  __syncthreads();
  x = lane < warps ? warp_results[lane] : identity;
  return warp_reduce(x, op);
}

// ---- column sums: out_k[c] += sum over rows i of value(i, c)[k] --------------------------------
// For weight and bias gradients (N rows, C columns, N >> C). Pass 1: blocks of 32 columns x 8
// row lanes, each block summing one slab of rows into a partial per column; pass 2: one thread
// per column adds the slab partials in slab order to the output. Coalesced: a warp reads 32
// consecutive columns of a row.

template <int K>
struct ColumnOutputs {
  float* out[K];  // (C) each
};

constexpr int column_row_lanes = 8;

template <int K, class Value>
__global__ void column_partials_kernel(float* partials /* (slabs, K, C) */, Value value, std::int64_t N,
                                       int C, std::int64_t rows_per_slab) {
  const int c = blockIdx.x * warp_size + threadIdx.x;
  const std::int64_t begin = std::int64_t(blockIdx.y) * rows_per_slab;
  const std::int64_t end = begin + rows_per_slab < N ? begin + rows_per_slab : N;
  float acc[K] = {};
  if (c < C) {
    for (std::int64_t i = begin + threadIdx.y; i < end; i += column_row_lanes) {
      float v[K];
      value(i, c, v);
#pragma unroll
      for (int k = 0; k < K; ++k) acc[k] += v[k];
    }
  }
  __shared__ float lanes[K][column_row_lanes][warp_size];
#pragma unroll
  for (int k = 0; k < K; ++k) lanes[k][threadIdx.y][threadIdx.x] = acc[k];
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      float s = 0.0f;
      for (int r = 0; r < column_row_lanes; ++r) s += lanes[k][r][threadIdx.x];
      partials[(std::int64_t(blockIdx.y) * K + k) * C + c] = s;
    }
  }
}

template <int K>
__global__ void column_finish_kernel(ColumnOutputs<K> outputs, const float* partials /* (slabs, K, C) */,
                                     int slabs, int C) {
  const std::int64_t index = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= std::int64_t(K) * C) return;
  const int k = int(index / C), c = int(index % C);
  float s = 0.0f;
  for (int slab = 0; slab < slabs; ++slab) s += partials[(std::int64_t(slab) * K + k) * C + c];
  outputs.out[k][c] += s;
}

/// outputs.out[k][c] += sum over i < N of value(i, c, v) -> v[k], for c < C. `value` is a
/// device functor `void operator()(std::int64_t i, int c, float (&v)[K]) const`.
template <int K, class Value>
void column_sums(ColumnOutputs<K> outputs, const Value& value, std::int64_t N, int C, cudaStream_t stream) {
  if (N <= 0 || C <= 0) return;
  // About 1024 blocks in all (plenty for 132 SMs), and at least 32 rows per slab so that the
  // second pass stays small. Depends only on (N, C): the same summation order on every run.
  const std::int64_t column_tiles = (C + warp_size - 1) / warp_size;
  const std::int64_t max_slabs = std::max<std::int64_t>(1, 1024 / column_tiles);
  const std::int64_t wanted_slabs = std::min<std::int64_t>((N + 31) / 32, max_slabs);
  const std::int64_t rows_per_slab = (N + wanted_slabs - 1) / wanted_slabs;
  const int slabs = int((N + rows_per_slab - 1) / rows_per_slab);
  const StreamScratch scratch(std::size_t(slabs) * K * C * sizeof(float), stream);
  float* partials = scratch.at<float>();
  column_partials_kernel<K>
      <<<dim3(unsigned(column_tiles), unsigned(slabs)), dim3(warp_size, column_row_lanes), 0, stream>>>(
          partials, value, N, C, rows_per_slab);
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
  constexpr int block = 256;
  column_finish_kernel<K><<<unsigned((std::int64_t(K) * C + block - 1) / block), block, 0, stream>>>(
      outputs, partials, slabs, C);
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
}

/// out[c] += in[c] for c < C (fp32): adds a column sum that something else wrote (a cuBLASLt
/// BGRAD epilogue overwrites its bias gradient) to an accumulated gradient.
inline void add_columns(float* out /* (C) */, const float* in /* (C) */, int C, cudaStream_t stream) {
  if (C <= 0) return;
  constexpr int block = 256;
  column_finish_kernel<1><<<unsigned((C + block - 1) / block), block, 0, stream>>>(ColumnOutputs<1>{{out}}, in, 1, C);
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
}

// ---- whole-tensor sums into a host double -------------------------------------------------------
// Pass 1: a grid fixed by N, each thread summing a grid-stride share in double (128-bit loads
// for the 16-byte-aligned body, the few elements before and after it one by one), a block
// reduction into one partial per block. Pass 2: one block adds the partials. Then the scalar is
// copied back, which waits for the stream.

constexpr int sum_block = 256;

template <class T, class Term>
__global__ void sum_partials_kernel(double* partials /* (gridDim.x) */, const T* x /* (N) */,
                                    std::int64_t head, std::int64_t chunks, std::int64_t N, Term term) {
  constexpr int V = vec_width<T>;
  const std::int64_t tid = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::int64_t stride = std::int64_t(gridDim.x) * blockDim.x;
  double acc = 0.0;
  const T* body = x + head;  // 16-byte aligned
  for (std::int64_t k = tid; k < chunks; k += stride) {
    const Chunk<T, V> chunk = load_chunk<V>(body + k * V);
#pragma unroll
    for (int e = 0; e < V; ++e) acc += term(to_float(chunk.e[e]));
  }
  const std::int64_t tail_begin = head + chunks * V;  // at most V - 1 elements on each side
  if (tid < head) acc += term(to_float(x[tid]));
  if (tid < N - tail_begin) acc += term(to_float(x[tail_begin + tid]));
  acc = block_reduce(acc, SumOp{}, 0.0);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

/// *result = the sum of the partials, or with `add`, *result += it.
template <class Acc>
__global__ void sum_finish_kernel(Acc* result /* (1) */, const Acc* partials /* (count) */, int count, bool add) {
  Acc acc = 0;
  for (int i = threadIdx.x; i < count; i += blockDim.x) acc += partials[i];
  acc = block_reduce(acc, SumOp{}, Acc(0));
  if (threadIdx.x == 0) *result = add ? *result + acc : acc;
}

/// Sum over i < N of term(x[i]) (term: device functor float -> double) added into the device
/// double *total on `stream`, without waiting for it: deterministic, as sum_to_host (whose value
/// it adds). x must be aligned to its element size.
template <class T, class Term>
void sum_into_device(double* total, const T* x, std::int64_t N, Term term, cudaStream_t stream) {
  if (N <= 0) return;
  constexpr int V = vec_width<T>;
  const std::int64_t misalignment =
      std::int64_t(reinterpret_cast<std::uintptr_t>(x) % 16) / std::int64_t(sizeof(T));
  const std::int64_t head = std::min<std::int64_t>(N, (V - misalignment) % V);
  const std::int64_t chunks = (N - head) / V;
  const int blocks = int(std::clamp<std::int64_t>((N + 4095) / 4096, 1, 1024));  // as sum_to_host
  const StreamScratch scratch(std::size_t(blocks) * sizeof(double), stream);
  double* partials = scratch.at<double>();
  sum_partials_kernel<T><<<blocks, sum_block, 0, stream>>>(partials, x, head, chunks, N, term);
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
  sum_finish_kernel<<<1, sum_block, 0, stream>>>(total, partials, blocks, true);
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
}

/// Sum over i < N of term(x[i]) (term: device functor float -> double), returned to the host;
/// synchronises `stream`. x must be aligned to its element size.
template <class T, class Term>
double sum_to_host(const T* x, std::int64_t N, Term term, cudaStream_t stream) {
  if (N <= 0) return 0.0;
  constexpr int V = vec_width<T>;
  const std::int64_t misalignment =
      std::int64_t(reinterpret_cast<std::uintptr_t>(x) % 16) / std::int64_t(sizeof(T));
  const std::int64_t head = std::min<std::int64_t>(N, (V - misalignment) % V);
  const std::int64_t chunks = (N - head) / V;
  // At least 4096 elements per block, at most 1024 blocks: fixed by N alone.
  const int blocks = int(std::clamp<std::int64_t>((N + 4095) / 4096, 1, 1024));
  const StreamScratch scratch(std::size_t(blocks + 1) * sizeof(double), stream);
  double* partials = scratch.at<double>();
  double* result = partials + blocks;
  sum_partials_kernel<T><<<blocks, sum_block, 0, stream>>>(partials, x, head, chunks, N, term);
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
  sum_finish_kernel<<<1, sum_block, 0, stream>>>(result, partials, blocks, false);
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
  double total = 0.0;
  LLMTRAIN_CUDA_CHECK(cudaMemcpyAsync(&total, result, sizeof total, cudaMemcpyDeviceToHost, stream));
  LLMTRAIN_CUDA_CHECK(cudaStreamSynchronize(stream));
  return total;
}

}  // namespace llmtrain::cuda
