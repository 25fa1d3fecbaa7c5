#include "model/gpt2.h"

#include <cmath>
#include <cstring>

#include "core/error.h"
#include "core/rng.h"
#include "ops/nn.h"

namespace llmtrain::model {
namespace {

// Calls f(name, shape, slot) for every parameter, in flat-buffer order.
template <class ParamsT, class F>
void for_each_param(const config::ModelConfig& c, ParamsT& p, F&& f) {
  const std::int64_t C = c.d_model, F4 = c.ffn_hidden;
  f("transformer.ln_f.weight", std::vector<std::int64_t>{C}, p.lnf_w);
  f("transformer.ln_f.bias", std::vector<std::int64_t>{C}, p.lnf_b);
  for (std::int64_t l = c.n_layer - 1; l >= 0; --l) {
    const std::string h = "transformer.h." + std::to_string(l) + ".";
    auto& layer = p.layers[std::size_t(l)];
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
  f("transformer.wpe.weight", std::vector<std::int64_t>{c.context_length, C}, p.wpe);
  f("transformer.wte.weight", std::vector<std::int64_t>{c.vocab_size, C}, p.wte);
}

}  // namespace

Gpt2::Gpt2(const config::ModelConfig& config, Device device, Recompute recompute, DType compute)
    : Model(config, device, compute) {
  if (config.arch != "gpt2") throw RuntimeError("Gpt2: config has model.arch \"" + config.arch + "\"");
  if (recompute != Recompute::none) {
    throw InputError("train.recompute: activation recomputation is implemented for llama models only so far");
  }
  Params layout;
  layout.layers.resize(std::size_t(config.n_layer));
  for_each_param(config_, layout, [&](const std::string& name, const std::vector<std::int64_t>& shape, Tensor&) {
    add_param(name, shape);
  });
  allocate();
  // Layer l's parameters end where those of layer l - 1 (or, for layer 0, wpe) begin.
  for (std::int64_t l = 0; l < config.n_layer; ++l) {
    layer_grads_end_.push_back(
        offset_of(l == 0 ? "transformer.wpe.weight" : "transformer.h." + std::to_string(l - 1) + ".ln_1.weight"));
  }
  p_ = bind_params(false);
  g_ = bind_params(true);
}

Gpt2::Params Gpt2::bind_params(bool grads) const {
  Params p;
  p.layers.resize(std::size_t(config_.n_layer));
  std::size_t index = 0;
  for_each_param(config_, p, [&](const std::string&, const std::vector<std::int64_t>&, Tensor& slot) {
    const ParamInfo& info = param_infos()[index++];
    slot = grads ? grad(info) : weight(info);
  });
  return p;
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

Gpt2::Acts Gpt2::bind_acts(ops::Buffer& buffer, int B, int T, bool measure_only, std::size_t* bytes) const {
  Carver carver{measure_only ? nullptr : static_cast<char*>(buffer.data()), device_};
  const std::int64_t N = std::int64_t(B) * T, C = config_.d_model, F4 = config_.ffn_hidden, V = config_.vocab_size,
                     NH = config_.n_head;
  Acts a;
  a.inputs = carver.take(DType::i32, {B, T});
  a.targets = carver.take(DType::i32, {N});
  a.encoded = carver.take(compute_, {N, C});
  for (std::int64_t l = 0; l < config_.n_layer; ++l) {
    LayerActs la;
    la.ln1 = carver.take(compute_, {N, C});
    la.ln1_mean = carver.take(DType::f32, {N});
    la.ln1_rstd = carver.take(DType::f32, {N});
    la.qkv = carver.take(compute_, {N, 3 * C});
    la.atty = carver.take(compute_, {N, C});
    la.lse = carver.take(DType::f32, {B, NH, T});
    la.attproj = carver.take(compute_, {N, C});
    la.residual2 = carver.take(compute_, {N, C});
    la.ln2 = carver.take(compute_, {N, C});
    la.ln2_mean = carver.take(DType::f32, {N});
    la.ln2_rstd = carver.take(DType::f32, {N});
    la.fch = carver.take(compute_, {N, F4});
    la.fch_gelu = carver.take(compute_, {N, F4});
    la.fcproj = carver.take(compute_, {N, C});
    la.residual3 = carver.take(compute_, {N, C});
    a.layers.push_back(la);
  }
  a.lnf = carver.take(compute_, {N, C});
  a.lnf_mean = carver.take(DType::f32, {N});
  a.lnf_rstd = carver.take(DType::f32, {N});
  a.logits = carver.take(compute_, {N, V});
  a.losses = carver.take(DType::f32, {N});
  if (bytes) *bytes = carver.used;
  return a;
}

std::size_t Gpt2::activation_bytes(int B, int T) const {
  std::size_t bytes = 0;
  ops::Buffer none;
  bind_acts(none, B, T, true, &bytes);
  return 2 * bytes;  // values and gradients
}

void Gpt2::ensure_acts(int B, int T) {
  if (T < 1 || T > config_.context_length || B < 1) {
    throw RuntimeError("Gpt2: batch (" + std::to_string(B) + ", " + std::to_string(T) + ") outside the model's context");
  }
  if (B == acts_B_ && T == acts_T_) return;
  std::size_t bytes = 0;
  bind_acts(acts_buffer_, B, T, true, &bytes);
  acts_buffer_ = ops::Buffer(device_, bytes);
  grad_acts_buffer_ = ops::Buffer(device_, bytes);
  a_ = bind_acts(acts_buffer_, B, T, false, nullptr);
  ga_ = bind_acts(grad_acts_buffer_, B, T, false, nullptr);
  acts_B_ = B;
  acts_T_ = T;
}

double Gpt2::forward(const std::int32_t* inputs, const std::int32_t* targets, int B, int T, float dloss_scale) {
  ensure_acts(B, T);
  prepare_weights();
  const std::int64_t C = config_.d_model;
  const int NH = int(config_.n_head);
  ops::copy(a_.inputs, Tensor(const_cast<std::int32_t*>(inputs), DType::i32, Device::cpu, {B, T}));
  const Tensor none;

  ops::encoder_forward(a_.encoded.reshape({B, T, C}), a_.inputs, p_.wte, p_.wpe);
  const Tensor* residual = &a_.encoded;
  for (std::size_t l = 0; l < a_.layers.size(); ++l) {
    const LayerParams& lp = p_.layers[l];
    LayerActs& la = a_.layers[l];
    ops::layernorm_forward(la.ln1, la.ln1_mean, la.ln1_rstd, *residual, lp.ln1_w, lp.ln1_b);
    ops::matmul_forward(la.qkv, la.ln1, lp.qkv_w, lp.qkv_b);
    ops::flash_attention_forward(la.atty.reshape({B, T, C}), la.lse, la.qkv.reshape({B, T, 3 * C}), NH, NH,
                                 attention_kernels_);
    ops::matmul_forward(la.attproj, la.atty, lp.attproj_w, lp.attproj_b);
    ops::residual_forward(la.residual2, *residual, la.attproj);
    ops::layernorm_forward(la.ln2, la.ln2_mean, la.ln2_rstd, la.residual2, lp.ln2_w, lp.ln2_b);
    ops::matmul_forward(la.fch, la.ln2, lp.fc_w, lp.fc_b);
    ops::gelu_forward(la.fch_gelu, la.fch);
    ops::matmul_forward(la.fcproj, la.fch_gelu, lp.fcproj_w, lp.fcproj_b);
    ops::residual_forward(la.residual3, la.residual2, la.fcproj);
    residual = &la.residual3;
  }
  ops::layernorm_forward(a_.lnf, a_.lnf_mean, a_.lnf_rstd, *residual, p_.lnf_w, p_.lnf_b);
  ops::matmul_forward(a_.logits, a_.lnf, p_.wte, none);  // tied embeddings
  if (!targets) return 0.0;
  ops::copy(a_.targets, Tensor(const_cast<std::int32_t*>(targets), DType::i32, Device::cpu, {a_.targets.shape[0]}));
  return ops::fused_classifier(a_.logits, a_.losses, a_.targets, dloss_scale);
}

void Gpt2::backward(const std::function<void(std::int64_t)>& grads_ready) {
  const int B = acts_B_, T = acts_T_;
  const std::int64_t C = config_.d_model;
  const int NH = int(config_.n_head);
  ops::zero(grad_acts_buffer_.view(DType::u16, {std::int64_t(grad_acts_buffer_.bytes() / 2)}));
  const Tensor none;
  const Tensor& dlogits = a_.logits;  // fused_classifier left the gradient there

  ops::matmul_backward(ga_.lnf, g_.wte, none, dlogits, a_.lnf, p_.wte);
  const std::size_t L = a_.layers.size();
  const Tensor& last_residual = L ? a_.layers[L - 1].residual3 : a_.encoded;
  const Tensor& dlast_residual = L ? ga_.layers[L - 1].residual3 : ga_.encoded;
  ops::layernorm_backward(dlast_residual, g_.lnf_w, g_.lnf_b, ga_.lnf, last_residual, p_.lnf_w, a_.lnf_mean,
                          a_.lnf_rstd);
  for (std::size_t l = L; l-- > 0;) {
    const LayerParams& lp = p_.layers[l];
    const LayerParams& lg = g_.layers[l];
    const LayerActs& la = a_.layers[l];
    const LayerActs& lga = ga_.layers[l];
    const Tensor& residual_in = l ? a_.layers[l - 1].residual3 : a_.encoded;
    const Tensor& dresidual_in = l ? ga_.layers[l - 1].residual3 : ga_.encoded;

    ops::residual_backward(lga.residual2, lga.fcproj, lga.residual3);
    ops::matmul_backward(lga.fch_gelu, lg.fcproj_w, lg.fcproj_b, lga.fcproj, la.fch_gelu, lp.fcproj_w);
    ops::gelu_backward(lga.fch, la.fch, lga.fch_gelu);
    ops::matmul_backward(lga.ln2, lg.fc_w, lg.fc_b, lga.fch, la.ln2, lp.fc_w);
    ops::layernorm_backward(lga.residual2, lg.ln2_w, lg.ln2_b, lga.ln2, la.residual2, lp.ln2_w, la.ln2_mean,
                            la.ln2_rstd);
    ops::residual_backward(dresidual_in, lga.attproj, lga.residual2);
    ops::matmul_backward(lga.atty, lg.attproj_w, lg.attproj_b, lga.attproj, la.atty, lp.attproj_w);
    ops::flash_attention_backward(lga.qkv.reshape({B, T, 3 * C}), lga.atty.reshape({B, T, C}),
                                  la.qkv.reshape({B, T, 3 * C}), la.atty.reshape({B, T, C}), la.lse, NH, NH,
                                  attention_kernels_);
    ops::matmul_backward(lga.ln1, lg.qkv_w, lg.qkv_b, lga.qkv, la.ln1, lp.qkv_w);
    ops::layernorm_backward(dresidual_in, lg.ln1_w, lg.ln1_b, lga.ln1, residual_in, lp.ln1_w, la.ln1_mean,
                            la.ln1_rstd);
    if (grads_ready) grads_ready(layer_grads_end_[l]);
  }
  ops::encoder_backward(g_.wte, g_.wpe, ga_.encoded.reshape({B, T, C}), a_.inputs);
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
  return as_f32(a_.logits, logits_f32_).reshape({acts_B_, acts_T_, config_.vocab_size});
}

}  // namespace llmtrain::model
