// out = alpha * in, elementwise. CUDA twin: kernels/scale.h.
#pragma once

#include <cstdint>

namespace llmtrain::cpu {

/// out, in: (N,); may alias.
void scale(float* out, const float* in, float alpha, std::int64_t N);

}  // namespace llmtrain::cpu
