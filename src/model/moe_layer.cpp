#include "model/moe_layer.h"

#include <cmath>
#include <functional>
#include <vector>

#include "ops/buffer.h"
#include "ops/ops.h"

namespace llmtrain::model {
namespace {

ops::RouterKind router_kind(const config::MoeConfig& moe) {
  return {moe.router == "sigmoid", moe.normalize_top_k, float(moe.route_scale)};
}

// The first `rows` rows of a 2-D tensor.
Tensor first_rows(const Tensor& t, std::int64_t rows) {
  return Tensor(t.data, t.dtype, t.device, {rows, t.shape[1]});
}

// Small device tensors read on the host.
template <class T>
std::vector<T> read(const Tensor& t) {
  std::vector<T> out(std::size_t(t.numel()));
  ops::copy(Tensor(out.data(), t.dtype, Device::cpu, {t.numel()}), t.reshape({t.numel()}));
  return out;
}

std::int64_t kept_rows(const Tensor& offsets) { return read<std::int32_t>(offsets).back(); }

}  // namespace

void for_each_moe_param(const config::ModelConfig& config,
                        const std::function<void(const std::string&, std::vector<std::int64_t>)>& f) {
  const config::MoeConfig& m = config.moe;
  const std::int64_t C = config.d_model, E = m.experts, I = m.ffn_hidden, S = m.shared_experts * m.shared_ffn_hidden;
  f("mlp.gate.weight", {E, C});
  if (m.router == "sigmoid" || m.bias_update_rate > 0) f("mlp.gate.e_score_correction_bias", {E});
  f("mlp.experts.gate_proj", {E, I, C});
  f("mlp.experts.up_proj", {E, I, C});
  f("mlp.experts.down_proj", {E, C, I});
  if (S > 0) {
    f("mlp.shared_experts.gate_proj.weight", {S, C});
    f("mlp.shared_experts.up_proj.weight", {S, C});
    f("mlp.shared_experts.down_proj.weight", {C, S});
  }
}

std::int64_t moe_capacity(const config::MoeConfig& moe, std::int64_t N) {
  if (moe.capacity_factor <= 0) return 0;
  return std::int64_t(std::ceil(moe.capacity_factor * double(N) * double(moe.top_k) / double(moe.experts)));
}

void lay_out_moe_acts(ActsCarver& take, const config::ModelConfig& config, std::int64_t N, MoeActs& a) {
  const config::MoeConfig& m = config.moe;
  const std::int64_t C = config.d_model, E = m.experts, k = m.top_k, I = m.ffn_hidden, NK = N * k;
  const std::int64_t S = m.shared_experts * m.shared_ffn_hidden;
  a.logits = take.take({N, E});
  a.probs = take.stat({N, E});
  a.experts = take.carver.take(DType::i32, {N, k});
  a.weights = take.stat({N, k});
  a.counts = take.stat({E});
  a.losses = take.stat({3});
  a.offsets = take.carver.take(DType::i32, {E + 1});
  a.row_slot = take.carver.take(DType::i32, {NK});
  a.slot_row = take.carver.take(DType::i32, {NK});
  a.dropped = take.stat({1});
  a.xp = take.take({NK, C});
  a.gate = take.take({NK, I});
  a.up = take.take({NK, I});
  a.swi = take.take({NK, I});
  a.y = take.take({NK, C});
  if (S > 0) {
    a.shared_gate = take.take({N, S});
    a.shared_up = take.take({N, S});
    a.shared_swi = take.take({N, S});
    a.shared_out = take.take({N, C});
  }
}

void lay_out_moe_grads(ActsCarver& take, const config::ModelConfig& config, std::int64_t N, MoeGrads& g) {
  const config::MoeConfig& m = config.moe;
  const std::int64_t C = config.d_model, E = m.experts, k = m.top_k, I = m.ffn_hidden, NK = N * k;
  const std::int64_t S = m.shared_experts * m.shared_ffn_hidden;
  g.dlogits = take.take({N, E});
  g.dweights = take.stat({N, k});
  g.dxp = take.take({NK, C});
  g.dgate = take.take({NK, I});
  g.dup = take.take({NK, I});
  g.dswi = take.take({NK, I});
  g.dy = take.take({NK, C});
  if (S > 0) {
    g.shared_gate = take.take({N, S});
    g.shared_up = take.take({N, S});
    g.shared_swi = take.take({N, S});
  }
}

MoeLayerStats moe_forward(const config::MoeConfig& moe, const MoeWeights& w, const MoeActs& a, const Tensor& ln,
                          const Tensor& out, std::int64_t capacity) {
  const Tensor none;
  // Router: logits, probabilities, the top k and their weights, the losses' statistics.
  ops::matmul_forward(a.logits, ln, w.router, none);
  ops::moe_router_forward(a.probs, a.experts, a.weights, a.counts, a.losses, a.logits, w.bias, router_kind(moe));
  // Dispatch: the slots in expert order (the first M rows), through the experts' SwiGLU.
  ops::moe_dispatch(a.offsets, a.row_slot, a.slot_row, a.dropped, a.experts, capacity);
  const std::int64_t M = kept_rows(a.offsets);
  ops::moe_permute_forward(a.xp, ln, a.row_slot, a.offsets);
  ops::grouped_matmul_forward(a.gate, a.xp, w.gate, a.offsets);
  ops::grouped_matmul_forward(a.up, a.xp, w.up, a.offsets);
  if (M > 0) ops::swiglu_forward(first_rows(a.swi, M), first_rows(a.gate, M), first_rows(a.up, M));
  ops::grouped_matmul_forward(a.y, a.swi, w.down, a.offsets);
  ops::moe_unpermute_forward(out, a.y, a.weights, a.slot_row);
  if (w.shared_gate.data) {
    ops::matmul_forward(a.shared_gate, ln, w.shared_gate, none);
    ops::matmul_forward(a.shared_up, ln, w.shared_up, none);
    ops::swiglu_forward(a.shared_swi, a.shared_gate, a.shared_up);
    ops::matmul_forward(a.shared_out, a.shared_swi, w.shared_down, none);
    ops::residual_forward(out, out, a.shared_out);
  }
  const std::vector<float> losses = read<float>(a.losses);
  return {losses[0], losses[1], losses[2], read<float>(a.dropped)[0], read<float>(a.counts)};
}

void moe_backward(const config::MoeConfig& moe, const MoeWeights& w, const MoeWeights& g, const MoeActs& a,
                  const MoeGrads& ga, const Tensor& ln, const Tensor& dln, const Tensor& dout, float aux_scale,
                  float z_scale) {
  const Tensor none;
  const bool shared = w.shared_gate.data != nullptr;
  if (shared) {  // dln's first writer
    ops::matmul_backward(ga.shared_swi, g.shared_down, none, dout, a.shared_swi, w.shared_down, ops::Accumulate::no);
    ops::zero(ga.shared_gate);
    ops::zero(ga.shared_up);
    ops::swiglu_backward(ga.shared_gate, ga.shared_up, ga.shared_swi, a.shared_gate, a.shared_up);
    ops::matmul_backward(dln, g.shared_gate, none, ga.shared_gate, ln, w.shared_gate, ops::Accumulate::no);
    ops::matmul_backward(dln, g.shared_up, none, ga.shared_up, ln, w.shared_up);
  }
  const std::int64_t M = kept_rows(a.offsets);
  ops::moe_unpermute_backward(ga.dy, ga.dweights, dout, a.y, a.weights, a.row_slot, a.slot_row, a.offsets);
  ops::grouped_matmul_backward(ga.dswi, g.down, ga.dy, a.swi, w.down, a.offsets, ops::Accumulate::no);
  if (M > 0) {
    ops::zero(first_rows(ga.dgate, M));
    ops::zero(first_rows(ga.dup, M));
    ops::swiglu_backward(first_rows(ga.dgate, M), first_rows(ga.dup, M), first_rows(ga.dswi, M),
                         first_rows(a.gate, M), first_rows(a.up, M));
  }
  ops::grouped_matmul_backward(ga.dxp, g.gate, ga.dgate, a.xp, w.gate, a.offsets, ops::Accumulate::no);
  ops::grouped_matmul_backward(ga.dxp, g.up, ga.dup, a.xp, w.up, a.offsets);
  ops::moe_permute_backward(dln, ga.dxp, a.slot_row, shared ? ops::Accumulate::yes : ops::Accumulate::no);
  ops::moe_router_backward(ga.dlogits, ga.dweights, a.logits, a.probs, a.experts, a.counts, router_kind(moe),
                           aux_scale, z_scale);
  ops::matmul_backward(dln, g.router, none, ga.dlogits, ln, w.router);
}

}  // namespace llmtrain::model
