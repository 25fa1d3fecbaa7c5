// Newton-Schulz's steps besides its matmuls (cuda.h; the CPU twins in kernels/cpu/newton_schulz.cpp).
//  - The transpose (and the normalisation of a tall matrix, which is transposed on the way) goes
//    through a 32 x 32 tile in shared memory, so that both the reads and the writes are
//    coalesced; the tile's rows are padded by one element, so that reading a column hits 32
//    different banks.
//  - The normalisation reads the sum of squares from device memory (sum_squares added it there),
//    so the host never waits for the norm; every thread computes 1 / max(sqrt(s), eps) in double,
//    as the CPU does, and so scales by the same float.
//  - The scaled sums are elementwise (elementwise_launch.cuh), in fp32, rounded once.
#include <cmath>
#include <string>

#include "cuda_check.h"
#include "elementwise_launch.cuh"
#include "instantiate.cuh"
#include "launch.cuh"
#include "llmtrain/kernels/cuda.h"
#include "llmtrain/kernels/error.h"
#include "vector_io.cuh"

namespace llmtrain::cuda {
namespace {

constexpr int tile = 32;      // a tile is tile x tile elements, one column of it per lane
constexpr int tile_rows = 8;  // rows of threads per block: each thread moves tile / tile_rows elements

__device__ __forceinline__ float inverse_norm(const double* squares, double eps) {
  return squares ? float(1.0 / fmax(sqrt(*squares), eps)) : 1.0f;
}

// out (C,N) = inp (N,C)^T, times 1 / max(sqrt(*squares), eps) when squares is not null.
template <class Out, class In>
__global__ void __launch_bounds__(tile* tile_rows)
    transpose_kernel(Out* out, const In* inp, std::int64_t N, std::int64_t C, const double* squares, double eps) {
  __shared__ float block[tile * (tile + 1)];
  const float scale = inverse_norm(squares, eps);
  const std::int64_t row0 = std::int64_t(blockIdx.y) * tile, col0 = std::int64_t(blockIdx.x) * tile;
  for (int k = threadIdx.y; k < tile; k += tile_rows) {  // inp's rows row0 + k, a lane per column
    const std::int64_t r = row0 + k, c = col0 + threadIdx.x;
    if (r < N && c < C) block[k * (tile + 1) + threadIdx.x] = to_float(inp[r * C + c]);
  }
  __syncthreads();
  for (int k = threadIdx.y; k < tile; k += tile_rows) {  // out's rows col0 + k, a lane per column
    const std::int64_t c = col0 + k, r = row0 + threadIdx.x;
    if (c < C && r < N) out[c * N + r] = from_float<Out>(block[threadIdx.x * (tile + 1) + k] * scale);
  }
}

template <class Out, class In>
void launch_transpose(Out* out, const In* inp, std::int64_t N, std::int64_t C, const double* squares, double eps,
                      cudaStream_t stream) {
  if (N <= 0 || C <= 0) return;
  const std::int64_t row_tiles = (N + tile - 1) / tile, col_tiles = (C + tile - 1) / tile;
  if (row_tiles > 65535 || col_tiles > INT32_MAX) {
    throw kernels::Error("cuda::transpose: (" + std::to_string(N) + ", " + std::to_string(C) +
                         ") has over 65535 tiles of 32 rows");
  }
  transpose_kernel<<<dim3(unsigned(col_tiles), unsigned(row_tiles)), dim3(tile, tile_rows), 0, stream>>>(
      out, inp, N, C, squares, eps);
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
}

// x = u / max(sqrt(*squares), eps), elementwise (a wide matrix keeps its orientation).
template <class Act>
struct Normalise {
  Act* x;                 // (N)
  const float* u;         // (N)
  const double* squares;  // (1)
  double eps;
  template <int W>
  __device__ void apply(std::int64_t i) const {
    const float scale = inverse_norm(squares, eps);
    float v[W];
    load_floats<W>(u + i, v);
#pragma unroll
    for (int k = 0; k < W; ++k) v[k] *= scale;
    store_floats<W>(x + i, v);
  }
};

template <class Act>
struct ScaledSum {
  Act* out;       // (N)
  const Act* x;   // (N)
  const Act* y;   // (N)
  float alpha, beta;
  template <int W>
  __device__ void apply(std::int64_t i) const {
    float a[W], b[W];
    load_floats<W>(x + i, a);
    load_floats<W>(y + i, b);
#pragma unroll
    for (int k = 0; k < W; ++k) a[k] = alpha * a[k] + beta * b[k];
    store_floats<W>(out + i, a);
  }
};

}  // namespace

template <class Act>
void newton_schulz_normalise(Act* x, const float* u, const double* squares, std::int64_t rows, std::int64_t cols,
                             double eps, cudaStream_t stream) {
  if (rows > cols) return launch_transpose(x, u, rows, cols, squares, eps, stream);
  // The launcher's width is Act's (8 bf16 or 4 f32 per 128-bit access): f32 u takes two for bf16.
  launch_elementwise<Act>(Normalise<Act>{x, u, squares, eps}, rows * cols, aligned16({x, u}), stream);
}
LLMTRAIN_INSTANTIATE_ACTIVATIONS(newton_schulz_normalise)

template <class Act>
void transpose(Act* out, const Act* inp, std::int64_t N, std::int64_t C, cudaStream_t stream) {
  launch_transpose(out, inp, N, C, nullptr, 0.0, stream);
}
LLMTRAIN_INSTANTIATE_ACTIVATIONS(transpose)

template <class Act>
void scaled_sum(Act* out, const Act* x, const Act* y, std::int64_t N, float alpha, float beta, cudaStream_t stream) {
  launch_elementwise<Act>(ScaledSum<Act>{out, x, y, alpha, beta}, N, aligned16({out, x, y}), stream);
}
LLMTRAIN_INSTANTIATE_ACTIVATIONS(scaled_sum)

}  // namespace llmtrain::cuda
