#include "ops/cpu/scale.h"

namespace llmtrain::cpu {

void scale(float* out, const float* in, float alpha, std::int64_t N) {
  for (std::int64_t i = 0; i < N; ++i) out[i] = alpha * in[i];
}

}  // namespace llmtrain::cpu
