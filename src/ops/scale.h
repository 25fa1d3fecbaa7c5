// ops::scale: validated once here, then run by the CPU reference or the CUDA kernel.
#pragma once

#include "core/tensor.h"

namespace llmtrain::ops {

/// out = alpha * in. Both f32, same device, same element count; may alias.
void scale(const Tensor& out, const Tensor& in, float alpha);

}  // namespace llmtrain::ops
