// The CPU's general matrix product, row-major: every matmul of the CPU kernels (the linear layers'
// forward and backward, the attention kernels' blocks) goes through it. Internal to kernels/cpu/.
#pragma once

#include <cstdint>

namespace llmtrain::cpu {

/// C (M,N) = alpha op(A) op(B) + beta C, row-major, op = transpose when the flag is set; lda, ldb,
/// ldc are the row strides of A, B, C as stored (beta = 0: C is not read). On a CPU with AVX-512
/// a packed kernel of this file; elsewhere OpenBLAS's sgemm, or plain loops in a build without it.
/// The packed kernel's result for an element depends only on K and its inputs: not on M, N, the
/// thread count or where the rows are split, so a product split over ranks or threads gives the
/// same bits as the whole.
void gemm(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, std::int64_t lda,
          const float* B, std::int64_t ldb, float beta, float* C, std::int64_t ldc);

/// Whether gemm runs its own packed kernel on this CPU (AVX-512), rather than OpenBLAS or loops.
bool gemm_packed();

}  // namespace llmtrain::cpu
