// Muon's ops (optim/muon.h): the momentum step and the weight update, each one pass over a
// matrix's elements (CPU references in kernels/cpu/optimizer.cpp, CUDA kernels in
// kernels/cuda/optimizer.cu); and the steps of Newton-Schulz (optim/newton_schulz.h): its
// products, batched over matrices of one shape (kernels/{cpu,cuda}/matmul.*), and the rest
// (kernels/{cpu,cuda}/newton_schulz.*). Checked and dispatched as ops.h's are.
#pragma once

#include "core/tensor.h"

namespace llmtrain::ops {

class DeviceSum;

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

/// out (B,M,N) = inp (B,M,K) weight^T for each of B matrices, weight (B,N,K); or, when not
/// `transpose_weight`, inp weight with weight (B,K,N). f32, or bf16 (fp32 accumulation, rounded
/// once); K >= 1; out may not be inp or weight. On a GPU one strided-batched cuBLASLt matmul.
void batched_matmul(const Tensor& out, const Tensor& inp, const Tensor& weight, bool transpose_weight = true);
/// Newton-Schulz's first step: x (m,n) = u (rows,cols) f32, transposed when rows > cols (m =
/// min(rows, cols), n = max), times 1 / max(sqrt(squares), eps), where `squares` holds u's sum of
/// squares (sum_squares added into it, on u's device: the host does not wait for the norm). x is
/// f32, or bf16 (rounded once).
void newton_schulz_normalise(const Tensor& x, const Tensor& u, const DeviceSum& squares, double eps);
/// out (C,N) = inp (N,C)^T; f32 or bf16, one dtype.
void transpose(const Tensor& out, const Tensor& inp);
/// out = alpha x + beta y, elementwise over tensors of one size and dtype (f32, or bf16: computed
/// in f32, rounded once). out may not overlap x or y.
void scaled_sum(const Tensor& out, const Tensor& x, const Tensor& y, float alpha, float beta);

}  // namespace llmtrain::ops
