#include "ops/scale.h"

#include "core/error.h"
#include "ops/cpu/scale.h"
#if LLMTRAIN_HAVE_CUDA
#include "ops/cuda/scale.h"
#include "ops/cuda/stream.h"
#endif

namespace llmtrain::ops {

void scale(const Tensor& out, const Tensor& in, float alpha) {
  if (out.dtype != DType::f32 || in.dtype != DType::f32 || out.device != in.device || out.numel() != in.numel()) {
    throw RuntimeError("ops::scale: expected two f32 tensors of the same size on one device, got " +
                       out.describe() + " and " + in.describe());
  }
  if (in.device == Device::cpu) {
    cpu::scale(out.as<float>(), in.as<const float>(), alpha, in.numel());
    return;
  }
#if LLMTRAIN_HAVE_CUDA
  cuda::scale(out.as<float>(), in.as<const float>(), alpha, in.numel(), cuda::compute_stream());
#else
  throw RuntimeError("ops::scale: a cuda tensor in a build without CUDA");
#endif
}

}  // namespace llmtrain::ops
