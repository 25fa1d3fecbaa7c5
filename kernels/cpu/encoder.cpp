#include "llmtrain/kernels/cpu.h"
#include "llmtrain/kernels/vec_math.h"

namespace llmtrain::cpu {

void encoder_forward(float* out, const std::int32_t* inp, const float* wte, const float* wpe, int B, int T, int C) {
#pragma omp parallel for if (worth_threads(std::int64_t(B) * T * C))
  for (std::int64_t bt = 0; bt < std::int64_t(B) * T; ++bt) {
    const float* token_row = wte + std::int64_t(inp[bt]) * C;
    float* out_row = out + bt * C;
    if (!wpe) {
      for (int c = 0; c < C; ++c) out_row[c] = token_row[c];
      continue;
    }
    const float* position_row = wpe + (bt % T) * C;
    for (int c = 0; c < C; ++c) out_row[c] = token_row[c] + position_row[c];
  }
}

void encoder_backward(float* dwte, float* dwpe, const float* dout, const std::int32_t* inp, int B, int T, int C) {
  // Parallel over channels: each thread owns a slice of columns of dwte and dwpe, so the
  // scatter-add by token id needs no atomics and sums in row order (deterministic).
#pragma omp parallel for if (worth_threads(std::int64_t(B) * T * C * 2))
  for (int c = 0; c < C; ++c) {
    for (std::int64_t bt = 0; bt < std::int64_t(B) * T; ++bt) {
      const float g = dout[bt * C + c];
      dwte[std::int64_t(inp[bt]) * C + c] += g;
      if (dwpe) dwpe[(bt % T) * C + c] += g;
    }
  }
}

}  // namespace llmtrain::cpu
