// The small row-major GEMM that the CPU attention kernels (flash_attention.cpp,
// context_attention.cpp) run on their blocks of queries and keys. Internal to kernels/cpu/.
#pragma once

#include <cstdint>

namespace llmtrain::cpu {

/// C (M,N) = alpha op(A) op(B) + beta C, row-major, op = transpose when the flag is set; lda, ldb,
/// ldc are the row strides of A, B, C as stored (beta = 0: C is not read). OpenBLAS's sgemm, or
/// plain loops in a build without it.
void block_gemm(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, std::int64_t lda,
                const float* B, std::int64_t ldb, float beta, float* C, std::int64_t ldc);

}  // namespace llmtrain::cpu
