// Tensor-core primitives for sm_80 and later, as inline PTX: the warp-wide bf16 matrix product
// mma.sync m16n8k16 (fp32 accumulation), ldmatrix (8x8 tiles of 16-bit elements from shared
// memory into fragments, optionally transposed) and 16-byte cp.async from global to shared memory.
//
// Fragment layouts (PTX ISA, "Matrix fragments for mma.m16n8k16"; g = lane / 4, t = lane % 4;
// each 32-bit register holds two bf16, the lower column (A, C) or row (B) in its low half):
//   A (16x16, row-major):  a[0] = A[g][2t..2t+1]     a[1] = A[g+8][2t..2t+1]
//                          a[2] = A[g][2t+8..2t+9]   a[3] = A[g+8][2t+8..2t+9]
//   B (16x8, k x n, "col"): b[0] = B[2t..2t+1][g]    b[1] = B[2t+8..2t+9][g]
//   C, D (16x8, fp32):      c[0..1] = C[g][2t..2t+1] c[2..3] = C[g+8][2t..2t+1]
// ldmatrix .x4: lanes 8j..8j+7 name the 8 rows (16 bytes each, 16-byte aligned, shared memory)
// of matrix j; register j of lane l receives row l/4, elements 2(l%4) and 2(l%4)+1 (.trans:
// column l/4, rows 2(l%4) and 2(l%4)+1). So a 16x16 row-major tile read as x4 with lane l naming
// row (l%16), column 8(l/16) gives exactly an A fragment; an (n x k) row-major tile (keys x head
// dimensions) read without .trans gives B fragments of its transpose, a (k x n) row-major tile
// read with .trans gives B fragments of itself.
//
// In the CPU emulator (dev/cuda_emu) the same functions are warp collectives that assemble the
// operands from all 32 lanes by these layouts; cp.async is a checked synchronous copy there.
// All functions must be called by every lane of the warp (mma, ldmatrix), with the full warp.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <cstring>

namespace llmtrain::cuda::tc {

/// Two floats as a bf16 pair (round to nearest even), `lo` in the low 16 bits.
__device__ __forceinline__ std::uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  std::uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return bits;
}

#if defined(__CUDA_ARCH__)
__device__ __forceinline__ unsigned shared_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
#endif

/// d = a b + c: one m16n8k16 bf16 product with fp32 accumulation (d may alias c).
__device__ __forceinline__ void mma_bf16(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                                         std::uint32_t b1, const float (&c)[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %11, %12, %13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
#elif defined(LLMTRAIN_CUDA_EMU)
  llmtrain_emu::MatrixLane lane;
  lane.kind = llmtrain_emu::MatrixKind::mma_m16n8k16_bf16;
  for (int i = 0; i < 4; ++i) {
    lane.a[i] = a[i];
    lane.c[i] = c[i];
  }
  lane.b[0] = b0;
  lane.b[1] = b1;
  llmtrain_emu::warp_matrix(lane);
  for (int i = 0; i < 4; ++i) d[i] = lane.d[i];
#else
  (void)d, (void)a, (void)b0, (void)b1, (void)c;
#if defined(__CUDA_ARCH__)
  __trap();  // tensor-core kernels are only launched on sm_80 and later
#endif
#endif
}

/// ldmatrix of COUNT (1, 2 or 4) 8x8 b16 matrices; `row` is this lane's row address in shared memory.
template <int COUNT, bool TRANS>
__device__ __forceinline__ void ldmatrix(std::uint32_t (&r)[COUNT], const void* row) {
  static_assert(COUNT == 1 || COUNT == 2 || COUNT == 4, "ldmatrix: x1, x2 or x4");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned address = shared_address(row);
  if constexpr (COUNT == 4 && TRANS) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
  } else if constexpr (COUNT == 4) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
  } else if constexpr (COUNT == 2 && TRANS) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(address));
  } else if constexpr (COUNT == 2) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(address));
  } else if constexpr (TRANS) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(address));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(address));
  }
#elif defined(LLMTRAIN_CUDA_EMU)
  llmtrain_emu::MatrixLane lane;
  lane.kind = llmtrain_emu::MatrixKind::ldmatrix;
  lane.count = COUNT;
  lane.trans = TRANS;
  lane.address = row;
  llmtrain_emu::warp_matrix(lane);
  for (int i = 0; i < COUNT; ++i) r[i] = lane.out[i];
#else
  (void)r, (void)row;
#if defined(__CUDA_ARCH__)
  __trap();
#endif
#endif
}

/// Starts a 16-byte copy global -> shared (both 16-byte aligned), bypassing L1 (.cg).
__device__ __forceinline__ void cp_async_16(void* shared_dst, const void* global_src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(shared_address(shared_dst)), "l"(global_src)
               : "memory");
#elif defined(LLMTRAIN_CUDA_EMU)
  llmtrain_emu::cp_async_16(shared_dst, global_src, 16);
#else
  (void)shared_dst, (void)global_src;
#endif
}

/// Closes the group of this thread's cp.async copies started since the last commit.
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

/// Waits until at most PENDING of this thread's committed groups are still in flight (then a
/// __syncthreads makes every thread's copies visible to the block).
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
#endif
}

}  // namespace llmtrain::cuda::tc
