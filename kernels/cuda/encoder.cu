// Token + position embeddings.
//  - Forward: one thread per W channels of a row (128-bit when C % 4 == 0 and aligned). wpe may
//    be null (Llama: no position table), and then dwpe too.
//  - Backward, dwpe: one thread per (t, W channels) adds the B rows of that position in batch
//    order: no atomics, and the same additions in the same order as the CPU loop.
//  - Backward, dwte, a scatter-add by token id. Float atomics would make the result depend on
//    thread timing, so: the (token, row) pairs are sorted by token with CUB's radix sort, which
//    is stable, so each token's rows stay in increasing order; then one block per run of equal
//    tokens (blocks that do not start a run exit at once) and per chunk of channels walks the
//    run, starting from the old dwte value and adding row by row: every (token, channel) has one
//    owner, and the sums are bit-identical to the CPU reference's. Cost: a sort of B*T keys
//    (tens of microseconds) and the walk; the walk is serial in the length of a run, so a batch
//    dominated by one token (padding) is slower, never wrong.
//  - bf16 (mixed precision): bf16 tables and dout, fp32 dwte and dwpe; the kernels take the
//    gradient's and the activations' types apart, and move 8 channels per thread (one 128-bit
//    access of bf16, two of the fp32 gradient).
#include <cub/device/device_radix_sort.cuh>

#include "cuda_check.h"
#include "instantiate.cuh"
#include "launch.cuh"
#include "llmtrain/kernels/cuda.h"
#include "vector_io.cuh"

namespace llmtrain::cuda {
namespace {

template <class Elem, int W>
__global__ void encoder_forward_kernel(Elem* out /* (B*T,C) */, const std::int32_t* inp /* (B*T) */,
                                       const Elem* wte /* (V,C) */, const Elem* wpe /* (maxT,C) or null */,
                                       std::int64_t BT, int T, int C) {
  const int chunks_per_row = C / W;
  const std::int64_t total = BT * chunks_per_row;
  const std::int64_t stride = std::int64_t(gridDim.x) * blockDim.x;
  for (std::int64_t idx = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < total; idx += stride) {
    const std::int64_t bt = idx / chunks_per_row;
    const int c = int(idx % chunks_per_row) * W;
    Chunk<Elem, W> r = load_chunk<W>(wte + std::int64_t(inp[bt]) * C + c);
    if (wpe) {  // the same for every thread
      const Chunk<Elem, W> position = load_chunk<W>(wpe + (bt % T) * C + c);
#pragma unroll
      for (int k = 0; k < W; ++k) r.e[k] = from_float<Elem>(to_float(r.e[k]) + to_float(position.e[k]));
    }
    store_chunk<W>(out + bt * C + c, r);
  }
}

// Grad: the gradient's storage type (float); Elem: dout's (float or bf16).
template <class Grad, class Elem, int W>
__global__ void encoder_dwpe_kernel(Grad* dwpe /* (maxT,C) */, const Elem* dout /* (B,T,C) */, int B, int T,
                                    int C) {
  const int chunks_per_row = C / W;
  const std::int64_t total = std::int64_t(T) * chunks_per_row;
  const std::int64_t stride = std::int64_t(gridDim.x) * blockDim.x;
  for (std::int64_t idx = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < total; idx += stride) {
    const std::int64_t t = idx / chunks_per_row;
    const int c = int(idx % chunks_per_row) * W;
    float acc[W];
    load_floats<W>(dwpe + t * C + c, acc);
    for (int b = 0; b < B; ++b) {
      float g[W];
      load_floats<W>(dout + (std::int64_t(b) * T + t) * C + c, g);
#pragma unroll
      for (int k = 0; k < W; ++k) acc[k] += g[k];
    }
    store_floats<W>(dwpe + t * C + c, acc);
  }
}

__global__ void iota_kernel(std::int32_t* out /* (n) */, int n) {
  const std::int64_t stride = std::int64_t(gridDim.x) * blockDim.x;
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    out[i] = std::int32_t(i);
  }
}

// grid (BT, channel chunks): block x = one position of the sorted order, which works only if
// it starts a run of equal tokens.
template <class Grad, class Elem, int W>
__global__ void encoder_dwte_kernel(Grad* dwte /* (V,C) */, const Elem* dout /* (B*T,C) */,
                                    const std::int32_t* tokens /* (BT) sorted */,
                                    const std::int32_t* rows /* (BT) row of each sorted token */, int BT,
                                    int C) {
  const int first = blockIdx.x;
  const std::int32_t token = tokens[first];
  if (first > 0 && tokens[first - 1] == token) return;  // not the start of a run
  const int c = (blockIdx.y * blockDim.x + threadIdx.x) * W;
  if (c >= C) return;
  Grad* target = dwte + std::int64_t(token) * C + c;
  float acc[W];
  load_floats<W>(target, acc);
#pragma unroll 4
  for (int j = first; j < BT && tokens[j] == token; ++j) {
    float g[W];
    load_floats<W>(dout + std::int64_t(rows[j]) * C + c, g);
#pragma unroll
    for (int k = 0; k < W; ++k) acc[k] += g[k];
  }
  store_floats<W>(target, acc);
}

template <class Grad, class Elem, int W>
void encoder_backward_launch(Grad* dwte, Grad* dwpe, const Elem* dout, const std::int32_t* inp, int B, int T,
                             int C, cudaStream_t stream) {
  constexpr int block = 256;
  const int BT = B * T;
  const int chunks_per_row = C / W;
  if (dwpe) {
    encoder_dwpe_kernel<Grad, Elem, W>
        <<<grid_for(std::int64_t(T) * chunks_per_row, block), block, 0, stream>>>(dwpe, dout, B, T, C);
    LLMTRAIN_CUDA_CHECK(cudaGetLastError());
  }

  // Sort (token, row) pairs by token: keys_out, rows_in, rows_out and CUB's temporary storage in
  // one scratch allocation.
  std::size_t sort_bytes = 0;
  LLMTRAIN_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      nullptr, sort_bytes, inp, static_cast<std::int32_t*>(nullptr),
      static_cast<const std::int32_t*>(nullptr), static_cast<std::int32_t*>(nullptr), BT, 0,
      int(sizeof(std::int32_t) * 8), stream));
  const std::size_t array_bytes = round_up_256(std::size_t(BT) * sizeof(std::int32_t));
  const StreamScratch scratch(3 * array_bytes + sort_bytes, stream);
  auto* tokens = scratch.at<std::int32_t>(0);
  auto* rows_in = scratch.at<std::int32_t>(array_bytes);
  auto* rows = scratch.at<std::int32_t>(2 * array_bytes);
  void* sort_temp = scratch.at<char>(3 * array_bytes);
  iota_kernel<<<grid_for(BT, block), block, 0, stream>>>(rows_in, BT);
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
  LLMTRAIN_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(sort_temp, sort_bytes, inp, tokens, rows_in, rows, BT,
                                                      0, int(sizeof(std::int32_t) * 8), stream));

  // Threads per block: the row's chunks rounded up to a warp, at most 256; the rest in grid y.
  const int threads =
      int(std::min<std::int64_t>(block, (chunks_per_row + warp_size - 1) / warp_size * warp_size));
  const unsigned channel_blocks = unsigned((chunks_per_row + threads - 1) / threads);
  encoder_dwte_kernel<Grad, Elem, W>
      <<<dim3(unsigned(BT), channel_blocks), threads, 0, stream>>>(dwte, dout, tokens, rows, BT, C);
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
}

template <class Elem>
void encoder_forward_dispatch(Elem* out, const std::int32_t* inp, const Elem* wte, const Elem* wpe, int B,
                              int T, int C, cudaStream_t stream) {
  const std::int64_t BT = std::int64_t(B) * T;
  if (BT == 0 || C == 0) return;
  constexpr int block = 256;
  constexpr int V = vec_width<Elem>;
  if (C % V == 0 && aligned16({out, wte, wpe})) {
    encoder_forward_kernel<Elem, V>
        <<<grid_for(BT * (C / V), block), block, 0, stream>>>(out, inp, wte, wpe, BT, T, C);
  } else {
    encoder_forward_kernel<Elem, 1>
        <<<grid_for(BT * C, block), block, 0, stream>>>(out, inp, wte, wpe, BT, T, C);
  }
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
}

// The vector width follows dout's type: 4 channels per thread in fp32, 8 in bf16.
template <class Grad, class Elem>
void encoder_backward_dispatch(Grad* dwte, Grad* dwpe, const Elem* dout, const std::int32_t* inp, int B,
                               int T, int C, cudaStream_t stream) {
  if (std::int64_t(B) * T == 0 || C == 0) return;
  if (std::int64_t(B) * T > INT32_MAX)
    throw kernels::Error("cuda::encoder_backward: B * T must fit in 32 bits");
  constexpr int V = vec_width<Elem>;
  if (C % V == 0 && aligned16({dwte, dwpe, dout})) {
    encoder_backward_launch<Grad, Elem, V>(dwte, dwpe, dout, inp, B, T, C, stream);
  } else {
    encoder_backward_launch<Grad, Elem, 1>(dwte, dwpe, dout, inp, B, T, C, stream);
  }
}

}  // namespace

template <class Act>
void encoder_forward(Act* out, const std::int32_t* inp, const Act* wte, const Act* wpe, int B, int T, int C,
                     cudaStream_t stream) {
  encoder_forward_dispatch(out, inp, wte, wpe, B, T, C, stream);
}
LLMTRAIN_INSTANTIATE_ACTIVATIONS(encoder_forward)

template <class Act>
void encoder_backward(float* dwte, float* dwpe, const Act* dout, const std::int32_t* inp, int B, int T, int C,
                      cudaStream_t stream) {
  encoder_backward_dispatch(dwte, dwpe, dout, inp, B, T, C, stream);
}
LLMTRAIN_INSTANTIATE_ACTIVATIONS(encoder_backward)

}  // namespace llmtrain::cuda
