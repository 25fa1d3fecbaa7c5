#include "model/gpt2.h"

#include <cmath>
#include <cstring>

#include "core/error.h"
#include "core/rng.h"
#include "ops/nn.h"

namespace llmtrain::model {
namespace {

// Hands out consecutive 64-byte aligned tensors from one allocation; with a null base it only
// measures how many bytes they need.
struct Carver {
  char* base;
  Device device;
  std::size_t used = 0;

  Tensor take(DType dtype, std::initializer_list<std::int64_t> shape) {
    Tensor t(base ? base + used : nullptr, dtype, device, shape);
    used += (t.bytes() + 63) / 64 * 64;
    return t;
  }
};

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

Tensor shaped(void* data, Device device, const std::vector<std::int64_t>& shape) {
  Tensor t(data, DType::f32, device, {});
  t.ndim = int(shape.size());
  for (int i = 0; i < t.ndim; ++i) t.shape[i] = shape[i];
  return t;
}

}  // namespace

Gpt2::Gpt2(const config::ModelConfig& config, Device device) : config_(config), device_(device) {
  if (config.arch != "gpt2") {
    throw InputError("model.arch: \"" + config.arch + "\" models are not implemented yet; use \"gpt2\"");
  }
  Params layout;
  layout.layers.resize(std::size_t(config.n_layer));
  for_each_param(config_, layout, [&](const std::string& name, const std::vector<std::int64_t>& shape, Tensor&) {
    ParamInfo info{name, shape, num_params_, 1, shape.size() == 2};
    for (const auto d : shape) info.numel *= d;
    num_params_ += info.numel;
    infos_.push_back(std::move(info));
  });
  // Layer l's parameters end where those of layer l - 1 (or, for layer 0, wpe) begin.
  for (std::int64_t l = 0; l < config.n_layer; ++l) {
    const std::string next = l == 0 ? "transformer.wpe.weight" : "transformer.h." + std::to_string(l - 1) + ".ln_1.weight";
    for (const auto& info : infos_) {
      if (info.name == next) layer_grads_end_.push_back(info.offset);
    }
  }
  params_ = ops::Buffer(device, std::size_t(num_params_) * sizeof(float));
  grads_ = ops::Buffer(device, std::size_t(num_params_) * sizeof(float));
  p_ = bind_params(params_);
  g_ = bind_params(grads_);
  zero_grads();
}

Gpt2::Params Gpt2::bind_params(const ops::Buffer& buffer) const {
  Params p;
  p.layers.resize(std::size_t(config_.n_layer));
  std::size_t index = 0;
  for_each_param(config_, p, [&](const std::string&, const std::vector<std::int64_t>& shape, Tensor& slot) {
    slot = shaped(static_cast<float*>(buffer.data()) + infos_[index++].offset, device_, shape);
  });
  return p;
}

const ParamInfo& Gpt2::param_info(const std::string& name) const {
  for (const auto& info : infos_) {
    if (info.name == name) return info;
  }
  throw RuntimeError("Gpt2: no parameter named " + name);
}

Tensor Gpt2::param(const ParamInfo& info) const {
  return shaped(static_cast<float*>(params_.data()) + info.offset, device_, info.shape);
}

Tensor Gpt2::grad(const ParamInfo& info) const {
  return shaped(static_cast<float*>(grads_.data()) + info.offset, device_, info.shape);
}

void Gpt2::init_weights(std::uint64_t seed) {
  if (device_ != Device::cpu) throw RuntimeError("Gpt2::init_weights: initialise on the CPU, then copy");
  const float residual_std = 0.02f / std::sqrt(2.0f * float(config_.n_layer));
  float* base = static_cast<float*>(params_.data());
  for (const auto& info : infos_) {
    float* w = base + info.offset;
    const bool layernorm = info.name.find(".ln_") != std::string::npos;
    if (info.shape.size() == 1) {
      const bool is_weight = info.name.ends_with(".weight");
      for (std::int64_t i = 0; i < info.numel; ++i) w[i] = layernorm && is_weight ? 1.0f : 0.0f;
      continue;
    }
    const bool residual_projection = info.name.ends_with("c_proj.weight");
    const float std = residual_projection ? residual_std : 0.02f;
    for (std::int64_t i = 0; i < info.numel; ++i) w[i] = std * normal_at(seed, std::uint64_t(info.offset + i));
  }
}

Gpt2::Acts Gpt2::bind_acts(ops::Buffer& buffer, int B, int T, bool measure_only, std::size_t* bytes) const {
  Carver carver{measure_only ? nullptr : static_cast<char*>(buffer.data()), device_};
  const std::int64_t N = std::int64_t(B) * T, C = config_.d_model, F4 = config_.ffn_hidden, V = config_.vocab_size,
                     NH = config_.n_head;
  Acts a;
  a.inputs = carver.take(DType::i32, {B, T});
  a.targets = carver.take(DType::i32, {N});
  a.encoded = carver.take(DType::f32, {N, C});
  for (std::int64_t l = 0; l < config_.n_layer; ++l) {
    LayerActs la;
    la.ln1 = carver.take(DType::f32, {N, C});
    la.ln1_mean = carver.take(DType::f32, {N});
    la.ln1_rstd = carver.take(DType::f32, {N});
    la.qkv = carver.take(DType::f32, {N, 3 * C});
    la.atty = carver.take(DType::f32, {N, C});
    la.att = carver.take(DType::f32, {B, NH, T, T});
    la.attproj = carver.take(DType::f32, {N, C});
    la.residual2 = carver.take(DType::f32, {N, C});
    la.ln2 = carver.take(DType::f32, {N, C});
    la.ln2_mean = carver.take(DType::f32, {N});
    la.ln2_rstd = carver.take(DType::f32, {N});
    la.fch = carver.take(DType::f32, {N, F4});
    la.fch_gelu = carver.take(DType::f32, {N, F4});
    la.fcproj = carver.take(DType::f32, {N, C});
    la.residual3 = carver.take(DType::f32, {N, C});
    a.layers.push_back(la);
  }
  a.lnf = carver.take(DType::f32, {N, C});
  a.lnf_mean = carver.take(DType::f32, {N});
  a.lnf_rstd = carver.take(DType::f32, {N});
  a.logits = carver.take(DType::f32, {N, V});
  a.losses = carver.take(DType::f32, {N});
  if (bytes) *bytes = carver.used;
  return a;
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
  if (device_ != Device::cpu) throw RuntimeError("Gpt2::forward: only the CPU backend so far");
  const std::int64_t C = config_.d_model;
  const int NH = int(config_.n_head);
  std::memcpy(a_.inputs.data, inputs, a_.inputs.bytes());
  const Tensor none;

  ops::encoder_forward(a_.encoded.reshape({B, T, C}), a_.inputs, p_.wte, p_.wpe);
  const Tensor* residual = &a_.encoded;
  for (std::size_t l = 0; l < a_.layers.size(); ++l) {
    const LayerParams& lp = p_.layers[l];
    LayerActs& la = a_.layers[l];
    ops::layernorm_forward(la.ln1, la.ln1_mean, la.ln1_rstd, *residual, lp.ln1_w, lp.ln1_b);
    ops::matmul_forward(la.qkv, la.ln1, lp.qkv_w, lp.qkv_b);
    ops::attention_forward(la.atty.reshape({B, T, C}), la.att, la.qkv.reshape({B, T, 3 * C}), NH);
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
  std::memcpy(a_.targets.data, targets, a_.targets.bytes());
  return ops::fused_classifier(a_.logits, a_.losses, a_.targets, dloss_scale);
}

void Gpt2::backward(const std::function<void(std::int64_t)>& grads_ready) {
  const int B = acts_B_, T = acts_T_;
  const std::int64_t C = config_.d_model;
  const int NH = int(config_.n_head);
  std::memset(grad_acts_buffer_.data(), 0, grad_acts_buffer_.bytes());
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
    ops::attention_backward(lga.qkv.reshape({B, T, 3 * C}), lga.atty.reshape({B, T, C}), la.qkv.reshape({B, T, 3 * C}),
                            la.att, NH);
    ops::matmul_backward(lga.ln1, lg.qkv_w, lg.qkv_b, lga.qkv, la.ln1, lp.qkv_w);
    ops::layernorm_backward(dresidual_in, lg.ln1_w, lg.ln1_b, lga.ln1, residual_in, lp.ln1_w, la.ln1_mean,
                            la.ln1_rstd);
    if (grads_ready) grads_ready(layer_grads_end_[l]);
  }
  ops::encoder_backward(g_.wte, g_.wpe, ga_.encoded.reshape({B, T, C}), a_.inputs);
  if (grads_ready) grads_ready(num_params_);
}

void Gpt2::zero_grads() { std::memset(grads_.data(), 0, grads_.bytes()); }

void Gpt2::ensure_decoder() {
  if (d_.buffer.data()) return;
  const std::int64_t C = config_.d_model, F4 = config_.ffn_hidden, V = config_.vocab_size,
                     maxT = config_.context_length;
  for (const bool measure : {true, false}) {
    Carver carver{measure ? nullptr : static_cast<char*>(d_.buffer.data()), device_};
    d_.token = carver.take(DType::i32, {1, 1});
    d_.x = carver.take(DType::f32, {1, C});
    d_.ln = carver.take(DType::f32, {1, C});
    d_.mean = carver.take(DType::f32, {1});
    d_.rstd = carver.take(DType::f32, {1});
    d_.qkv = carver.take(DType::f32, {1, 3 * C});
    d_.atty = carver.take(DType::f32, {1, C});
    d_.proj = carver.take(DType::f32, {1, C});
    d_.x2 = carver.take(DType::f32, {1, C});
    d_.fch = carver.take(DType::f32, {1, F4});
    d_.fch_gelu = carver.take(DType::f32, {1, F4});
    d_.logits = carver.take(DType::f32, {1, V});
    d_.k_cache.clear();
    d_.v_cache.clear();
    for (std::int64_t l = 0; l < config_.n_layer; ++l) {
      d_.k_cache.push_back(carver.take(DType::f32, {maxT, C}));
      d_.v_cache.push_back(carver.take(DType::f32, {maxT, C}));
    }
    if (measure) d_.buffer = ops::Buffer(device_, carver.used);
  }
}

Tensor Gpt2::decode_step(std::int32_t token, int pos) {
  if (pos < 0 || pos >= config_.context_length) {
    throw RuntimeError("Gpt2::decode_step: position " + std::to_string(pos) + " outside the context");
  }
  ensure_decoder();
  const std::int64_t C = config_.d_model;
  const int NH = int(config_.n_head);
  const auto row = [&](const Tensor& t, std::int64_t r, std::int64_t offset, std::int64_t width) {
    return Tensor(t.as<float>() + r * t.shape[1] + offset, DType::f32, t.device, {width});
  };
  ops::copy(d_.token, Tensor(&token, DType::i32, Device::cpu, {1, 1}));
  // Position `pos` of the table is position 0 of this view.
  const Tensor wpe_from_pos(p_.wpe.as<float>() + pos * C, DType::f32, device_, {1, C});
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
  return d_.logits.reshape({config_.vocab_size});
}

Tensor Gpt2::logits() const {
  return a_.logits.reshape({acts_B_, acts_T_, config_.vocab_size});
}

}  // namespace llmtrain::model
