// The Mixture-of-Experts ops (docs/moe.md): the router, the dispatch plan and the permutation of
// token slots into expert order and back, the grouped GEMM over all experts, and the expert bias's
// balancing step. Checked and dispatched as ops.h's are (CPU references in kernels/cpu/moe.cpp and
// grouped_matmul.cpp; CUDA kernels in kernels/cuda/moe.cu and grouped_matmul.cu). E experts, k per token, N tokens, N k slots.
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "ops/ops.h"

namespace llmtrain::ops {

/// The router's flags.
struct RouterKind {
  bool sigmoid = false;    // DeepSeek-V3's sigmoid scores, else a softmax over the experts
  bool normalize = true;   // the k weights renormalised to sum 1 (always with sigmoid)
  float route_scale = 1.0f;
};

/// probs (N,E) f32, experts (N,k) i32, weights (N,k) f32, counts (E) f32, pbar (E) f32 (each
/// expert's mean probability), losses (3) f32 {aux, z, load imbalance} from logits (N,E); bias (E)
/// in the activations' dtype, or no data for none (cpu::moe_router_forward).
void moe_router_forward(const Tensor& probs, const Tensor& experts, const Tensor& weights, const Tensor& counts,
                        const Tensor& pbar, const Tensor& losses, const Tensor& logits, const Tensor& bias, const RouterKind& kind);
/// dlogits (N,E) WRITTEN from dweights (N,k) f32, aux_scale x d aux and z_scale x d z.
void moe_router_backward(const Tensor& dlogits, const Tensor& dweights, const Tensor& logits, const Tensor& probs,
                         const Tensor& experts, const Tensor& counts, const RouterKind& kind, float aux_scale,
                         float z_scale);
/// offsets (E+1), row_slot (N k), slot_row (N k) i32 and dropped (1) f32 from experts (N,k);
/// capacity 0: dropless.
void moe_dispatch(const Tensor& offsets, const Tensor& row_slot, const Tensor& slot_row, const Tensor& dropped,
                  const Tensor& experts, std::int64_t capacity);
/// xp (N k, C): the first offsets[E] rows, each its slot's token row of x (N,C).
void moe_permute_forward(const Tensor& xp, const Tensor& x, const Tensor& row_slot, const Tensor& offsets);
/// dx (N,C) += (or, Accumulate::no, =) the gather of dxp (N k, C) over each token's kept slots.
void moe_permute_backward(const Tensor& dx, const Tensor& dxp, const Tensor& slot_row, Accumulate mode);
/// out (N,C) = sum_j weights (N,k) y (N k, C)[slot_row]: the experts' outputs back in token order.
void moe_unpermute_forward(const Tensor& out, const Tensor& y, const Tensor& weights, const Tensor& slot_row);
/// dy (N k, C) and dweights (N,k) f32 WRITTEN from dout (N,C).
void moe_unpermute_backward(const Tensor& dy, const Tensor& dweights, const Tensor& dout, const Tensor& y,
                            const Tensor& weights, const Tensor& row_slot, const Tensor& slot_row,
                            const Tensor& offsets);
/// bias (n) f32 += rate sign(mean_load - loads (n) f32): n a layer's experts, or a shard's part of them.
void moe_bias_update(const Tensor& bias, const Tensor& loads, float mean_load, float rate);
/// out (R,OC) = each expert e's rows [offsets[e], offsets[e+1]) of inp (R,C) times weight (E,OC,C)[e]^T.
void grouped_matmul_forward(const Tensor& out, const Tensor& inp, const Tensor& weight, const Tensor& offsets);
/// dweight (E,OC,C) f32 += ; dinp (R,C) += (or, Accumulate::no, =) from dout (R,OC). Either part
/// may run alone (the other without data), with the whole call's arithmetic.
void grouped_matmul_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dout, const Tensor& inp,
                             const Tensor& weight, const Tensor& offsets, Accumulate mode = Accumulate::yes);

}  // namespace llmtrain::ops
