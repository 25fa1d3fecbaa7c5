// Muon's elementwise ops (optim/muon.h): the momentum step and the weight update, each one pass
// over a matrix's elements. Checked and dispatched as ops.h's are (CPU references in
// kernels/cpu/optimizer.cpp, CUDA kernels in kernels/cuda/optimizer.cu).
#pragma once

#include "core/tensor.h"

namespace llmtrain::ops {

/// Muon's momentum step (torch.optim.Muon's) on buf, grad, u (N,) f32 in one pass: with g = grad
/// x grad_scale, buf <- buf + (1 - momentum)(g - buf), then u = g + momentum (buf - g) with
/// `nesterov`, else u = buf.
void muon_momentum(const Tensor& buf, const Tensor& grad, const Tensor& u, float momentum, bool nesterov,
                   float grad_scale);
/// Muon's weight update on param, o (N,) f32: param <- param x keep - step x o (keep = 1 - lr wd,
/// step = the matrix's adjusted learning rate). `working` (N,) bf16, when it has data, receives
/// the updated weights rounded to bf16 (to nearest even, as convert), in the same pass (on the
/// CPU it may also be f32, as a bf16 run's reference holds it: the updated weights as they are).
void muon_apply(const Tensor& param, const Tensor& o, const Tensor& working, float keep, float step);

}  // namespace llmtrain::ops
