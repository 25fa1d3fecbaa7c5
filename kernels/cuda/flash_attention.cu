// Causal flash attention in the style of FlashAttention-2. Two families of kernels: bf16 on
// tensor cores for head sizes 64 and 128 (the "tensor cores" sections below: mma.sync, ldmatrix,
// cp.async from mma.cuh), used by the bf16 entry points whenever the tensors are 16-byte aligned;
// and the kernels described next, fp32 on CUDA cores, element type a
// template parameter (loads and stores convert to fp32; all arithmetic is fp32). CPU reference:
// kernels/cpu/flash_attention.cpp. Instantiated for float and for bf16 (mixed precision: bf16
// qkv, out, dout, dqkv; fp32 lse, D and shared-memory tiles, so the same kernels, tiles and
// shared memory; each bf16 output element is rounded once, dqkv after its fp32 += ).
//
// Forward: a block owns BR query rows of one (b, h) and streams the key/value tiles 0..causal
// limit through shared memory, keeping a running max and sum per row (online softmax, in log2
// units so that exp2f does the work); it writes out and lse = max + log(sum) (natural log).
// Backward, three kernels, no atomics, deterministic (the tensor-core backward's non-default
// single pass, chosen by set_flash_attention_deterministic(false), is described in its section):
//   1. D = rowsum(dout * out) per (b, h, t), into a stream-ordered scratch;
//   2. dK, dV: a block owns a key tile of one (b, kv head) and loops over the query heads of the
//      group and over the query tiles at or after it, recomputing P = exp(S - lse) and
//      dS = P (dP - D); the group's sum stays in registers, in a fixed order;
//   3. dQ: a block owns a query tile of one (b, h) and loops over the key tiles up to the diagonal.
// Every kernel runs 256 threads as a 16 x 16 grid (tx = threadIdx.x % 16 is the lane within a
// half-warp). A thread owns the rows ty + 16 i of the block's own tile and, of a product with
// the streamed tile, the columns tx + 16 j (scores) or the head dimensions tx + 16 j
// (accumulators). The 16 threads of a row are one half-warp, so row max and sum are 4 shuffles.
// Shared memory rows are padded by 4 floats: the float4 reads of the streamed tile (16 lanes, row
// stride HS + 4) then hit distinct banks in each quarter-warp, and rows stay 16-byte aligned.
//
// Files: this one holds the entry points, the shape checks, the dispatch on head size and
// precision, and the backward's first step (D); flash_attention_tiles.cuh what the kernels share;
// flash_attention_simt.cu the CUDA-core kernels; flash_attention_tc_forward.cu and
// flash_attention_tc_backward.cu the tensor-core ones (as FlashAttention keeps one file per family).
#include "llmtrain/kernels/flash_attention.h"

#include <atomic>
#include <cstdint>
#include <string>
#include <type_traits>

#include "llmtrain/kernels/error.h"
#include "flash_attention_tiles.cuh"
#include "instantiate.cuh"

namespace llmtrain::cuda {
namespace flash {
namespace {

// set_flash_attention_deterministic: false selects the single-pass tensor-core backward.
std::atomic<bool> deterministic_backward{true};

// ---- backward --------------------------------------------------------------------------------

// D (B,NH,T) = rowsum(dout * out): one warp per (b, t, h) row of HS elements, rows in the
// memory order of dout (B,T,NH,HS).
template <class scalar_t, int HS>
__global__ void flash_backward_dot_kernel(float* D, const scalar_t* dout, const scalar_t* out, std::int64_t rows,
                                          int T, int NH) {
  const std::int64_t row = (std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;  // whole warps only: row is uniform across a warp
  float sum = 0.0f;
  for (int d = lane; d < HS; d += 32) {
    sum += Element<scalar_t>::load(dout[row * HS + d]) * Element<scalar_t>::load(out[row * HS + d]);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (lane == 0) {
    const int h = int(row % NH);
    const std::int64_t bt = row / NH;
    D[(bt / T * NH + h) * T + bt % T] = sum;
  }
}

template <class scalar_t, int HS>
void backward_launch(scalar_t* dqkv, const scalar_t* dout, const scalar_t* qkv, const scalar_t* out,
                     const float* lse, int B, int T, int NH, int NKV, cudaStream_t stream) {
  const float scale = 1.0f / sqrtf(float(HS)), score_scale = kLog2e * scale;
  const std::int64_t rows = std::int64_t(B) * T * NH;
  constexpr bool has_tc = std::is_same_v<scalar_t, bf16> && (HS == 64 || HS == 128);
  const bool tensor_cores =
      has_tc && flash_attention_uses_tensor_cores(HS, qkv, out) && aligned16(dout) && aligned16(dqkv);
  const bool single_pass = tensor_cores && !flash_attention_deterministic();
  // D (B,NH,T); for the single pass then the dQ accumulator (B,T,NH HS).
  const std::size_t d_bytes = std::size_t(rows) * sizeof(float);
  const std::size_t dq_bytes = single_pass ? std::size_t(rows) * HS * sizeof(float) : 0;
  const StreamScratch scratch(single_pass ? round_up_256(d_bytes) + dq_bytes : d_bytes, stream);
  float* D = scratch.at<float>();

  constexpr int dot_block = 256;  // 8 warps, one row each
  const unsigned dot_blocks = unsigned((rows * warp_size + dot_block - 1) / dot_block);
  flash_backward_dot_kernel<scalar_t, HS><<<dot_blocks, dot_block, 0, stream>>>(D, dout, out, rows, T, NH);
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());

  if constexpr (has_tc) {
    if (tensor_cores) {
      float* dq_accum = single_pass ? scratch.at<float>(round_up_256(d_bytes)) : nullptr;
      return backward_tc_launch<HS>(dqkv, dq_accum, dout, qkv, lse, D, B, T, NH, NKV, score_scale, scale, stream);
    }
  }
  backward_simt_launch<scalar_t, HS>(dqkv, dout, qkv, lse, D, B, T, NH, NKV, score_scale, scale, stream);
}

// Shapes the kernels assume; the ops layer checks tensor shapes, this checks what it cannot.
void check_shape(const char* op, int B, int T, int C, int NH, int NKV) {
  if (B < 0 || T < 0 || NH <= 0 || NKV <= 0 || C % NH != 0 || NH % NKV != 0) {
    throw kernels::Error(std::string("cuda::") + op + ": NH must divide C and NKV must divide NH");
  }
  const int HS = C / NH;
  if (HS != 16 && HS != 32 && HS != 64 && HS != 128) {
    throw kernels::Error(std::string("cuda::") + op + ": head size " + std::to_string(HS) +
                       " is not supported (16, 32, 64 or 128)");
  }
  if (NH > 65535 || B > 65535) {
    throw kernels::Error(std::string("cuda::") + op + ": B and NH must be at most 65535 (grid dimensions)");
  }
}

template <class scalar_t>
void forward_dispatch(scalar_t* out, float* lse, const scalar_t* qkv, int B, int T, int C, int NH, int NKV,
                      cudaStream_t stream) {
  check_shape("flash_attention_forward", B, T, C, NH, NKV);
  if (B == 0 || T == 0) return;
  if constexpr (std::is_same_v<scalar_t, bf16>) {
    if (flash_attention_uses_tensor_cores(C / NH, qkv, out)) {
      if (C / NH == 64) return forward_tc_launch<64>(out, lse, qkv, B, T, NH, NKV, stream);
      return forward_tc_launch<128>(out, lse, qkv, B, T, NH, NKV, stream);
    }
  }
  switch (C / NH) {
    case 16: return forward_launch<scalar_t, 16>(out, lse, qkv, B, T, NH, NKV, stream);
    case 32: return forward_launch<scalar_t, 32>(out, lse, qkv, B, T, NH, NKV, stream);
    case 64: return forward_launch<scalar_t, 64>(out, lse, qkv, B, T, NH, NKV, stream);
    default: return forward_launch<scalar_t, 128>(out, lse, qkv, B, T, NH, NKV, stream);
  }
}

template <class scalar_t>
void backward_dispatch(scalar_t* dqkv, const scalar_t* dout, const scalar_t* qkv, const scalar_t* out,
                       const float* lse, int B, int T, int C, int NH, int NKV, bool accumulate,
                       cudaStream_t stream) {
  check_shape("flash_attention_backward", B, T, C, NH, NKV);
  if (B == 0 || T == 0) return;
  // The kernels add into dqkv; as its first writer they add into zeros.
  if (!accumulate) {
    const std::size_t n = std::size_t(B) * std::size_t(T) * std::size_t(NH + 2 * NKV) * std::size_t(C / NH);
    LLMTRAIN_CUDA_CHECK(cudaMemsetAsync(dqkv, 0, n * sizeof(scalar_t), stream));
  }
  switch (C / NH) {
    case 16: return backward_launch<scalar_t, 16>(dqkv, dout, qkv, out, lse, B, T, NH, NKV, stream);
    case 32: return backward_launch<scalar_t, 32>(dqkv, dout, qkv, out, lse, B, T, NH, NKV, stream);
    case 64: return backward_launch<scalar_t, 64>(dqkv, dout, qkv, out, lse, B, T, NH, NKV, stream);
    default: return backward_launch<scalar_t, 128>(dqkv, dout, qkv, out, lse, B, T, NH, NKV, stream);
  }
}

}  // namespace
}  // namespace flash

void set_flash_attention_deterministic(bool deterministic) {
  flash::deterministic_backward.store(deterministic, std::memory_order_relaxed);
}

bool flash_attention_deterministic() { return flash::deterministic_backward.load(std::memory_order_relaxed); }

bool flash_attention_uses_tensor_cores(int head_size, const void* qkv, const void* out) {
  return (head_size == 64 || head_size == 128) && flash::aligned16(qkv) && flash::aligned16(out);
}

template <class Act>
void flash_attention_forward(Act* out, float* lse, const Act* qkv, int B, int T, int C, int NH, int NKV,
                             cudaStream_t stream) {
  flash::forward_dispatch(out, lse, qkv, B, T, C, NH, NKV, stream);
}
LLMTRAIN_INSTANTIATE_ACTIVATIONS(flash_attention_forward)

template <class Act>
void flash_attention_backward(Act* dqkv, const Act* dout, const Act* qkv, const Act* out, const float* lse, int B,
                              int T, int C, int NH, int NKV, bool accumulate, cudaStream_t stream) {
  flash::backward_dispatch(dqkv, dout, qkv, out, lse, B, T, C, NH, NKV, accumulate, stream);
}
LLMTRAIN_INSTANTIATE_ACTIVATIONS(flash_attention_backward)

}  // namespace llmtrain::cuda