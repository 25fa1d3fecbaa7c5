// The Mixture-of-Experts MLP of the llama family's layers (docs/moe.md), built from ops:: alone:
// a router (mlp.gate.weight (E, C)) picks k of E SwiGLU experts per token, whose weights are one
// tensor per projection with a leading expert dimension (mlp.experts.gate_proj and up_proj (E, I,
// C), down_proj (E, C, I)); the token slots are permuted into expert order, run through the
// grouped GEMM and combined back with their router weights; shared experts (one fused SwiGLU of
// shared_experts x shared_ffn_hidden columns) add their output to every token's. Its three rooms
// follow Megatron's: router (moe_router_*), dispatch (moe_dispatch, moe_permute_*,
// moe_unpermute_*), experts (grouped_matmul_*).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "config/config.h"
#include "model/activations.h"
#include "ops/moe_ops.h"

namespace llmtrain::model {

/// One MoE layer's weights (or their gradients); shared_* without data when it has no shared expert,
/// bias without data when it has no expert bias (a softmax router with bias_update_rate 0).
struct MoeWeights {
  Tensor router, bias, gate, up, down, shared_gate, shared_up, shared_down;
};
/// One MoE layer's forward activations: the router's (logits (N,E), probs (N,E) f32, experts
/// (N,k) i32, weights (N,k) f32, counts (E) f32, losses (3) f32), the dispatch plan's (offsets
/// (E+1), row_slot and slot_row (N k) i32, dropped (1) f32), the experts' rows (xp (N k, C),
/// gate, up, swi (N k, I), y (N k, C)) and the shared experts' (N, S Is) and their output (N, C).
struct MoeActs {
  Tensor logits, probs, experts, weights, counts, losses, offsets, row_slot, slot_row, dropped;
  Tensor xp, gate, up, swi, y, shared_gate, shared_up, shared_swi, shared_out;
};
/// Its backward scratch.
struct MoeGrads {
  Tensor dlogits, dweights, dxp, dgate, dup, dswi, dy, shared_gate, shared_up, shared_swi;
};
/// What one MoE layer's forward measured: its load-balancing loss, z-loss, largest load over the
/// mean load, and the fraction of token slots dropped.
struct MoeLayerStats {
  double aux = 0.0, z = 0.0, imbalance = 0.0, dropped = 0.0;
  std::vector<float> counts;  // (E) tokens that chose each expert
};

/// Whether layer l of `config` has a Mixture-of-Experts MLP.
inline bool is_moe_layer(const config::ModelConfig& config, std::int64_t l) {
  return config.moe.enabled && l >= config.moe.first_dense_layers;
}
/// Whether any layer keeps the dense MLP of model.ffn_hidden.
inline bool has_dense_layers(const config::ModelConfig& config) {
  return !config.moe.enabled || config.moe.first_dense_layers > 0;
}
/// f(name suffix, shape) for one MoE layer's parameters, in flat-buffer order.
void for_each_moe_param(const config::ModelConfig& config,
                        const std::function<void(const std::string&, std::vector<std::int64_t>)>& f);
/// The slots an expert takes from a micro-batch of N tokens: ceil(capacity_factor N k / E), or 0
/// (dropless).
std::int64_t moe_capacity(const config::MoeConfig& moe, std::int64_t N);

void lay_out_moe_acts(ActsCarver& take, const config::ModelConfig& config, std::int64_t N, MoeActs& a);
void lay_out_moe_grads(ActsCarver& take, const config::ModelConfig& config, std::int64_t N, MoeGrads& g);

/// out (N,C) = the MoE MLP of ln (N,C); `capacity` as moe_capacity (0: dropless).
MoeLayerStats moe_forward(const config::MoeConfig& moe, const MoeWeights& w, const MoeActs& a, const Tensor& ln,
                          const Tensor& out, std::int64_t capacity);
/// Its backward from dout (N,C): dln (N,C) WRITTEN, the weights' gradients g += ; the router's
/// losses enter with aux_scale and z_scale (their coefficients times the loss scale of the micro-batch).
void moe_backward(const config::MoeConfig& moe, const MoeWeights& w, const MoeWeights& g, const MoeActs& a,
                  const MoeGrads& ga, const Tensor& ln, const Tensor& dln, const Tensor& dout, float aux_scale,
                  float z_scale);

}  // namespace llmtrain::model
