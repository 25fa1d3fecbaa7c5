// Matmuls through OpenBLAS's sgemm (row-major). Weights are (OC, C), as torch.nn.Linear's.
#include <cblas.h>

#include "ops/cpu/nn.h"

namespace llmtrain::cpu {

void matmul_forward(float* out, const float* inp, const float* weight, const float* bias, std::int64_t N, int C,
                    int OC) {
  if (bias) {
#pragma omp parallel for
    for (std::int64_t i = 0; i < N; ++i) {
      for (int o = 0; o < OC; ++o) out[i * OC + o] = bias[o];
    }
  }
  // out (N,OC) = inp (N,C) x weight^T (C,OC) [+ out]
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(N), OC, C, 1.0f, inp, C, weight, C, bias ? 1.0f : 0.0f,
              out, OC);
}

void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, std::int64_t N, int C, int OC) {
  // dinp (N,C) += dout (N,OC) x weight (OC,C)
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(N), C, OC, 1.0f, dout, OC, weight, C, 1.0f, dinp, C);
  // dweight (OC,C) += dout^T (OC,N) x inp (N,C)
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, OC, C, int(N), 1.0f, dout, OC, inp, C, 1.0f, dweight, C);
  if (dbias) {
#pragma omp parallel for
    for (int o = 0; o < OC; ++o) {
      float sum = 0.0f;
      for (std::int64_t i = 0; i < N; ++i) sum += dout[i * OC + o];
      dbias[o] += sum;
    }
  }
}

}  // namespace llmtrain::cpu
