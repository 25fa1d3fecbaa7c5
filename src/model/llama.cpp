#include "model/llama.h"

#include <cmath>
#include <string>

#include "core/error.h"
#include "ops/ops.h"

namespace llmtrain::model {
namespace {

std::string layer_prefix(std::int64_t l) { return "model.layers." + std::to_string(l) + "."; }

// A view of `width` elements of row r of a 2-D tensor, starting at column `offset`.
Tensor row_slice(const Tensor& t, std::int64_t r, std::int64_t offset, std::int64_t width) {
  char* base = static_cast<char*>(t.data) + std::size_t(r * t.shape[1] + offset) * dtype_size(t.dtype);
  return Tensor(base, t.dtype, t.device, {width});
}

// Calls f(name, shape) for every parameter, in flat-buffer order.
template <class F>
void for_each_param(const config::ModelConfig& c, F&& f) {
  const std::int64_t C = c.d_model, F4 = c.ffn_hidden, V = c.vocab_size, HS = c.d_model / c.n_head;
  const std::int64_t NH = c.n_head, NKV = c.n_kv_head;
  if (!c.tie_embeddings) f("lm_head.weight", std::vector<std::int64_t>{V, C});
  f("model.norm.weight", std::vector<std::int64_t>{C});
  for (std::int64_t l = c.n_layer - 1; l >= 0; --l) {
    const std::string h = layer_prefix(l);
    f(h + "input_layernorm.weight", std::vector<std::int64_t>{C});
    // q, k and v stay adjacent: together they are the one ((NH + 2 NKV) HS, C) matrix of the fused matmul.
    f(h + "self_attn.q_proj.weight", std::vector<std::int64_t>{NH * HS, C});
    f(h + "self_attn.k_proj.weight", std::vector<std::int64_t>{NKV * HS, C});
    f(h + "self_attn.v_proj.weight", std::vector<std::int64_t>{NKV * HS, C});
    f(h + "self_attn.o_proj.weight", std::vector<std::int64_t>{C, NH * HS});
    f(h + "post_attention_layernorm.weight", std::vector<std::int64_t>{C});
    f(h + "mlp.gate_proj.weight", std::vector<std::int64_t>{F4, C});
    f(h + "mlp.up_proj.weight", std::vector<std::int64_t>{F4, C});
    f(h + "mlp.down_proj.weight", std::vector<std::int64_t>{C, F4});
  }
  f("model.embed_tokens.weight", std::vector<std::int64_t>{V, C});
}

}  // namespace

Llama::Llama(const config::ModelConfig& config, Device device, Recompute recompute, DType compute,
             ops::AttentionKernels attention, Layout layout)
    : Model(config, device, compute, attention, layout), recompute_(recompute) {
  if (config.arch != config::Arch::llama) {
    throw RuntimeError("Llama: config has model.arch \"" + config::to_string(config.arch) + "\"");
  }
  const int N = layout.tensor_size;
  // Key/value heads are split like the query heads when N divides their number, else (N a
  // multiple of it) each is replicated on the N / n_kv_head ranks whose query heads use it.
  const bool kv_split = config.n_kv_head % N == 0, kv_replicated = N % config.n_kv_head == 0;
  if (config.n_head % N != 0 || config.ffn_hidden % N != 0 || !(kv_split || kv_replicated)) {
    throw InputError("dist.tensor_parallel = " + std::to_string(N) + " must divide model.n_head (" +
                     std::to_string(config.n_head) + ") and model.ffn_hidden (" + std::to_string(config.ffn_hidden) +
                     "), and divide or be a multiple of model.n_kv_head (" + std::to_string(config.n_kv_head) + ")");
  }
  HS_ = config.d_model / config.n_head;
  NH_ = config.n_head / N;
  NKV_ = kv_split ? config.n_kv_head / N : 1;
  kv_sharers_ = kv_split ? 1 : N / int(config.n_kv_head);
  QKV_ = (NH_ + 2 * NKV_) * HS_;
  // Pipeline stages: the first holds the embedding, the last the final norm and the head (the
  // embedding too when tied).
  const auto held = [&](const std::string& name) {
    if (name == "lm_head.weight" || name == "model.norm.weight") return holds_last_stage();
    if (name == "model.embed_tokens.weight") return holds_first_stage() || (holds_last_stage() && config_.tie_embeddings);
    return true;  // a layer's: add_param keeps this stage's
  };
  for_each_param(config, [&](const std::string& name, const std::vector<std::int64_t>& shape) {
    add_param(name, shape, slice_of(name), held(name));
  });
  allocate();
  p_ = bind_params(false);
  g_ = bind_params(true);
}

TensorSlice Llama::slice_of(const std::string& name) const {
  const std::int64_t F = config_.ffn_hidden;
  // Megatron's split: q, k, v, gate and up by output rows (q, k and v by heads), o and down by
  // input columns (summed after), the embedding and the head by vocabulary rows.
  if (name.ends_with("self_attn.q_proj.weight")) return even_part(0, config_.n_head * HS_);
  if (name.ends_with("self_attn.k_proj.weight") || name.ends_with("self_attn.v_proj.weight")) {
    if (kv_sharers_ == 1) return even_part(0, config_.n_kv_head * HS_);
    // The key/value head of this rank's query heads; the first of the ranks sharing it owns it.
    const int rank = layout_.tensor_rank;
    return {0, {{std::int64_t(rank / kv_sharers_) * HS_, HS_}}, rank % kv_sharers_ == 0};
  }
  if (name.ends_with("self_attn.o_proj.weight")) return even_part(1, config_.n_head * HS_);
  if (name.ends_with("mlp.gate_proj.weight") || name.ends_with("mlp.up_proj.weight")) return even_part(0, F);
  if (name.ends_with("mlp.down_proj.weight")) return even_part(1, F);
  if (name == "model.embed_tokens.weight" || name == "lm_head.weight") {
    TensorSlice rows = tensor_size() > 1 ? TensorSlice{0, {{vocab_begin(), vocab_end() - vocab_begin()}}} : TensorSlice{};
    // A tied embedding on the last pipeline stage (the head's) is a copy of the first stage's.
    rows.owner = name == "lm_head.weight" || holds_first_stage();
    return rows;
  }
  return {};
}

std::int64_t Llama::parameter_count(const config::ModelConfig& config) {
  std::int64_t count = 0;
  for_each_param(config, [&](const std::string&, const std::vector<std::int64_t>& shape) {
    std::int64_t numel = 1;
    for (const auto d : shape) numel *= d;
    count += numel;
  });
  return count;
}

Llama::Params Llama::bind_params(bool grads) const {
  Params p;
  p.layers.resize(std::size_t(config_.n_layer));
  bind_roots(p, grads);
  for (std::int64_t l = 0; l < config_.n_layer; ++l) {
    if (holds_layer(l)) p.layers[std::size_t(l)] = bind_layer(l, grads);
  }
  return p;
}

void Llama::bind_roots(Params& p, bool grads) const {
  const auto bind = [&](const std::string& name) { return has_param(name) ? param_named(name, grads) : Tensor(); };
  p.embed = bind("model.embed_tokens.weight");
  p.norm = bind("model.norm.weight");
  p.head = config_.tie_embeddings ? p.embed : bind("lm_head.weight");
}

Llama::LayerParams Llama::bind_layer(std::int64_t l, bool grads) const {
  const std::string h = layer_prefix(l);
  LayerParams lp;
  lp.in_norm = param_named(h + "input_layernorm.weight", grads);
  const Tensor q = param_named(h + "self_attn.q_proj.weight", grads);
  lp.qkv = Tensor(q.data, q.dtype, device_, {QKV_, config_.d_model});
  lp.o = param_named(h + "self_attn.o_proj.weight", grads);
  lp.post_norm = param_named(h + "post_attention_layernorm.weight", grads);
  lp.gate = param_named(h + "mlp.gate_proj.weight", grads);
  lp.up = param_named(h + "mlp.up_proj.weight", grads);
  lp.down = param_named(h + "mlp.down_proj.weight", grads);
  return lp;
}

void Llama::bind_unit(const Unit& unit) {
  if (unit.layer >= 0) {
    p_.layers[std::size_t(unit.layer)] = bind_layer(unit.layer, false);
    g_.layers[std::size_t(unit.layer)] = bind_layer(unit.layer, true);
    return;
  }
  bind_roots(p_, false);
  bind_roots(g_, true);
}

void Llama::init_weights(std::uint64_t seed) {
  // normal(0, 0.02) for every matrix, the two projections that feed the residual stream scaled by
  // 1 / sqrt(2 L) (as GPT-2 does, so the stream's variance does not grow with depth); norms 1.
  const float residual_std = 0.02f / std::sqrt(2.0f * float(config_.n_layer));
  for (const auto& info : param_infos()) {
    if (info.shape.size() == 1) {
      init_constant(info, 1.0f);
    } else {
      const bool residual = info.name.ends_with("o_proj.weight") || info.name.ends_with("down_proj.weight");
      init_normal(info, seed, residual ? residual_std : 0.02f);
    }
  }
}

int Llama::rotated_heads() const { return int(NH_ + NKV_); }

std::size_t Llama::bind_acts(const config::ModelConfig& config, Recompute recompute, DType compute, Carver& carver,
                            int B, int T, Acts& a, GradActs& g, const ActsShape& shape) {
  // Under tensor parallelism this rank's heads, MLP columns and vocabulary rows (at most); with
  // sequence parallelism R of the N tokens in the residual stream, its norms and their gradients;
  // under pipeline parallelism this stage's layers.
  const int tensor_size = shape.tensor_size;
  const std::int64_t layers = shape.layers < 0 ? config.n_layer : shape.layers;
  const std::int64_t N = std::int64_t(B) * T, R = shape.sequence_parallel ? N / tensor_size : N, C = config.d_model, F = config.ffn_hidden / tensor_size,
                     V = (config.vocab_size + tensor_size - 1) / tensor_size, NH = config.n_head / tensor_size,
                     CL = NH * (C / config.n_head),
                     NKV = config.n_kv_head % tensor_size == 0 ? config.n_kv_head / tensor_size : 1,  // else replicated
                     QKV = (NH + 2 * NKV) * (C / config.n_head);
  // Activations in the compute dtype; statistics (rstd, lse, losses) always f32.
  const auto take = [&](std::initializer_list<std::int64_t> dims) { return carver.take(compute, dims); };
  const auto stat = [&](std::initializer_list<std::int64_t> dims) { return carver.take(DType::f32, dims); };
  if (shape.acts) {
    a = Acts();
    a.inputs = carver.take(DType::i32, {B, T});
    a.targets = carver.take(DType::i32, {N});
    a.encoded = take({R, C});

    // One copy shared by all layers: what backward never reads (the pre-rotation qkv and the two
    // branch outputs) and what it recomputes.
    LayerActs shared;
    shared.qkv = take({N, QKV});
    shared.attproj = take({R, C});
    shared.down = take({R, C});
    const bool full = recompute == Recompute::full;
    if (recompute != Recompute::none) {
      shared.gate = take({N, F});
      shared.up = take({N, F});
      shared.swi = take({N, F});
    }
    if (full) {
      shared.ln1 = take({R, C});
      shared.rstd1 = stat({R});
      shared.qkvr = take({N, QKV});
      shared.atty = take({N, CL});
      shared.lse = stat({B, NH, T});
      shared.residual2 = take({R, C});
      shared.ln2 = take({R, C});
      shared.rstd2 = stat({R});
    }
    for (std::int64_t l = 0; l < layers; ++l) {
      LayerActs la = shared;
      if (!full) {
        la.ln1 = take({R, C});
        la.rstd1 = stat({R});
        la.qkvr = take({N, QKV});
        la.atty = take({N, CL});
        la.lse = stat({B, NH, T});
        la.residual2 = take({R, C});
        la.ln2 = take({R, C});
        la.rstd2 = stat({R});
      }
      if (recompute == Recompute::none) {
        la.gate = take({N, F});
        la.up = take({N, F});
        la.swi = take({N, F});
      }
      la.residual3 = take({R, C});
      a.layers.push_back(la);
    }
    if (shape.head) {
      a.lnf = take({R, C});
      a.rstdf = stat({R});
    }
    if (R != N) {  // the whole tokens' gathered inputs and partial outputs of the split matmuls
      a.full_in = take({N, C});
      a.full_out = take({N, C});
      if (shape.head) a.lnf_full = take({N, C});
    }
    if (shape.head) {
      a.logits = take({N, logits_stride(V)});
      a.losses = stat({N});
    }
  }
  if (shape.grads) {
    g.residual = take({R, C});
    g.lnf = take({R, C});
    const std::size_t scratch_begin = carver.used;
    g.ln1 = take({R, C});
    g.qkv = take({N, QKV});
    g.qkvr = take({N, QKV});
    g.atty = take({N, CL});
    g.ln2 = take({R, C});
    g.gate = take({N, F});
    g.up = take({N, F});
    g.swi = take({N, F});
    g.scratch = carver.raw_since(scratch_begin);
  }
  return carver.used;
}

std::size_t Llama::measure_activations(const config::ModelConfig& config, Recompute recompute, DType compute, int B,
                                       int T, int tensor_size, bool sequence_parallel) {
  Carver carver = Carver::measuring();
  Acts a;
  GradActs g;
  return bind_acts(config, recompute, compute, carver, B, T, a, g, ActsShape{tensor_size, sequence_parallel});
}

std::size_t Llama::activation_bytes(int B, int T) const {
  Carver carver = Carver::measuring();
  Acts a;
  GradActs g;
  return bind_acts(config_, recompute_, compute_, carver, B, T, a, g, acts_shape());
}

void Llama::ensure_acts(int B, int T) {
  if (T < 1 || T > config_.context_length || B < 1) {
    throw RuntimeError("Llama: batch (" + std::to_string(B) + ", " + std::to_string(T) +
                       ") outside the model's context");
  }
  if (B == acts_B_ && T == acts_T_ && std::int64_t(acts_slots_.size()) == slots_) return;
  lay_out_activations(B, T, acts_buffer_, acts_slots_, ga_, [&](Carver& carver, Acts& a, GradActs& g, const ActsShape& shape) {
    return bind_acts(config_, recompute_, compute_, carver, B, T, a, g, shape);
  });
  acts_B_ = B;
  acts_T_ = T;
  take_slot(a_, acts_slots_);
}

void Llama::select_activations() {
  take_slot(a_, acts_slots_);
}

Model::StageIO Llama::stage_io() {
  const Tensor& output = a_.layers.empty() ? a_.encoded : a_.layers.back().residual3;
  return {a_.encoded, output, ga_.residual, ga_.residual};
}

void Llama::forward_mlp(const LayerParams& lp, const LayerActs& la, const Tensor& ln2) {
  const Tensor none;
  ops::matmul_forward(la.gate, ln2, lp.gate, none);
  ops::matmul_forward(la.up, ln2, lp.up, none);
  ops::swiglu_forward(la.swi, la.gate, la.up);
}

void Llama::forward_layer(std::size_t l) {
  const int B = acts_B_, T = acts_T_;
  const std::int64_t NH = NH_, NKV = NKV_, C = NH * HS_;  // this rank's heads and their width
  const auto eps = float(config_.norm_eps), theta = float(config_.rope_theta);
  const LayerParams& lp = p_.layers[l];
  const std::size_t li = l - std::size_t(first_layer());  // this stage's layer index
  const LayerActs& la = a_.layers[li];
  const Tensor& x = li ? a_.layers[li - 1].residual3 : a_.encoded;
  const Tensor none;
  // Tensor parallelism: q, k, v, gate and up see the whole tokens (gathered under sequence
  // parallelism), the o and down outputs are summed over the group (this rank's tokens of them).
  const bool sp = sequence_parallel();
  ops::rmsnorm_forward(la.ln1, la.rstd1, x, lp.in_norm, eps);
  ops::matmul_forward(la.qkv, gathered(la.ln1, a_.full_in), lp.qkv, none);
  ops::rope_forward(la.qkvr.reshape({B, T, NH + 2 * NKV, HS_}), la.qkv.reshape({B, T, NH + 2 * NKV, HS_}), theta,
                    rotated_heads());
  ops::flash_attention_forward(la.atty.reshape({B, T, C}), la.lse, la.qkvr.reshape({B, T, QKV_}), int(NH), int(NKV),
                               attention_kernels_);
  ops::matmul_forward(sp ? a_.full_out : la.attproj, la.atty, lp.o, none);
  reduce_rows(sp ? a_.full_out : la.attproj, la.attproj);
  ops::residual_forward(la.residual2, x, la.attproj);
  ops::rmsnorm_forward(la.ln2, la.rstd2, la.residual2, lp.post_norm, eps);
  forward_mlp(lp, la, gathered(la.ln2, a_.full_in));
  ops::matmul_forward(sp ? a_.full_out : la.down, la.swi, lp.down, none);
  reduce_rows(sp ? a_.full_out : la.down, la.down);
  ops::residual_forward(la.residual3, la.residual2, la.down);
}

double Llama::forward(const std::int32_t* inputs, const std::int32_t* targets, int B, int T, float dloss_scale) {
  ensure_acts(B, T);
  prepare_weights();
  inputs_upload_.upload(a_.inputs, Tensor(const_cast<std::int32_t*>(inputs), DType::i32, Device::cpu, {B, T}));
  notify(UnitEvent::forward_begins);
  if (first_stage()) {  // a later pipeline stage's input is the previous stage's output (stage_io)
    const Tensor embedded = sequence_parallel() ? a_.full_out : a_.encoded;
    embed(embedded.reshape({B, T, config_.d_model}), inputs, a_.inputs, p_.embed, Tensor());
    reduce_rows(embedded, a_.encoded);
  }
  for (std::size_t li = 0; li < a_.layers.size(); ++li) {
    const std::size_t l = std::size_t(first_layer()) + li;
    notify(UnitEvent::before_forward, int(l));
    forward_layer(l);
    notify(UnitEvent::after_forward, int(l));
  }
  if (!last_stage()) return 0.0;  // its output goes to the next stage
  const Tensor& last = a_.layers.empty() ? a_.encoded : a_.layers.back().residual3;
  ops::rmsnorm_forward(a_.lnf, a_.rstdf, last, p_.norm, float(config_.norm_eps));
  ops::matmul_forward(a_.logits, gathered(a_.lnf, a_.lnf_full), p_.head, Tensor());
  if (!targets) return 0.0;
  targets_upload_.upload(a_.targets,
                         Tensor(const_cast<std::int32_t*>(targets), DType::i32, Device::cpu, {a_.targets.shape[0]}));
  return classify(a_.logits, a_.losses, a_.targets, dloss_scale);
}

void Llama::backward(const std::function<void(std::int64_t)>& grads_ready) {
  const int B = acts_B_, T = acts_T_;
  const std::int64_t C = config_.d_model, NH = NH_, NKV = NKV_, CL = NH * HS_;  // CL: this rank's heads' width
  const float theta = float(config_.rope_theta);
  const Tensor none;
  const Tensor& dlogits = a_.logits;  // fused_classifier left the gradient there
  // d(residual stream): each residual connection adds its branch's input gradient in place.
  // Tensor parallelism: the input gradients of the split matmuls (the head, qkv, gate and up) are
  // summed over the group (this rank's tokens of them under sequence parallelism, whose norms then
  // see only those tokens: their weights' gradients are summed too); the outputs' gradients the
  // o and down backward needs are gathered whole.
  const bool sp = sequence_parallel();
  const Tensor& dresidual = ga_.residual;
  if (last_stage()) {  // an earlier pipeline stage starts from the next stage's gradient (stage_io)
    ops::zero(dresidual);
    const Tensor dlnf = sp ? a_.full_out : ga_.lnf;  // the head's partial input gradient
    ops::matmul_backward(dlnf, g_.head, none, dlogits, sp ? a_.lnf_full : a_.lnf, p_.head, ops::Accumulate::no);
    reduce_rows(dlnf, ga_.lnf);  // each rank's vocabulary rows' share
    const Tensor& last = a_.layers.empty() ? a_.encoded : a_.layers.back().residual3;
    norm_backward(norm_grads(g_.norm, C),
                  [&] { ops::rmsnorm_backward(dresidual, g_.norm, ga_.lnf, last, p_.norm, a_.rstdf); });
  }
  for (std::size_t li = a_.layers.size(); li-- > 0;) {
    const std::size_t l = std::size_t(first_layer()) + li;
    const LayerParams& lp = p_.layers[l];
    const LayerParams& lg = g_.layers[l];
    const LayerActs& la = a_.layers[li];
    const Tensor& x = li ? a_.layers[li - 1].residual3 : a_.encoded;
    notify(UnitEvent::before_backward, int(l));
    if (recompute_ == Recompute::full) {
      forward_layer(l);
    } else if (recompute_ == Recompute::mlp) {
      forward_mlp(lp, la, gathered(la.ln2, a_.full_in));
    }
    // Each activation gradient's first writer writes it (no zeroing), except those that the
    // accumulating elementwise and rotary backwards write first.
    ops::zero(ga_.gate);
    ops::zero(ga_.up);
    ops::zero(ga_.qkv);
    // MLP branch: residual3 = residual2 + down(swiglu(gate(ln2), up(ln2))).
    ops::matmul_backward(ga_.swi, lg.down, none, gathered(dresidual, a_.full_in), la.swi, lp.down, ops::Accumulate::no);
    ops::swiglu_backward(ga_.gate, ga_.up, ga_.swi, la.gate, la.up);
    const Tensor dln2 = sp ? a_.full_out : ga_.ln2;
    const Tensor ln2 = gathered(la.ln2, a_.full_in);
    ops::matmul_backward(dln2, lg.gate, none, ga_.gate, ln2, lp.gate, ops::Accumulate::no);
    ops::matmul_backward(dln2, lg.up, none, ga_.up, ln2, lp.up);
    reduce_rows(dln2, ga_.ln2);
    norm_backward(norm_grads(lg.post_norm, C), [&] {
      ops::rmsnorm_backward(dresidual, lg.post_norm, ga_.ln2, la.residual2, lp.post_norm, la.rstd2);
    });
    // Attention branch: residual2 = x + o(attention(rope(qkv(ln1)))).
    ops::matmul_backward(ga_.atty, lg.o, none, gathered(dresidual, a_.full_in), la.atty, lp.o, ops::Accumulate::no);
    ops::flash_attention_backward(ga_.qkvr.reshape({B, T, QKV_}), ga_.atty.reshape({B, T, CL}),
                                  la.qkvr.reshape({B, T, QKV_}), la.atty.reshape({B, T, CL}), la.lse, int(NH), int(NKV),
                                  attention_kernels_, ops::Accumulate::no);
    ops::rope_backward(ga_.qkv.reshape({B, T, NH + 2 * NKV, HS_}), ga_.qkvr.reshape({B, T, NH + 2 * NKV, HS_}), theta,
                       rotated_heads());
    const Tensor dln1 = sp ? a_.full_out : ga_.ln1;
    const Tensor ln1 = gathered(la.ln1, a_.full_in);
    if (kv_sharers_ > 1) {
      backward_qkv_shared_kv(l, dln1, ln1);
    } else {
      ops::matmul_backward(dln1, lg.qkv, none, ga_.qkv, ln1, lp.qkv, ops::Accumulate::no);
    }
    reduce_rows(dln1, ga_.ln1);
    norm_backward(norm_grads(lg.in_norm, C), [&] { ops::rmsnorm_backward(dresidual, lg.in_norm, ga_.ln1, x, lp.in_norm, la.rstd1); });
    notify(UnitEvent::after_backward, int(l));
    if (grads_ready) grads_ready(layer_grads_end(std::int64_t(l)));
  }
  // A later pipeline stage's input gradient goes to the previous stage (stage_io).
  if (first_stage()) embed_backward(g_.embed, Tensor(), gathered(dresidual, a_.full_in).reshape({B, T, C}), a_.inputs);
  notify(UnitEvent::backward_ends);
  if (grads_ready) grads_ready(num_params());
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
  const Tensor mine(base + std::int64_t(layout_.tensor_rank / kv_sharers_) * kv, DType::f32, device_, {kv});
  const Tensor grad(lg.qkv.as<float>() + NH_ * HS_ * C, DType::f32, device_, {kv});
  ops::copy(kept, grad);
  ops::zero(grad);
  ops::matmul_backward(dln1, lg.qkv, Tensor(), ga_.qkv, ln1, lp.qkv, ops::Accumulate::no);
  ops::zero(slots);
  ops::copy(mine, grad);
  tensor_sum(slots);
  ops::residual_forward(grad, kept, mine);
}

Tensor Llama::logits() {
  if (tensor_size() > 1) throw RuntimeError("Llama::logits: each rank holds only its vocabulary columns");
  return unpadded_logits(a_.logits, logits_f32_).reshape({acts_B_, acts_T_, config_.vocab_size});
}

void Llama::ensure_decoder() {
  if (d_.buffer.data()) return;
  const std::int64_t C = config_.d_model, F = config_.ffn_hidden, V = config_.vocab_size,
                     maxT = config_.context_length, KVC = config_.n_kv_head * HS_;
  for (const bool measure : {true, false}) {
    Carver carver{measure ? nullptr : static_cast<char*>(d_.buffer.data()), device_};
    const auto take = [&](std::initializer_list<std::int64_t> shape) { return carver.take(compute_, shape); };
    d_.token = carver.take(DType::i32, {1, 1});
    d_.x = take({1, C});
    d_.ln = take({1, C});
    d_.rstd = carver.take(DType::f32, {1});
    d_.qkv = take({1, QKV_});
    d_.qkvr = take({1, QKV_});
    d_.atty = take({1, C});
    d_.proj = take({1, C});
    d_.x2 = take({1, C});
    d_.gate = take({1, F});
    d_.up = take({1, F});
    d_.swi = take({1, F});
    d_.logits = take({1, V});
    d_.k_cache.clear();
    d_.v_cache.clear();
    for (std::int64_t l = 0; l < config_.n_layer; ++l) {
      d_.k_cache.push_back(take({maxT, KVC}));
      d_.v_cache.push_back(take({maxT, KVC}));
    }
    if (measure) d_.buffer = ops::Buffer(device_, carver.used);
  }
}

Tensor Llama::decode_step(std::int32_t token, int pos) {
  if (pos < 0 || pos >= config_.context_length) {
    throw RuntimeError("Llama::decode_step: position " + std::to_string(pos) + " outside the context");
  }
  if (tensor_size() > 1) throw RuntimeError("Llama::decode_step: not under tensor parallelism");
  ensure_decoder();
  if (pos == 0) prepare_weights();
  const std::int64_t C = config_.d_model, NH = config_.n_head, NKV = config_.n_kv_head, KVC = NKV * HS_;
  const auto eps = float(config_.norm_eps), theta = float(config_.rope_theta);
  const Tensor none;
  ops::copy(d_.token, Tensor(&token, DType::i32, Device::cpu, {1, 1}));
  ops::encoder_forward(d_.x.reshape({1, 1, C}), d_.token, p_.embed, none);
  for (std::size_t l = 0; l < p_.layers.size(); ++l) {
    const LayerParams& lp = p_.layers[l];
    ops::rmsnorm_forward(d_.ln, d_.rstd, d_.x, lp.in_norm, eps);
    ops::matmul_forward(d_.qkv, d_.ln, lp.qkv, none);
    ops::rope_forward(d_.qkvr.reshape({1, 1, NH + 2 * NKV, HS_}), d_.qkv.reshape({1, 1, NH + 2 * NKV, HS_}), theta,
                      rotated_heads(), pos);
    ops::copy(row_slice(d_.k_cache[l], pos, 0, KVC), row_slice(d_.qkvr, 0, C, KVC));
    ops::copy(row_slice(d_.v_cache[l], pos, 0, KVC), row_slice(d_.qkvr, 0, C + KVC, KVC));
    ops::attention_decode(d_.atty.reshape({C}), row_slice(d_.qkvr, 0, 0, C), d_.k_cache[l], d_.v_cache[l], pos, int(NH),
                          int(NKV));
    ops::matmul_forward(d_.proj, d_.atty, lp.o, none);
    ops::residual_forward(d_.x2, d_.x, d_.proj);
    ops::rmsnorm_forward(d_.ln, d_.rstd, d_.x2, lp.post_norm, eps);
    ops::matmul_forward(d_.gate, d_.ln, lp.gate, none);
    ops::matmul_forward(d_.up, d_.ln, lp.up, none);
    ops::swiglu_forward(d_.swi, d_.gate, d_.up);
    ops::matmul_forward(d_.proj, d_.swi, lp.down, none);
    ops::residual_forward(d_.x, d_.x2, d_.proj);
  }
  ops::rmsnorm_forward(d_.ln, d_.rstd, d_.x, p_.norm, eps);
  ops::matmul_forward(d_.logits, d_.ln, p_.head, none);
  return as_f32(d_.logits, logits_f32_).reshape({config_.vocab_size});
}

}  // namespace llmtrain::model
