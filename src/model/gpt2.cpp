#include "model/gpt2.h"

#include <cmath>
#include <cstring>

#include "core/error.h"
#include "core/rng.h"
#include "ops/ops.h"

namespace llmtrain::model {
namespace {

// Calls f(name, shape, slot) for every parameter of layer l, in flat-buffer order.
template <class LayerT, class F>
void for_each_layer_param(const config::ModelConfig& c, std::int64_t l, LayerT& layer, F&& f) {
  const std::int64_t C = c.d_model, F4 = c.ffn_hidden;
  const std::string h = "transformer.h." + std::to_string(l) + ".";
  f(h + "ln_1.weight", std::vector<std::int64_t>{C}, layer.ln1_w);
  f(h + "ln_1.bias", std::vector<std::int64_t>{C}, layer.ln1_b);
  f(h + "attn.c_attn.weight", std::vector<std::int64_t>{3 * C, C}, layer.qkv_w);
  f(h + "attn.c_attn.bias", std::vector<std::int64_t>{3 * C}, layer.qkv_b);
  f(h + "attn.c_proj.weight", std::vector<std::int64_t>{C, C}, layer.attproj_w);
  f(h + "attn.c_proj.bias", std::vector<std::int64_t>{C}, layer.attproj_b);
  f(h + "ln_2.weight", std::vector<std::int64_t>{C}, layer.ln2_w);
  f(h + "ln_2.bias", std::vector<std::int64_t>{C}, layer.ln2_b);
  f(h + "mlp.c_fc.weight", std::vector<std::int64_t>{F4, C}, layer.fc_w);
  f(h + "mlp.c_fc.bias", std::vector<std::int64_t>{F4}, layer.fc_b);
  f(h + "mlp.c_proj.weight", std::vector<std::int64_t>{C, F4}, layer.fcproj_w);
  f(h + "mlp.c_proj.bias", std::vector<std::int64_t>{C}, layer.fcproj_b);
}

// Calls f(name, shape, slot) for every parameter, in flat-buffer order.
template <class ParamsT, class F>
void for_each_param(const config::ModelConfig& c, ParamsT& p, F&& f) {
  const std::int64_t C = c.d_model;
  f("transformer.ln_f.weight", std::vector<std::int64_t>{C}, p.lnf_w);
  f("transformer.ln_f.bias", std::vector<std::int64_t>{C}, p.lnf_b);
  for (std::int64_t l = c.n_layer - 1; l >= 0; --l) for_each_layer_param(c, l, p.layers[std::size_t(l)], f);
  f("transformer.wpe.weight", std::vector<std::int64_t>{c.context_length, C}, p.wpe);
  f("transformer.wte.weight", std::vector<std::int64_t>{c.vocab_size, C}, p.wte);
}

}  // namespace

Gpt2::Gpt2(const config::ModelConfig& config, Device device, Recompute recompute, DType compute,
           ops::AttentionKernels attention, Layout layout)
    : Model(config, device, compute, attention, layout), recompute_(recompute) {
  if (config.arch != config::Arch::gpt2) {
    throw RuntimeError("Gpt2: config has model.arch \"" + config::to_string(config.arch) + "\"");
  }
  if (config.n_head % layout.tensor_size != 0 || config.ffn_hidden % layout.tensor_size != 0) {
    throw InputError("dist.tensor_parallel = " + std::to_string(layout.tensor_size) + " must divide model.n_head (" +
                     std::to_string(config.n_head) + ") and model.ffn_hidden (" + std::to_string(config.ffn_hidden) + ")");
  }
  Params params;
  params.layers.resize(std::size_t(config.n_layer));
  // Pipeline stages: the first holds wpe and wte, the last ln_f and wte (the tied head).
  const auto held = [&](const std::string& name) {
    if (name.starts_with("transformer.ln_f.")) return holds_last_stage();
    if (name == "transformer.wpe.weight") return holds_first_stage();
    if (name == "transformer.wte.weight") return holds_first_stage() || holds_last_stage();
    return true;  // a layer's: add_param keeps this stage's
  };
  for_each_param(config_, params, [&](const std::string& name, const std::vector<std::int64_t>& shape, Tensor&) {
    add_param(name, shape, slice_of(name), held(name));
  });
  allocate();
  p_ = bind_params(false);
  g_ = bind_params(true);
}

TensorSlice Gpt2::slice_of(const std::string& name) const {
  const std::int64_t C = config_.d_model, F4 = config_.ffn_hidden;
  // Megatron's split: c_attn and c_fc by output rows (c_attn's q, k and v each by heads), their
  // c_proj by input columns (summed after), the token embedding by vocabulary rows.
  if (name.ends_with("attn.c_attn.weight") || name.ends_with("attn.c_attn.bias")) {
    TensorSlice heads = even_part(0, C);
    if (heads.whole()) return heads;
    const auto [first, count] = heads.blocks[0];
    return {0, {{first, count}, {C + first, count}, {2 * C + first, count}}};
  }
  if (name.ends_with("attn.c_proj.weight")) return even_part(1, C);
  if (name.ends_with("mlp.c_fc.weight") || name.ends_with("mlp.c_fc.bias")) return even_part(0, F4);
  if (name.ends_with("mlp.c_proj.weight")) return even_part(1, F4);
  if (name == "transformer.wte.weight") {
    TensorSlice rows = tensor_size() > 1 ? TensorSlice{0, {{vocab_begin(), vocab_end() - vocab_begin()}}} : TensorSlice{};
    rows.owner = holds_first_stage();  // the last pipeline stage's (the tied head's) is a copy
    return rows;
  }
  return {};
}

std::int64_t Gpt2::parameter_count(const config::ModelConfig& config) {
  Params layout;
  layout.layers.resize(std::size_t(config.n_layer));
  std::int64_t count = 0;
  for_each_param(config, layout, [&](const std::string&, const std::vector<std::int64_t>& shape, Tensor&) {
    std::int64_t numel = 1;
    for (const auto d : shape) numel *= d;
    count += numel;
  });
  return count;
}

Gpt2::Params Gpt2::bind_params(bool grads) const {
  Params p;
  p.layers.resize(std::size_t(config_.n_layer));
  bind_roots(p, grads);
  for (std::int64_t l = 0; l < config_.n_layer; ++l) {
    if (holds_layer(l)) p.layers[std::size_t(l)] = bind_layer(l, grads);
  }
  return p;
}

void Gpt2::bind_roots(Params& p, bool grads) const {
  const auto bind = [&](const std::string& name) { return has_param(name) ? param_named(name, grads) : Tensor(); };
  p.lnf_w = bind("transformer.ln_f.weight");
  p.lnf_b = bind("transformer.ln_f.bias");
  p.wpe = bind("transformer.wpe.weight");
  p.wte = bind("transformer.wte.weight");
}

Gpt2::LayerParams Gpt2::bind_layer(std::int64_t l, bool grads) const {
  LayerParams lp;
  for_each_layer_param(config_, l, lp, [&](const std::string& name, const std::vector<std::int64_t>&, Tensor& slot) {
    slot = param_named(name, grads);
  });
  return lp;
}

void Gpt2::bind_unit(const Unit& unit) {
  if (unit.layer >= 0) {
    p_.layers[std::size_t(unit.layer)] = bind_layer(unit.layer, false);
    g_.layers[std::size_t(unit.layer)] = bind_layer(unit.layer, true);
    return;
  }
  bind_roots(p_, false);
  bind_roots(g_, true);
}

void Gpt2::init_weights(std::uint64_t seed) {
  const float residual_std = 0.02f / std::sqrt(2.0f * float(config_.n_layer));
  for (const auto& info : param_infos()) {
    if (info.shape.size() == 1) {
      const bool layernorm_weight = info.name.find(".ln_") != std::string::npos && info.name.ends_with(".weight");
      init_constant(info, layernorm_weight ? 1.0f : 0.0f);
      continue;
    }
    init_normal(info, seed, info.name.ends_with("c_proj.weight") ? residual_std : 0.02f);
  }
}

std::size_t Gpt2::bind_acts(const config::ModelConfig& config, Recompute recompute, DType compute, Carver& carver,
                           int B, int T, Acts& a, GradActs& g, const ActsShape& shape) {
  // Under tensor parallelism this rank's attention heads, MLP columns and vocabulary rows (at most);
  // with sequence parallelism R of the N tokens in the residual stream, its norms and their
  // gradients; under pipeline parallelism this stage's layers.
  const int ts = shape.tensor_size;
  const std::int64_t N = std::int64_t(B) * T, R = shape.sequence_parallel ? N / ts : N, C = config.d_model,
                     CL = C / ts, F4 = config.ffn_hidden / ts, V = (config.vocab_size + ts - 1) / ts,
                     NH = config.n_head / ts, layers = shape.layers < 0 ? config.n_layer : shape.layers;
  // Activations in the compute dtype; statistics (means, rstds, lse, losses) always f32.
  const auto take = [&](std::initializer_list<std::int64_t> dims) { return carver.take(compute, dims); };
  const auto stat = [&](std::initializer_list<std::int64_t> dims) { return carver.take(DType::f32, dims); };
  if (shape.acts) {
    a = Acts();
    a.inputs = carver.take(DType::i32, {B, T});
    a.targets = carver.take(DType::i32, {N});
    a.encoded = take({R, C});

    // One copy shared by all layers: the two branch outputs (backward never reads them) and what
    // backward recomputes.
    LayerActs shared;
    shared.attproj = take({R, C});
    shared.fcproj = take({R, C});
    const bool full = recompute == Recompute::full;
    if (recompute != Recompute::none) {
      shared.fch = take({N, F4});
      shared.fch_gelu = take({N, F4});
    }
    const auto attention_block = [&](LayerActs& la) {
      la.ln1 = take({R, C});
      la.ln1_mean = stat({R});
      la.ln1_rstd = stat({R});
      la.qkv = take({N, 3 * CL});
      la.atty = take({N, CL});
      la.lse = stat({B, NH, T});
      la.residual2 = take({R, C});
      la.ln2 = take({R, C});
      la.ln2_mean = stat({R});
      la.ln2_rstd = stat({R});
    };
    if (full) attention_block(shared);
    for (std::int64_t l = 0; l < layers; ++l) {
      LayerActs la = shared;
      if (!full) attention_block(la);
      if (recompute == Recompute::none) {
        la.fch = take({N, F4});
        la.fch_gelu = take({N, F4});
      }
      la.residual3 = take({R, C});
      a.layers.push_back(la);
    }
    if (shape.head) {
      a.lnf = take({R, C});
      a.lnf_mean = stat({R});
      a.lnf_rstd = stat({R});
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
    g.qkv = take({N, 3 * CL});
    g.atty = take({N, CL});
    g.ln2 = take({R, C});
    g.fch = take({N, F4});
    g.scratch = carver.raw_since(scratch_begin);
  }
  return carver.used;
}

std::size_t Gpt2::measure_activations(const config::ModelConfig& config, Recompute recompute, DType compute, int B,
                                      int T, int tensor_size, bool sequence_parallel) {
  Carver carver = Carver::measuring();
  Acts a;
  GradActs g;
  return bind_acts(config, recompute, compute, carver, B, T, a, g, ActsShape{tensor_size, sequence_parallel});
}

std::size_t Gpt2::activation_bytes(int B, int T) const {
  Carver carver = Carver::measuring();
  Acts a;
  GradActs g;
  return bind_acts(config_, recompute_, compute_, carver, B, T, a, g, acts_shape());
}

void Gpt2::ensure_acts(int B, int T) {
  if (T < 1 || T > config_.context_length || B < 1) {
    throw RuntimeError("Gpt2: batch (" + std::to_string(B) + ", " + std::to_string(T) + ") outside the model's context");
  }
  if (B == acts_B_ && T == acts_T_ && std::int64_t(acts_slots_.size()) == slots_) return;
  lay_out_activations(B, T, acts_buffer_, acts_slots_, ga_, [&](Carver& carver, Acts& a, GradActs& g, const ActsShape& shape) {
    return bind_acts(config_, recompute_, compute_, carver, B, T, a, g, shape);
  });
  acts_B_ = B;
  acts_T_ = T;
  take_slot(a_, acts_slots_);
}

void Gpt2::select_activations() {
  take_slot(a_, acts_slots_);
}

Model::StageIO Gpt2::stage_io() {
  const Tensor& output = a_.layers.empty() ? a_.encoded : a_.layers.back().residual3;
  return {a_.encoded, output, ga_.residual, ga_.residual};
}

void Gpt2::forward_mlp(const LayerParams& lp, const LayerActs& la, const Tensor& ln2) {
  ops::matmul_gelu_forward(la.fch_gelu, la.fch, ln2, lp.fc_w, lp.fc_b);  // fch kept for the backward's GELU
}

void Gpt2::forward_layer(std::size_t l) {
  const int B = acts_B_, T = acts_T_;
  const std::int64_t C = config_.d_model / tensor_size();  // this rank's heads' width
  const int NH = int(config_.n_head) / tensor_size();
  const LayerParams& lp = p_.layers[l];
  const std::size_t li = l - std::size_t(first_layer());  // this stage's layer index
  const LayerActs& la = a_.layers[li];
  const Tensor& x = li ? a_.layers[li - 1].residual3 : a_.encoded;
  // Tensor parallelism: c_attn and c_fc see the whole tokens (gathered under sequence
  // parallelism), the two c_proj outputs are summed over the group (this rank's tokens of them).
  const bool sp = sequence_parallel();
  ops::layernorm_forward(la.ln1, la.ln1_mean, la.ln1_rstd, x, lp.ln1_w, lp.ln1_b);
  ops::matmul_forward(la.qkv, gathered(la.ln1, a_.full_in), lp.qkv_w, lp.qkv_b);
  ops::flash_attention_forward(la.atty.reshape({B, T, C}), la.lse, la.qkv.reshape({B, T, 3 * C}), NH, NH,
                               attention_kernels_);
  ops::matmul_forward(sp ? a_.full_out : la.attproj, la.atty, lp.attproj_w, bias_once(lp.attproj_b));
  reduce_rows(sp ? a_.full_out : la.attproj, la.attproj);
  ops::layernorm_residual_forward(la.residual2, la.ln2, la.ln2_mean, la.ln2_rstd, x, la.attproj, lp.ln2_w, lp.ln2_b);
  forward_mlp(lp, la, gathered(la.ln2, a_.full_in));
  ops::matmul_forward(sp ? a_.full_out : la.fcproj, la.fch_gelu, lp.fcproj_w, bias_once(lp.fcproj_b));
  reduce_rows(sp ? a_.full_out : la.fcproj, la.fcproj);
  ops::residual_forward(la.residual3, la.residual2, la.fcproj);
}

double Gpt2::forward(const std::int32_t* inputs, const std::int32_t* targets, int B, int T, float dloss_scale) {
  ensure_acts(B, T);
  prepare_weights();
  const std::int64_t C = config_.d_model;
  inputs_upload_.upload(a_.inputs, Tensor(const_cast<std::int32_t*>(inputs), DType::i32, Device::cpu, {B, T}));
  notify(UnitEvent::forward_begins);
  if (first_stage()) {  // a later pipeline stage's input is the previous stage's output (stage_io)
    const Tensor embedded = sequence_parallel() ? a_.full_out : a_.encoded;
    embed(embedded.reshape({B, T, C}), inputs, a_.inputs, p_.wte, p_.wpe);
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
  ops::layernorm_forward(a_.lnf, a_.lnf_mean, a_.lnf_rstd, last, p_.lnf_w, p_.lnf_b);
  ops::matmul_forward(a_.logits, gathered(a_.lnf, a_.lnf_full), p_.wte, Tensor());  // tied embeddings
  if (!targets) return 0.0;
  targets_upload_.upload(a_.targets,
                         Tensor(const_cast<std::int32_t*>(targets), DType::i32, Device::cpu, {a_.targets.shape[0]}));
  return classify(a_.logits, a_.losses, a_.targets, dloss_scale);
}

void Gpt2::backward(const std::function<void(std::int64_t)>& grads_ready) {
  const int B = acts_B_, T = acts_T_;
  const std::int64_t C = config_.d_model, CL = C / tensor_size();  // CL: this rank's heads' width
  const int NH = int(config_.n_head) / tensor_size();
  const Tensor none;
  const Tensor& dlogits = a_.logits;  // fused_classifier left the gradient there
  // d(residual stream): each residual connection adds its branch's input gradient in place.
  // Tensor parallelism: the input gradients of the split matmuls (the head, c_attn, c_fc) are
  // summed over the group (this rank's tokens of them under sequence parallelism, whose norms
  // then see only those tokens: their weights' gradients are summed too); the outputs' gradients
  // the c_proj backward needs are gathered whole.
  const bool sp = sequence_parallel();
  const Tensor& dresidual = ga_.residual;
  if (last_stage()) {  // an earlier pipeline stage starts from the next stage's gradient (stage_io)
    ops::zero(dresidual);
    const Tensor dlnf = sp ? a_.full_out : ga_.lnf;  // the head's partial input gradient
    ops::matmul_backward(dlnf, g_.wte, none, dlogits, sp ? a_.lnf_full : a_.lnf, p_.wte, ops::Accumulate::no);
    reduce_rows(dlnf, ga_.lnf);  // each rank's vocabulary rows' share
    const Tensor& last = a_.layers.empty() ? a_.encoded : a_.layers.back().residual3;
    norm_backward(norm_grads(g_.lnf_w, 2 * C), [&] {
      ops::layernorm_backward(dresidual, g_.lnf_w, g_.lnf_b, ga_.lnf, last, p_.lnf_w, a_.lnf_mean, a_.lnf_rstd);
    });
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
    // Each activation gradient's first writer writes it (no zeroing).
    // MLP branch: residual3 = residual2 + c_proj(gelu(c_fc(ln2))).
    // c_proj's input gradient through the GELU (and c_fc's bias gradient) in one matmul.
    ops::matmul_backward_dgelu(ga_.fch, lg.fcproj_w, lg.fcproj_b, lg.fc_b, gathered(dresidual, a_.full_in),
                               la.fch_gelu, la.fch, lp.fcproj_w);
    ops::matmul_backward(sp ? a_.full_out : ga_.ln2, lg.fc_w, none, ga_.fch, gathered(la.ln2, a_.full_in), lp.fc_w,
                         ops::Accumulate::no);
    reduce_rows(sp ? a_.full_out : ga_.ln2, ga_.ln2);
    norm_backward(norm_grads(lg.ln2_w, 2 * C), [&] {
      ops::layernorm_backward(dresidual, lg.ln2_w, lg.ln2_b, ga_.ln2, la.residual2, lp.ln2_w, la.ln2_mean, la.ln2_rstd);
    });
    // Attention branch: residual2 = x + c_proj(attention(c_attn(ln1))).
    ops::matmul_backward(ga_.atty, lg.attproj_w, lg.attproj_b, gathered(dresidual, a_.full_in), la.atty,
                         lp.attproj_w, ops::Accumulate::no);
    ops::flash_attention_backward(ga_.qkv.reshape({B, T, 3 * CL}), ga_.atty.reshape({B, T, CL}),
                                  la.qkv.reshape({B, T, 3 * CL}), la.atty.reshape({B, T, CL}), la.lse, NH, NH,
                                  attention_kernels_, ops::Accumulate::no);
    ops::matmul_backward(sp ? a_.full_out : ga_.ln1, lg.qkv_w, lg.qkv_b, ga_.qkv, gathered(la.ln1, a_.full_in),
                         lp.qkv_w, ops::Accumulate::no);
    reduce_rows(sp ? a_.full_out : ga_.ln1, ga_.ln1);
    norm_backward(norm_grads(lg.ln1_w, 2 * C), [&] {
      ops::layernorm_backward(dresidual, lg.ln1_w, lg.ln1_b, ga_.ln1, x, lp.ln1_w, la.ln1_mean, la.ln1_rstd);
    });
    notify(UnitEvent::after_backward, int(l));
    if (grads_ready) grads_ready(layer_grads_end(std::int64_t(l)));
  }
  // A later pipeline stage's input gradient goes to the previous stage (stage_io).
  if (first_stage()) embed_backward(g_.wte, g_.wpe, gathered(dresidual, a_.full_in).reshape({B, T, C}), a_.inputs);
  notify(UnitEvent::backward_ends);
  if (grads_ready) grads_ready(num_params());
}

void Gpt2::ensure_decoder() {
  if (d_.buffer.data()) return;
  const std::int64_t C = config_.d_model, F4 = config_.ffn_hidden, V = config_.vocab_size,
                     maxT = config_.context_length;
  for (const bool measure : {true, false}) {
    Carver carver{measure ? nullptr : static_cast<char*>(d_.buffer.data()), device_};
    d_.token = carver.take(DType::i32, {1, 1});
    d_.x = carver.take(compute_, {1, C});
    d_.ln = carver.take(compute_, {1, C});
    d_.mean = carver.take(DType::f32, {1});
    d_.rstd = carver.take(DType::f32, {1});
    d_.qkv = carver.take(compute_, {1, 3 * C});
    d_.atty = carver.take(compute_, {1, C});
    d_.proj = carver.take(compute_, {1, C});
    d_.x2 = carver.take(compute_, {1, C});
    d_.fch = carver.take(compute_, {1, F4});
    d_.fch_gelu = carver.take(compute_, {1, F4});
    d_.logits = carver.take(compute_, {1, V});
    d_.k_cache.clear();
    d_.v_cache.clear();
    for (std::int64_t l = 0; l < config_.n_layer; ++l) {
      d_.k_cache.push_back(carver.take(compute_, {maxT, C}));
      d_.v_cache.push_back(carver.take(compute_, {maxT, C}));
    }
    if (measure) d_.buffer = ops::Buffer(device_, carver.used);
  }
}

Tensor Gpt2::decode_step(std::int32_t token, int pos) {
  if (pos < 0 || pos >= config_.context_length) {
    throw RuntimeError("Gpt2::decode_step: position " + std::to_string(pos) + " outside the context");
  }
  if (tensor_size() > 1) throw RuntimeError("Gpt2::decode_step: not under tensor parallelism");
  ensure_decoder();
  if (pos == 0) prepare_weights();
  const std::int64_t C = config_.d_model;
  const int NH = int(config_.n_head);
  const auto row = [&](const Tensor& t, std::int64_t r, std::int64_t offset, std::int64_t width) {
    char* base = static_cast<char*>(t.data) + std::size_t(r * t.shape[1] + offset) * dtype_size(t.dtype);
    return Tensor(base, t.dtype, t.device, {width});
  };
  ops::copy(d_.token, Tensor(&token, DType::i32, Device::cpu, {1, 1}));
  // Position `pos` of the table is position 0 of this view.
  const Tensor wpe_from_pos(static_cast<char*>(p_.wpe.data) + std::size_t(pos * C) * dtype_size(p_.wpe.dtype),
                            p_.wpe.dtype, device_, {1, C});
  ops::encoder_forward(d_.x.reshape({1, 1, C}), d_.token, p_.wte, wpe_from_pos);
  for (std::size_t l = 0; l < p_.layers.size(); ++l) {
    const LayerParams& lp = p_.layers[l];
    ops::layernorm_forward(d_.ln, d_.mean, d_.rstd, d_.x, lp.ln1_w, lp.ln1_b);
    ops::matmul_forward(d_.qkv, d_.ln, lp.qkv_w, lp.qkv_b);
    ops::copy(row(d_.k_cache[l], pos, 0, C), row(d_.qkv, 0, C, C));
    ops::copy(row(d_.v_cache[l], pos, 0, C), row(d_.qkv, 0, 2 * C, C));
    ops::attention_decode(d_.atty.reshape({C}), row(d_.qkv, 0, 0, C), d_.k_cache[l], d_.v_cache[l], pos, NH);
    ops::matmul_forward(d_.proj, d_.atty, lp.attproj_w, lp.attproj_b);
    ops::residual_forward(d_.x2, d_.x, d_.proj);
    ops::layernorm_forward(d_.ln, d_.mean, d_.rstd, d_.x2, lp.ln2_w, lp.ln2_b);
    ops::matmul_forward(d_.fch, d_.ln, lp.fc_w, lp.fc_b);
    ops::gelu_forward(d_.fch_gelu, d_.fch);
    ops::matmul_forward(d_.proj, d_.fch_gelu, lp.fcproj_w, lp.fcproj_b);
    ops::residual_forward(d_.x, d_.x2, d_.proj);
  }
  ops::layernorm_forward(d_.ln, d_.mean, d_.rstd, d_.x, p_.lnf_w, p_.lnf_b);
  ops::matmul_forward(d_.logits, d_.ln, p_.wte, Tensor());
  return as_f32(d_.logits, logits_f32_).reshape({config_.vocab_size});
}

Tensor Gpt2::logits() {
  if (tensor_size() > 1) throw RuntimeError("Gpt2::logits: each rank holds only its vocabulary columns");
  return unpadded_logits(a_.logits, logits_f32_).reshape({acts_B_, acts_T_, config_.vocab_size});
}

}  // namespace llmtrain::model
