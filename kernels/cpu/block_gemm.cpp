#include "block_gemm.h"

#if LLMTRAIN_HAVE_OPENBLAS
#include <cblas.h>
#endif

namespace llmtrain::cpu {

void block_gemm(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, std::int64_t lda,
                const float* B, std::int64_t ldb, float beta, float* C, std::int64_t ldc) {
#if LLMTRAIN_HAVE_OPENBLAS
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, M, N, K, alpha,
              A, int(lda), B, int(ldb), beta, C, int(ldc));
#else
  for (int m = 0; m < M; ++m) {
    float* c = C + m * ldc;
    for (int n = 0; n < N; ++n) c[n] = beta == 0.0f ? 0.0f : beta * c[n];
    for (int k = 0; k < K; ++k) {
      const float a = alpha * (trans_a ? A[k * lda + m] : A[m * lda + k]);
      if (trans_b) {
        for (int n = 0; n < N; ++n) c[n] += a * B[n * ldb + k];
      } else {
        const float* b = B + k * ldb;
#pragma omp simd
        for (int n = 0; n < N; ++n) c[n] += a * b[n];
      }
    }
  }
#endif
}

}  // namespace llmtrain::cpu
