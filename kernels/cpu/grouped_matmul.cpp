// The grouped GEMM of the Mixture-of-Experts layers: one call over every expert's rows, each
// expert's weight read from one (E, OC, C) tensor; rows are in expert order (moe_dispatch's
// offsets), each expert's block an ordinary matmul (OpenBLAS sgemm through matmul.cpp).
#include "llmtrain/kernels/cpu.h"

namespace llmtrain::cpu {

void grouped_matmul_forward(float* out, const float* inp, const float* weight, const std::int32_t* offsets, int E,
                            int C, int OC) {
  for (int e = 0; e < E; ++e) {
    const std::int64_t begin = offsets[e], rows = offsets[e + 1] - offsets[e];
    if (rows == 0) continue;
    matmul_forward(out + begin * OC, inp + begin * C, weight + std::int64_t(e) * OC * C, nullptr, rows, C, OC, OC);
  }
}

void grouped_matmul_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                             const std::int32_t* offsets, int E, int C, int OC, bool accumulate) {
  for (int e = 0; e < E; ++e) {
    const std::int64_t begin = offsets[e], rows = offsets[e + 1] - offsets[e];
    if (rows == 0) continue;
    // Either part alone: a null dinp or dweight skips it (matmul_backward's contract).
    matmul_backward(dinp ? dinp + begin * C : nullptr, dweight ? dweight + std::int64_t(e) * OC * C : nullptr, nullptr,
                    dout + begin * OC, inp + begin * C, weight + std::int64_t(e) * OC * C, rows, C, OC, OC, accumulate);
  }
}

}  // namespace llmtrain::cpu
