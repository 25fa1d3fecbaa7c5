// Elementwise scale. Memory-bound: one 128-bit load and store per thread per iteration when the
// pointers are 16-byte aligned, a scalar loop for the tail and for unaligned views.
#include "scale.h"

#include <algorithm>

#include "cuda_check.h"

namespace llmtrain::cuda {
namespace {

constexpr int block_size = 256;

__global__ void scale_vec4_kernel(float4* out, const float4* in, float alpha, std::int64_t n_vec) {
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < n_vec;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    float4 v = in[i];
    v.x *= alpha;
    v.y *= alpha;
    v.z *= alpha;
    v.w *= alpha;
    out[i] = v;
  }
}

__global__ void scale_kernel(float* out, const float* in, float alpha, std::int64_t N) {
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < N;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    out[i] = alpha * in[i];
  }
}

int grid_for(std::int64_t work) {
  // Enough blocks to fill any current GPU several times over; the loops stride past the rest.
  return static_cast<int>(std::clamp<std::int64_t>((work + block_size - 1) / block_size, 1, 65535));
}

}  // namespace

void scale(float* out, const float* in, float alpha, std::int64_t N, cudaStream_t stream) {
  if (N == 0) return;
  const bool aligned = (reinterpret_cast<std::uintptr_t>(out) | reinterpret_cast<std::uintptr_t>(in)) % 16 == 0;
  std::int64_t done = 0;
  if (aligned && N >= 4) {
    const std::int64_t n_vec = N / 4;
    scale_vec4_kernel<<<grid_for(n_vec), block_size, 0, stream>>>(
        reinterpret_cast<float4*>(out), reinterpret_cast<const float4*>(in), alpha, n_vec);
    LLMTRAIN_CUDA_CHECK(cudaGetLastError());
    done = n_vec * 4;
  }
  if (done < N) {
    scale_kernel<<<grid_for(N - done), block_size, 0, stream>>>(out + done, in + done, alpha, N - done);
    LLMTRAIN_CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace llmtrain::cuda
