// The launcher of the elementwise kernels (GELU, residual, SwiGLU, AdamW). An op is a small
// struct of pointers with `template <int W> __device__ void apply(std::int64_t i) const`, which
// handles elements [i, i + W). The launcher runs it with W = one 128-bit access of T over the
// largest multiple of W when every pointer is 16-byte aligned, then with W = 1 over the rest
// (the tail, or everything for unaligned views). Grid-stride loops, 64-bit indices.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_check.h"
#include "launch.cuh"
#include "vector_io.cuh"

namespace llmtrain::cuda {

template <int W, class Op>
__global__ void elementwise_kernel(Op op, std::int64_t begin, std::int64_t chunks) {
  const std::int64_t stride = std::int64_t(gridDim.x) * blockDim.x;
  for (std::int64_t k = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; k < chunks; k += stride) {
    op.template apply<W>(begin + k * W);
  }
}

/// Runs `op` over elements [0, N) of storage type T on `stream`; `aligned`: every pointer of
/// the op is 16-byte aligned (see aligned16()).
template <class T, class Op>
void launch_elementwise(const Op& op, std::int64_t N, bool aligned, cudaStream_t stream) {
  constexpr int block = 256;
  constexpr int V = vec_width<T>;
  std::int64_t done = 0;
  if (aligned && N >= V) {
    const std::int64_t chunks = N / V;
    elementwise_kernel<V><<<grid_for(chunks, block), block, 0, stream>>>(op, 0, chunks);
    LLMTRAIN_CUDA_CHECK(cudaGetLastError());
    done = chunks * V;
  }
  if (done < N) {
    elementwise_kernel<1><<<grid_for(N - done, block), block, 0, stream>>>(op, done, N - done);
    LLMTRAIN_CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace llmtrain::cuda
