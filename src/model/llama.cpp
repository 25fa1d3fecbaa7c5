#include "model/llama.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "core/error.h"
#include "ops/ops.h"

namespace llmtrain::model {
namespace {

std::string layer_prefix(std::int64_t l) { return "model.layers." + std::to_string(l) + "."; }

// This rank's widths of a layer's activations: its query heads' (CL) and the packed q, k, v rows' (QKV).
struct Widths {
  std::int64_t NH, CL, QKV, F;
};

Widths widths(const config::ModelConfig& c, int parts) {
  const std::int64_t HS = c.d_model / c.n_head, NH = c.n_head / parts;
  const std::int64_t NKV = c.n_kv_head % parts == 0 ? c.n_kv_head / parts : 1;  // else replicated
  return {NH, NH * HS, (NH + 2 * NKV) * HS, c.ffn_hidden / parts};
}

// This rank's key/value heads.
std::int64_t kv_heads(const config::ModelConfig& c, int parts) {
  return c.n_kv_head % parts == 0 ? c.n_kv_head / parts : 1;
}

}  // namespace

void LlamaBody::for_each_param(const config::ModelConfig& c, const ParamVisitor& f) {
  const std::int64_t C = c.d_model, F4 = c.ffn_hidden, V = c.vocab_size, HS = c.d_model / c.n_head;
  const std::int64_t NH = c.n_head, NKV = c.n_kv_head;
  if (!c.tie_embeddings) f("lm_head.weight", {V, C});
  f("model.norm.weight", {C});
  for (std::int64_t l = c.n_layer - 1; l >= 0; --l) {
    const std::string h = layer_prefix(l);
    f(h + "input_layernorm.weight", {C});
    // q, k and v stay adjacent: together they are the one ((NH + 2 NKV) HS, C) matrix of the fused matmul.
    f(h + "self_attn.q_proj.weight", {NH * HS, C});
    f(h + "self_attn.k_proj.weight", {NKV * HS, C});
    f(h + "self_attn.v_proj.weight", {NKV * HS, C});
    if (c.qk_norm) {  // adjacent: their gradients are summed over a tensor group in one call
      f(h + "self_attn.q_norm.weight", {HS});
      f(h + "self_attn.k_norm.weight", {HS});
    }
    f(h + "self_attn.o_proj.weight", {C, NH * HS});
    f(h + "post_attention_layernorm.weight", {C});
    if (is_moe_layer(c, l)) {
      for_each_moe_param(c, [&](const std::string& name, std::vector<std::int64_t> shape) { f(h + name, shape); });
      continue;
    }
    f(h + "mlp.gate_proj.weight", {F4, C});
    f(h + "mlp.up_proj.weight", {F4, C});
    f(h + "mlp.down_proj.weight", {C, F4});
  }
  f("model.embed_tokens.weight", {V, C});
}

// The pre-rotation qkv and the two branch outputs: backward never reads them.
void LlamaBody::lay_out_unread(ActsCarver& take, const config::ModelConfig& config, const ActsDims& d, Acts& la) {
  const std::int64_t C = config.d_model;
  const std::int64_t QKV = widths(config, d.width_parts).QKV;
  // With model.qk_norm backward reads qkv (the norm's input) and not qkn.
  if (config.qk_norm) {
    la.qkn = take.take({d.N, QKV});
  } else {
    la.qkv = take.take({d.N, QKV});
  }
  la.attproj = take.take({d.R, C});
  la.down = take.take({d.R, C});
}

void LlamaBody::lay_out_mlp(ActsCarver& take, const config::ModelConfig& config, const ActsDims& d, Acts& la) {
  const std::int64_t F = widths(config, d.width_parts).F;
  // A layer of its own (d.layer >= 0) gets the activations of its kind of MLP; a shared slot both.
  const bool dense = d.layer >= 0 ? !is_moe_layer(config, d.layer) : has_dense_layers(config);
  const bool moe = d.layer >= 0 ? is_moe_layer(config, d.layer) : config.moe.enabled;
  if (dense) {
    la.gate = take.take({d.N, F});
    la.up = take.take({d.N, F});
    la.swi = take.take({d.N, F});
  }
  if (moe) lay_out_moe_acts(take, config, d.N, la.moe, d.expert_parts, d.R < d.N, MoeActsPart::recomputed);
}

void LlamaBody::lay_out_kept(ActsCarver& take, const config::ModelConfig& config, const ActsDims& d, Acts& la) {
  const auto [NH, CL, QKV, F] = widths(config, d.width_parts);
  const std::int64_t N = d.N, R = d.R, C = config.d_model;
  la.ln1 = take.take({R, C});
  la.rstd1 = take.stat({R});
  if (config.qk_norm) {
    la.qkv = take.take({N, QKV});
    la.rstd_qk = take.stat({N, NH + kv_heads(config, d.width_parts)});
  }
  la.qkvr = take.take({N, QKV});
  la.atty = take.take({N, CL});
  la.lse = take.stat({d.B, NH, d.T});
  la.residual2 = take.take({R, C});
  la.ln2 = take.take({R, C});
  la.rstd2 = take.stat({R});
  // A MoE layer's routing and dispatch plan (recompute "mlp" keeps them: the rest is recomputed).
  const bool moe = d.layer >= 0 ? is_moe_layer(config, d.layer) : config.moe.enabled;
  if (moe) lay_out_moe_acts(take, config, d.N, la.moe, d.expert_parts, d.R < d.N, MoeActsPart::kept);
}

void LlamaBody::lay_out_grads(ActsCarver& take, const config::ModelConfig& config, const ActsDims& d, Grads& g) {
  const auto [NH, CL, QKV, F] = widths(config, d.width_parts);
  const std::int64_t N = d.N, R = d.R, C = config.d_model;
  g.ln1 = take.take({R, C});
  g.qkv = take.take({N, QKV});
  g.qkvr = take.take({N, QKV});
  g.atty = take.take({N, CL});
  g.ln2 = take.take({R, C});
  if (has_dense_layers(config)) {
    g.gate = take.take({N, F});
    g.up = take.take({N, F});
    g.swi = take.take({N, F});
  }
  if (config.moe.enabled) lay_out_moe_grads(take, config, N, g.moe, d.expert_parts);
  if (config.qk_norm) g.qkn = take.take({N, QKV});
}

void LlamaBody::lay_out_decoding(ActsCarver& take, const config::ModelConfig& config, Decoding& d) {
  const auto [NH, CL, QKV, F] = widths(config, 1);
  const std::int64_t C = config.d_model;
  d.qkv = take.take({1, QKV});
  d.qkvr = take.take({1, QKV});
  d.atty = take.take({1, C});
  d.proj = take.take({1, C});
  if (has_dense_layers(config)) {
    d.gate = take.take({1, F});
    d.up = take.take({1, F});
    d.swi = take.take({1, F});
  }
  if (config.moe.enabled) lay_out_moe_acts(take, config, 1, d.moe);
  if (config.qk_norm) {
    d.qkn = take.take({1, QKV});
    d.rstd_qk = take.stat({1, config.n_head + config.n_kv_head});
  }
}

Llama::Llama(const config::ModelConfig& config, Device device, Recompute recompute, DType compute,
             ops::AttentionKernels attention, Layout layout)
    : Decoder(config, device, recompute, compute, attention, layout) {
  // The config's rules and the shares that split the experts and widths checked these first.
  const int EP = expert_parts();
  if (EP > 1 && (!config.moe.enabled || config.moe.experts % EP != 0)) {
    throw RuntimeError("Llama: " + std::to_string(config.moe.enabled ? config.moe.experts : 0) +
                       " experts do not split into " + std::to_string(EP) + " parts");
  }
  const int N = width_parts();
  // Key/value heads are split like the query heads when N divides their number, else (N a
  // multiple of it) each is replicated on the N / n_kv_head ranks whose query heads use it.
  const bool kv_split = config.n_kv_head % N == 0, kv_replicated = N % config.n_kv_head == 0;
  if (config.n_head % N != 0 || config.ffn_hidden % N != 0 || !(kv_split || kv_replicated)) {
    throw RuntimeError("Llama: " + std::to_string(config.n_head) + " query heads, " + std::to_string(config.n_kv_head) +
                       " key/value heads and " + std::to_string(config.ffn_hidden) + " MLP columns do not split into " +
                       std::to_string(N) + " parts");
  }
  HS_ = config.d_model / config.n_head;
  NH_ = config.n_head / N;
  NKV_ = kv_split ? config.n_kv_head / N : 1;
  kv_sharers_ = kv_split ? 1 : N / int(config.n_kv_head);
  QKV_ = (NH_ + 2 * NKV_) * HS_;
  build();
  // The tensor-parallel sum of the two norms' gradients takes them as one run of 2 HS.
  const std::vector<ParamInfo>& infos = param_infos();
  for (std::size_t i = 0; i < infos.size(); ++i) {
    if (!infos[i].name.ends_with("self_attn.q_norm.weight")) continue;
    if (i + 1 == infos.size() || !infos[i + 1].name.ends_with("self_attn.k_norm.weight") ||
        infos[i + 1].offset != infos[i].offset + HS_) {
      throw RuntimeError("Llama: " + infos[i].name + " and its k_norm are not adjacent");
    }
  }
}

TensorSlice Llama::layer_slice(const std::string& name) const {
  const std::int64_t F = config_.ffn_hidden;
  // Expert parallelism: this rank's whole experts, the same on every rank of its tensor group.
  if (name.find(".mlp.experts.") != std::string::npos && expert_parts() > 1) {
    const std::int64_t El = config_.moe.experts / expert_parts();
    return {0, {{experts()->index() * El, El}}, true, true};
  }
  // Megatron's split: q, k, v, gate and up column-parallel (q, k and v by heads), o and down
  // row-parallel (summed after).
  if (name.ends_with("self_attn.q_proj.weight")) return share_->column_part(config_.n_head * HS_);
  if (name.ends_with("self_attn.k_proj.weight") || name.ends_with("self_attn.v_proj.weight")) {
    if (kv_sharers_ == 1) return share_->column_part(config_.n_kv_head * HS_);
    // The key/value head of this rank's query heads; the first of the ranks sharing it owns it.
    const int rank = share_->index();
    return {0, {{std::int64_t(rank / kv_sharers_) * HS_, HS_}}, rank % kv_sharers_ == 0};
  }
  if (name.ends_with("self_attn.o_proj.weight")) return share_->row_part(config_.n_head * HS_);
  if (name.ends_with("mlp.gate_proj.weight") || name.ends_with("mlp.up_proj.weight")) return share_->column_part(F);
  if (name.ends_with("mlp.down_proj.weight")) return share_->row_part(F);
  return {};
}

Llama::LayerParams Llama::bind_layer(std::int64_t l, bool grads) const {
  const std::string h = layer_prefix(l);
  LayerParams lp;
  lp.in_norm = param_named(h + "input_layernorm.weight", grads);
  const Tensor q = param_named(h + "self_attn.q_proj.weight", grads);
  lp.qkv = Tensor(q.data, q.dtype, device_, {QKV_, config_.d_model});
  lp.o = param_named(h + "self_attn.o_proj.weight", grads);
  if (config_.qk_norm) {
    lp.q_norm = param_named(h + "self_attn.q_norm.weight", grads);
    lp.k_norm = param_named(h + "self_attn.k_norm.weight", grads);
  }
  lp.post_norm = param_named(h + "post_attention_layernorm.weight", grads);
  if (is_moe_layer(config_, l)) {
    const auto named = [&](const char* name) { return has_param(h + name) ? param_named(h + name, grads) : Tensor(); };
    lp.moe = {named("mlp.gate.weight"),
              named("mlp.gate.e_score_correction_bias"),
              named("mlp.experts.gate_proj"),
              named("mlp.experts.up_proj"),
              named("mlp.experts.down_proj"),
              named("mlp.shared_experts.gate_proj.weight"),
              named("mlp.shared_experts.up_proj.weight"),
              named("mlp.shared_experts.down_proj.weight")};
    return lp;
  }
  lp.gate = param_named(h + "mlp.gate_proj.weight", grads);
  lp.up = param_named(h + "mlp.up_proj.weight", grads);
  lp.down = param_named(h + "mlp.down_proj.weight", grads);
  return lp;
}

Model::InitRule Llama::init_rule(const ParamInfo& info) const {
  if (info.name.ends_with("e_score_correction_bias")) return {0.0f, 0.0f};  // the experts start unbiased
  if (info.shape.size() == 1) return {0.0f, 1.0f};  // RMSNorm weights
  // As GPT-2 does, so the stream's variance does not grow with depth.
  const float residual_std = 0.02f / std::sqrt(2.0f * float(config_.n_layer));
  const bool residual = info.name.ends_with("o_proj.weight") || info.name.ends_with("down_proj.weight") ||
                        info.name.ends_with("experts.down_proj");
  return {residual ? residual_std : 0.02f, 0.0f};
}

void Llama::forward_mlp(std::size_t l) {
  const LayerParams& lp = p_.layers[l];
  const LayerActs& la = layer_acts(l);
  const Tensor none;
  if (is_moe_layer(config_, std::int64_t(l))) {  // recompute "mlp": from the kept routing, on this rank
    return moe_recompute(linears_, lp.moe, la.moe, split_rows() ? la.moe.ln : la.ln2);
  }
  const Tensor ln2 = share_->gather_input(la.ln2, a_.full_in);
  linears_.forward(la.gate, ln2, lp.gate, none);
  linears_.forward(la.up, ln2, lp.up, none);
  ops::swiglu_forward(la.swi, la.gate, la.up);
}

void Llama::forward_layer(std::size_t l) {
  const int B = acts_B_, T = acts_T_;
  const std::int64_t NH = NH_, NKV = NKV_, C = NH * HS_;  // this rank's heads and their width
  const auto eps = float(config_.norm_eps), theta = float(config_.rope_theta);
  const LayerParams& lp = p_.layers[l];
  const LayerActs& la = layer_acts(l);
  const Tensor& x = layer_input(l);
  const Tensor none;
  // Tensor parallelism: q, k, v, gate and up column-parallel, o and down row-parallel.
  ops::rmsnorm_forward(la.ln1, la.rstd1, x, lp.in_norm, eps);
  share_->column_linear(linears_, la.qkv, la.ln1, a_.full_in, lp.qkv, none);
  const Tensor& qkv = normed_qkv(lp, la.qkv, la.qkn, la.rstd_qk, NH, NKV);
  rope(la.qkvr.reshape({B, T, NH + 2 * NKV, HS_}), qkv.reshape({B, T, NH + 2 * NKV, HS_}), theta, rotated_heads(),
       false);
  attention_forward(la.atty.reshape({B, T, C}), la.lse, la.qkvr.reshape({B, T, QKV_}), int(NH), int(NKV));
  share_->row_linear(linears_, la.attproj, a_.full_out, la.atty, lp.o, none);
  ops::residual_forward(la.residual2, x, la.attproj);
  ops::rmsnorm_forward(la.ln2, la.rstd2, la.residual2, lp.post_norm, eps);
  if (is_moe_layer(config_, std::int64_t(l))) {
    // Every tensor rank runs the router and the experts whole on all the micro-batch's tokens (under
    // sequence parallelism gathered from the group, this rank keeping its rows of the output); a
    // context group's ranks each run their own tokens, the router's statistics summed over them.
    const bool sp = split_rows();
    const Tensor ln2 = share_->gather_input(la.ln2, la.moe.ln);
    const MoeLayerStats s = moe_forward(linears_, config_.moe, lp.moe, la.moe, ln2, sp ? a_.full_out : la.down,
                                        moe_capacity(config_.moe, std::int64_t(B) * T), experts(), &ga_.moe,
                                        sequences_);
    if (sp) ops::copy(la.down, share_->own_rows(a_.full_out));
    if (!recomputing()) add_moe_stats(l, s);  // a forward's statistics count once
  } else {
    forward_mlp(l);
    share_->row_linear(linears_, la.down, a_.full_out, la.swi, lp.down, none);
  }
  ops::residual_forward(la.residual3, la.residual2, la.down);
}

void Llama::add_moe_stats(std::size_t l, const MoeLayerStats& s) {
  const double layers = double(config_.n_layer - config_.moe.first_dense_layers);
  if (l == std::size_t(config_.moe.first_dense_layers)) ++moe_stats_.forwards;
  moe_stats_.aux += s.aux / layers;
  moe_stats_.z += s.z / layers;
  moe_stats_.dropped += s.dropped / layers;
  moe_stats_.imbalance = std::max(moe_stats_.imbalance, s.imbalance);
  const std::size_t E = s.counts.size(), at = (l - std::size_t(config_.moe.first_dense_layers)) * E;
  moe_stats_.loads.resize(std::size_t(layers) * E, 0.0);
  for (std::size_t e = 0; e < E; ++e) moe_stats_.loads[at + e] += s.counts[e];
}

MoeStats Llama::take_moe_stats() {
  const MoeStats s = moe_stats_;
  moe_stats_ = MoeStats();
  return s;
}

void Llama::backward_layer(std::size_t l) {
  const int B = acts_B_, T = acts_T_;
  const std::int64_t C = config_.d_model, NH = NH_, NKV = NKV_, CL = NH * HS_;  // CL: this rank's heads' width
  const float theta = float(config_.rope_theta);
  const Tensor none;
  const bool sp = split_rows();
  const Tensor& dresidual = ga_.residual;
  const LayerParams& lp = p_.layers[l];
  const LayerParams& lg = g_.layers[l];
  const LayerActs& la = layer_acts(l);
  const Tensor& x = layer_input(l);
  // Each activation gradient's first writer writes it (no zeroing), except those that the
  // accumulating elementwise and rotary backwards write first.
  ops::zero(ga_.qkv);
  if (is_moe_layer(config_, std::int64_t(l))) {
    // The micro-batch's load-balancing and z losses are means over its N tokens; each micro-step's
    // counts 1 / (micro-steps x data ranks) = dloss_scale N of the update's mean, as its loss does.
    // Under context parallelism B T are this rank's tokens, and the load-balancing loss reads the
    // micro-batch's counts (moe_backward).
    const config::MoeConfig& m = config_.moe;
    const float per_batch = dloss_scale_ * float(std::int64_t(B) * T);
    const float aux_scale = float(m.aux_loss_coef) * per_batch / float(sequence_parts());
    // Sequence parallelism: from the whole tokens' output gradient and the input kept in forward;
    // this rank keeps its rows of the input's gradient.
    const Tensor ln2 = sp ? la.moe.ln : la.ln2, dln2 = sp ? a_.full_out : ga_.ln2;
    moe_backward(linears_, m, lp.moe, lg.moe, la.moe, ga_.moe, ln2, dln2,
                 share_->gather_input(dresidual, a_.full_in), aux_scale, float(m.z_loss_coef) * per_batch,
                 experts());
    if (sp) ops::copy(ga_.ln2, share_->own_rows(dln2));
  } else {
    ops::zero(ga_.gate);
    ops::zero(ga_.up);
    // MLP branch: residual3 = residual2 + down(swiglu(gate(ln2), up(ln2))).
    linears_.backward(ga_.swi, lg.down, none, share_->gather_input(dresidual, a_.full_in), la.swi, lp.down,
                         ops::Accumulate::no);
    ops::swiglu_backward(ga_.gate, ga_.up, ga_.swi, la.gate, la.up);
    const Tensor dln2 = sp ? a_.full_out : ga_.ln2;
    const Tensor ln2 = share_->gather_input(la.ln2, a_.full_in);
    linears_.backward(dln2, lg.gate, none, ga_.gate, ln2, lp.gate, ops::Accumulate::no);
    linears_.backward(dln2, lg.up, none, ga_.up, ln2, lp.up);
    share_->reduce_output(dln2, ga_.ln2);
  }
  share_->norm_backward(norm_grads(lg.post_norm, C), [&] {
    ops::rmsnorm_backward(dresidual, lg.post_norm, ga_.ln2, la.residual2, lp.post_norm, la.rstd2);
  });
  // Attention branch: residual2 = x + o(attention(rope(qkv(ln1)))).
  linears_.backward(ga_.atty, lg.o, none, share_->gather_input(dresidual, a_.full_in), la.atty, lp.o,
                       ops::Accumulate::no);
  attention_backward(ga_.qkvr.reshape({B, T, QKV_}), ga_.atty.reshape({B, T, CL}), la.qkvr.reshape({B, T, QKV_}),
                     la.atty.reshape({B, T, CL}), la.lse, int(NH), int(NKV));
  if (config_.qk_norm) {
    // Each rank's heads add to the replicated q_norm and k_norm weights: their gradients of this
    // micro-step are summed over the tensor group.
    ops::zero(ga_.qkn);
    rope(ga_.qkn.reshape({B, T, NH + 2 * NKV, HS_}), ga_.qkvr.reshape({B, T, NH + 2 * NKV, HS_}), theta,
         rotated_heads(), true);
    share_->head_norm_backward(norm_grads(lg.q_norm, 2 * HS_), [&] {
      ops::qk_norm_backward(ga_.qkv, lg.q_norm, lg.k_norm, ga_.qkn, la.qkv, lp.q_norm, lp.k_norm, la.rstd_qk, int(NH),
                            int(NKV));
    });
  } else {
    rope(ga_.qkv.reshape({B, T, NH + 2 * NKV, HS_}), ga_.qkvr.reshape({B, T, NH + 2 * NKV, HS_}), theta,
         rotated_heads(), true);
  }
  const Tensor dln1 = sp ? a_.full_out : ga_.ln1;
  const Tensor ln1 = share_->gather_input(la.ln1, a_.full_in);
  if (kv_sharers_ > 1) {
    backward_qkv_shared_kv(l, dln1, ln1);
  } else {
    linears_.backward(dln1, lg.qkv, none, ga_.qkv, ln1, lp.qkv, ops::Accumulate::no);
  }
  share_->reduce_output(dln1, ga_.ln1);
  share_->norm_backward(norm_grads(lg.in_norm, C),
                    [&] { ops::rmsnorm_backward(dresidual, lg.in_norm, ga_.ln1, x, lp.in_norm, la.rstd1); });
}

// The q, k, v projection's backward when this rank's key/value head is replicated on others: the
// gradient of its k and v rows from this micro-step is the sum over the ranks sharing the head
// (each contributes through its own query heads). All-reduced over the whole group in a buffer with
// one slot per key/value head; the gradient accumulated before this micro-step is kept apart.
void Llama::backward_qkv_shared_kv(std::size_t l, const Tensor& dln1, const Tensor& ln1) {
  const LayerParams& lp = p_.layers[l];
  const LayerParams& lg = g_.layers[l];
  const std::int64_t C = config_.d_model, kv = 2 * HS_ * C;  // this rank's k and v rows
  const std::int64_t NKV = config_.n_kv_head;
  if (kv_grads_.bytes() < std::size_t((NKV + 1) * kv) * sizeof(float)) {
    kv_grads_ = ops::Buffer(device_, std::size_t((NKV + 1) * kv) * sizeof(float));
  }
  float* base = static_cast<float*>(kv_grads_.data());
  const Tensor kept(base + NKV * kv, DType::f32, device_, {kv});  // the gradient before this micro-step
  const Tensor slots(base, DType::f32, device_, {NKV * kv});
  const Tensor mine(base + std::int64_t(share_->index() / kv_sharers_) * kv, DType::f32, device_, {kv});
  const Tensor grad(lg.qkv.as<float>() + NH_ * HS_ * C, DType::f32, device_, {kv});
  ops::copy(kept, grad);
  ops::zero(grad);
  linears_.backward_whole(dln1, lg.qkv, Tensor(), ga_.qkv, ln1, lp.qkv, ops::Accumulate::no);  // the sum needs it
  ops::zero(slots);
  ops::copy(mine, grad);
  share_->all_reduce(slots);
  ops::residual_forward(grad, kept, mine);
}

void Llama::decode_layer(std::size_t l, int pos) {
  const std::int64_t C = config_.d_model, NH = config_.n_head, NKV = config_.n_kv_head, KVC = NKV * HS_;
  const auto eps = float(config_.norm_eps), theta = float(config_.rope_theta);
  const Tensor none;
  const LayerParams& lp = p_.layers[l];
  ops::rmsnorm_forward(d_.ln, d_.rstd, d_.x, lp.in_norm, eps);
  linears_.forward(d_.qkv, d_.ln, lp.qkv, none);
  const Tensor& qkv = normed_qkv(lp, d_.qkv, d_.qkn, d_.rstd_qk, NH, NKV);
  ops::rope_forward(d_.qkvr.reshape({1, 1, NH + 2 * NKV, HS_}), qkv.reshape({1, 1, NH + 2 * NKV, HS_}), theta,
                    rotated_heads(), pos);
  ops::copy(row_slice(d_.k_cache[l], pos, 0, KVC), row_slice(d_.qkvr, 0, C, KVC));
  ops::copy(row_slice(d_.v_cache[l], pos, 0, KVC), row_slice(d_.qkvr, 0, C + KVC, KVC));
  ops::attention_decode(d_.atty.reshape({C}), row_slice(d_.qkvr, 0, 0, C), d_.k_cache[l], d_.v_cache[l], pos, int(NH),
                        int(NKV));
  linears_.forward(d_.proj, d_.atty, lp.o, none);
  ops::residual_forward(d_.x2, d_.x, d_.proj);
  ops::rmsnorm_forward(d_.ln, d_.rstd, d_.x2, lp.post_norm, eps);
  if (is_moe_layer(config_, std::int64_t(l))) {
    moe_forward(linears_, config_.moe, lp.moe, d_.moe, d_.ln, d_.proj, 0);  // one token: nothing to drop
  } else {
    linears_.forward(d_.gate, d_.ln, lp.gate, none);
    linears_.forward(d_.up, d_.ln, lp.up, none);
    ops::swiglu_forward(d_.swi, d_.gate, d_.up);
    linears_.forward(d_.proj, d_.swi, lp.down, none);
  }
  ops::residual_forward(d_.x, d_.x2, d_.proj);
}

const Tensor& Llama::normed_qkv(const LayerParams& lp, const Tensor& qkv, const Tensor& qkn, const Tensor& rstd_qk,
                                std::int64_t NH, std::int64_t NKV) {
  if (!config_.qk_norm) return qkv;
  ops::qk_norm_forward(qkn, rstd_qk, qkv, lp.q_norm, lp.k_norm, int(NH), int(NKV), float(config_.norm_eps));
  return qkn;
}

void Llama::final_norm_forward(const Tensor& out, const Tensor&, const Tensor& rstd, const Tensor& x,
                               const Tensor& weight, const Tensor&) {
  ops::rmsnorm_forward(out, rstd, x, weight, float(config_.norm_eps));
}

void Llama::final_norm_backward(const Tensor& dx, const Tensor& dweight, const Tensor&, const Tensor& dout,
                                const Tensor& x, const Tensor& weight, const Tensor&, const Tensor& rstd) {
  ops::rmsnorm_backward(dx, dweight, dout, x, weight, rstd);
}

}  // namespace llmtrain::model
