// SwiGLU (Llama's MLP activation), an elementwise op of elementwise.def: out = silu(gate) * up,
// silu(x) = x / (1 + e^-x), with exp_vec so that the loops vectorise.
#include "llmtrain/kernels/cpu.h"
#include "llmtrain/kernels/vec_math.h"

namespace llmtrain::cpu {

void swiglu_forward(float* out, const float* gate, const float* up, std::int64_t N) {
#pragma omp parallel for simd if (worth_threads(N * 14))
  for (std::int64_t i = 0; i < N; ++i) out[i] = gate[i] / (1.0f + exp_vec(-gate[i])) * up[i];
}

void swiglu_backward(float* dgate, float* dup, const float* dout, const float* gate, const float* up, std::int64_t N) {
#pragma omp parallel for simd if (worth_threads(N * 18))
  for (std::int64_t i = 0; i < N; ++i) {
    const float s = 1.0f / (1.0f + exp_vec(-gate[i]));
    const float silu = gate[i] * s;
    dgate[i] += dout[i] * up[i] * s * (1.0f + gate[i] * (1.0f - s));
    dup[i] += dout[i] * silu;
  }
}

}  // namespace llmtrain::cpu
