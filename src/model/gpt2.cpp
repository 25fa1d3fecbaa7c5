#include "model/gpt2.h"

#include <cmath>
#include <string>

#include "core/error.h"
#include "ops/ops.h"

namespace llmtrain::model {
namespace {

// Calls f(name, shape, slot) for every parameter of layer l, in flat-buffer order.
template <class F>
void for_each_layer_param(const config::ModelConfig& c, std::int64_t l, Gpt2Body::Params& layer, F&& f) {
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

}  // namespace

void Gpt2Body::for_each_param(const config::ModelConfig& c, const ParamVisitor& f) {
  const std::int64_t C = c.d_model;
  f("transformer.ln_f.weight", {C});
  f("transformer.ln_f.bias", {C});
  Params unused;
  for (std::int64_t l = c.n_layer - 1; l >= 0; --l) {
    for_each_layer_param(c, l, unused, [&](const std::string& name, const std::vector<std::int64_t>& shape, Tensor&) {
      f(name, shape);
    });
  }
  f("transformer.wpe.weight", {c.context_length, C});
  f("transformer.wte.weight", {c.vocab_size, C});
}

// The two branch outputs: backward never reads them.
void Gpt2Body::lay_out_unread(ActsCarver& take, const config::ModelConfig& config, const ActsDims& d, Acts& la) {
  const std::int64_t C = config.d_model;
  la.attproj = take.take({d.R, C});
  la.fcproj = take.take({d.R, C});
}

void Gpt2Body::lay_out_mlp(ActsCarver& take, const config::ModelConfig& config, const ActsDims& d, Acts& la) {
  const std::int64_t F4 = config.ffn_hidden / d.width_parts;
  la.fch = take.take({d.N, F4});
  la.fch_gelu = take.take({d.N, F4});
}

void Gpt2Body::lay_out_kept(ActsCarver& take, const config::ModelConfig& config, const ActsDims& d, Acts& la) {
  const std::int64_t N = d.N, R = d.R, C = config.d_model, CL = C / d.width_parts, NH = config.n_head / d.width_parts;
  la.ln1 = take.take({R, C});
  la.ln1_mean = take.stat({R});
  la.ln1_rstd = take.stat({R});
  la.qkv = take.take({N, 3 * CL});
  la.atty = take.take({N, CL});
  la.lse = take.stat({d.B, NH, d.T});
  la.residual2 = take.take({R, C});
  la.ln2 = take.take({R, C});
  la.ln2_mean = take.stat({R});
  la.ln2_rstd = take.stat({R});
}

void Gpt2Body::lay_out_grads(ActsCarver& take, const config::ModelConfig& config, const ActsDims& d, Grads& g) {
  const std::int64_t N = d.N, R = d.R, C = config.d_model, CL = C / d.width_parts,
                     F4 = config.ffn_hidden / d.width_parts;
  g.ln1 = take.take({R, C});
  g.qkv = take.take({N, 3 * CL});
  g.atty = take.take({N, CL});
  g.ln2 = take.take({R, C});
  g.fch = take.take({N, F4});
}

void Gpt2Body::lay_out_decoding(ActsCarver& take, const config::ModelConfig& config, Decoding& d) {
  const std::int64_t C = config.d_model, F4 = config.ffn_hidden;
  d.qkv = take.take({1, 3 * C});
  d.atty = take.take({1, C});
  d.proj = take.take({1, C});
  d.fch = take.take({1, F4});
  d.fch_gelu = take.take({1, F4});
}

Gpt2::Gpt2(const config::ModelConfig& config, Device device, Recompute recompute, DType compute,
           ops::AttentionKernels attention, Layout layout)
    : Decoder(config, device, recompute, compute, attention, layout) {
  const int N = width_parts();  // the share that split the widths checked them first
  if (config.n_head % N != 0 || config.ffn_hidden % N != 0) {
    throw RuntimeError("Gpt2: " + std::to_string(config.n_head) + " heads and " + std::to_string(config.ffn_hidden) +
                       " MLP columns do not split into " + std::to_string(N) + " parts");
  }
  build();
}

TensorSlice Gpt2::layer_slice(const std::string& name) const {
  const std::int64_t C = config_.d_model, F4 = config_.ffn_hidden;
  // Megatron's split: c_attn and c_fc column-parallel (c_attn's q, k and v each by heads), their
  // c_proj row-parallel (summed after).
  if (name.ends_with("attn.c_attn.weight") || name.ends_with("attn.c_attn.bias")) {
    TensorSlice heads = share_->column_part(C);
    if (heads.whole()) return heads;
    const auto [first, count] = heads.blocks[0];
    return {0, {{first, count}, {C + first, count}, {2 * C + first, count}}};
  }
  if (name.ends_with("attn.c_proj.weight")) return share_->row_part(C);
  if (name.ends_with("mlp.c_fc.weight") || name.ends_with("mlp.c_fc.bias")) return share_->column_part(F4);
  if (name.ends_with("mlp.c_proj.weight")) return share_->row_part(F4);
  return {};
}

Gpt2::LayerParams Gpt2::bind_layer(std::int64_t l, bool grads) const {
  LayerParams lp;
  for_each_layer_param(config_, l, lp, [&](const std::string& name, const std::vector<std::int64_t>&, Tensor& slot) {
    slot = param_named(name, grads);
  });
  return lp;
}

Model::InitRule Gpt2::init_rule(const ParamInfo& info) const {
  if (info.shape.size() == 1) {  // layer norm weights 1, biases 0
    const bool layernorm_weight = info.name.find(".ln_") != std::string::npos && info.name.ends_with(".weight");
    return {0.0f, layernorm_weight ? 1.0f : 0.0f};
  }
  // The residual projections scaled down, so that the stream's variance does not grow with depth.
  const float residual_std = 0.02f / std::sqrt(2.0f * float(config_.n_layer));
  return {info.name.ends_with("c_proj.weight") ? residual_std : 0.02f, 0.0f};
}

void Gpt2::forward_mlp(std::size_t l) {
  const LayerParams& lp = p_.layers[l];
  const LayerActs& la = layer_acts(l);
  // fch kept for the backward's GELU
  linears_.forward_gelu(la.fch_gelu, la.fch, share_->gather_input(la.ln2, a_.full_in), lp.fc_w, lp.fc_b);
}

void Gpt2::forward_layer(std::size_t l) {
  const int B = acts_B_, T = acts_T_;
  const std::int64_t C = config_.d_model / width_parts();  // this rank's heads' width
  const int NH = int(config_.n_head) / width_parts();
  const LayerParams& lp = p_.layers[l];
  const LayerActs& la = layer_acts(l);
  const Tensor& x = layer_input(l);
  // Tensor parallelism: c_attn and c_fc column-parallel, the two c_proj row-parallel.
  ops::layernorm_forward(la.ln1, la.ln1_mean, la.ln1_rstd, x, lp.ln1_w, lp.ln1_b);
  share_->column_linear(linears_, la.qkv, la.ln1, a_.full_in, lp.qkv_w, lp.qkv_b);
  attention_forward(la.atty.reshape({B, T, C}), la.lse, la.qkv.reshape({B, T, 3 * C}), NH, NH);
  share_->row_linear(linears_, la.attproj, a_.full_out, la.atty, lp.attproj_w, lp.attproj_b);
  ops::layernorm_residual_forward(la.residual2, la.ln2, la.ln2_mean, la.ln2_rstd, x, la.attproj, lp.ln2_w, lp.ln2_b);
  forward_mlp(l);
  share_->row_linear(linears_, la.fcproj, a_.full_out, la.fch_gelu, lp.fcproj_w, lp.fcproj_b);
  ops::residual_forward(la.residual3, la.residual2, la.fcproj);
}

void Gpt2::backward_layer(std::size_t l) {
  const int B = acts_B_, T = acts_T_;
  const std::int64_t C = config_.d_model, CL = C / width_parts();  // CL: this rank's heads' width
  const int NH = int(config_.n_head) / width_parts();
  const Tensor none;
  const bool sp = split_rows();
  const Tensor& dresidual = ga_.residual;
  const LayerParams& lp = p_.layers[l];
  const LayerParams& lg = g_.layers[l];
  const LayerActs& la = layer_acts(l);
  const Tensor& x = layer_input(l);
  // Each activation gradient's first writer writes it (no zeroing).
  // MLP branch: residual3 = residual2 + c_proj(gelu(c_fc(ln2))).
  // c_proj's input gradient through the GELU (and c_fc's bias gradient) in one matmul.
  linears_.backward_dgelu(ga_.fch, lg.fcproj_w, lg.fcproj_b, lg.fc_b, share_->gather_input(dresidual, a_.full_in),
                             la.fch_gelu, la.fch, lp.fcproj_w);
  linears_.backward(sp ? a_.full_out : ga_.ln2, lg.fc_w, none, ga_.fch, share_->gather_input(la.ln2, a_.full_in),
                       lp.fc_w, ops::Accumulate::no);
  share_->reduce_output(sp ? a_.full_out : ga_.ln2, ga_.ln2);
  share_->norm_backward(norm_grads(lg.ln2_w, 2 * C), [&] {
    ops::layernorm_backward(dresidual, lg.ln2_w, lg.ln2_b, ga_.ln2, la.residual2, lp.ln2_w, la.ln2_mean, la.ln2_rstd);
  });
  // Attention branch: residual2 = x + c_proj(attention(c_attn(ln1))).
  linears_.backward(ga_.atty, lg.attproj_w, lg.attproj_b, share_->gather_input(dresidual, a_.full_in), la.atty,
                       lp.attproj_w, ops::Accumulate::no);
  attention_backward(ga_.qkv.reshape({B, T, 3 * CL}), ga_.atty.reshape({B, T, CL}), la.qkv.reshape({B, T, 3 * CL}),
                     la.atty.reshape({B, T, CL}), la.lse, NH, NH);
  linears_.backward(sp ? a_.full_out : ga_.ln1, lg.qkv_w, lg.qkv_b, ga_.qkv, share_->gather_input(la.ln1, a_.full_in),
                       lp.qkv_w, ops::Accumulate::no);
  share_->reduce_output(sp ? a_.full_out : ga_.ln1, ga_.ln1);
  share_->norm_backward(norm_grads(lg.ln1_w, 2 * C), [&] {
    ops::layernorm_backward(dresidual, lg.ln1_w, lg.ln1_b, ga_.ln1, x, lp.ln1_w, la.ln1_mean, la.ln1_rstd);
  });
}

void Gpt2::decode_layer(std::size_t l, int pos) {
  const std::int64_t C = config_.d_model;
  const int NH = int(config_.n_head);
  const LayerParams& lp = p_.layers[l];
  ops::layernorm_forward(d_.ln, d_.mean, d_.rstd, d_.x, lp.ln1_w, lp.ln1_b);
  linears_.forward(d_.qkv, d_.ln, lp.qkv_w, lp.qkv_b);
  ops::copy(row_slice(d_.k_cache[l], pos, 0, C), row_slice(d_.qkv, 0, C, C));
  ops::copy(row_slice(d_.v_cache[l], pos, 0, C), row_slice(d_.qkv, 0, 2 * C, C));
  ops::attention_decode(d_.atty.reshape({C}), row_slice(d_.qkv, 0, 0, C), d_.k_cache[l], d_.v_cache[l], pos, NH);
  linears_.forward(d_.proj, d_.atty, lp.attproj_w, lp.attproj_b);
  ops::residual_forward(d_.x2, d_.x, d_.proj);
  ops::layernorm_forward(d_.ln, d_.mean, d_.rstd, d_.x2, lp.ln2_w, lp.ln2_b);
  linears_.forward(d_.fch, d_.ln, lp.fc_w, lp.fc_b);
  ops::gelu_forward(d_.fch_gelu, d_.fch);
  linears_.forward(d_.proj, d_.fch_gelu, lp.fcproj_w, lp.fcproj_b);
  ops::residual_forward(d_.x, d_.x2, d_.proj);
}

void Gpt2::final_norm_forward(const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                              const Tensor& weight, const Tensor& bias) {
  ops::layernorm_forward(out, mean, rstd, x, weight, bias);
}

void Gpt2::final_norm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias, const Tensor& dout,
                               const Tensor& x, const Tensor& weight, const Tensor& mean, const Tensor& rstd) {
  ops::layernorm_backward(dx, dweight, dbias, dout, x, weight, mean, rstd);
}

}  // namespace llmtrain::model
