// out = alpha * in, elementwise (gradient clipping, loss scaling). CPU twin: src/ops/cpu/scale.h.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace llmtrain::cuda {

/// out, in: (N,) fp32 in device memory; may alias.
void scale(float* out, const float* in, float alpha, std::int64_t N, cudaStream_t stream);

}  // namespace llmtrain::cuda
