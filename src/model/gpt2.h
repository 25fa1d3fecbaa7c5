// GPT-2, built only from ops::: LayerNorm, learned positions, multi-head attention, a GELU MLP,
// biases everywhere, and an output head tied to the token embedding. Parameters are named as in
// Hugging Face's GPT2LMHeadModel and laid out in the flat buffer in backward-completion order
// (ln_f, layer L-1, ..., layer 0, wpe, wte). The loops, the ends and the activation slots are the
// decoder skeleton's (model/decoder.h); this is GPT-2's layer: train.recompute "mlp" recomputes
// the c_fc and GELU outputs, "full" all but each layer's output.
#pragma once

#include <utility>
#include <vector>

#include "model/decoder_passes.h"

namespace llmtrain::model {

/// GPT-2's layer types and layout code (see Decoder's Body).
struct Gpt2Body {
  static constexpr config::Arch arch = config::Arch::gpt2;
  static constexpr const char* name = "Gpt2";
  static constexpr EndNames names{"transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f", nullptr};

  struct Params {
    Tensor ln1_w, ln1_b, qkv_w, qkv_b, attproj_w, attproj_b, ln2_w, ln2_b, fc_w, fc_b, fcproj_w, fcproj_b;
  };
  // Forward activations of one layer; which are the layer's own and which share one scratch with
  // every other layer depends on the recompute mode (model/decoder.h).
  struct Acts {
    Tensor ln1, ln1_mean, ln1_rstd, qkv, atty, lse, attproj, residual2, ln2, ln2_mean, ln2_rstd, fch, fch_gelu,
        fcproj, residual3;
  };
  // One layer's activation gradients: each written by its first writer in each layer's backward.
  struct Grads {
    Tensor ln1, qkv, atty, ln2, fch;
  };
  struct Decoding {
    Tensor qkv, atty, proj, fch, fch_gelu;
  };

  static void for_each_param(const config::ModelConfig& config, const ParamVisitor& f);
  static void lay_out_unread(ActsCarver& take, const config::ModelConfig& config, const ActsDims& dims, Acts& la);
  static void lay_out_mlp(ActsCarver& take, const config::ModelConfig& config, const ActsDims& dims, Acts& la);
  static void lay_out_kept(ActsCarver& take, const config::ModelConfig& config, const ActsDims& dims, Acts& la);
  static void lay_out_grads(ActsCarver& take, const config::ModelConfig& config, const ActsDims& dims, Grads& g);
  static std::pair<Tensor, Tensor> attention_grads(const Grads& g) { return {g.qkv, g.atty}; }
  static void lay_out_decoding(ActsCarver& take, const config::ModelConfig& config, Decoding& d);
  static std::int64_t kv_width(const config::ModelConfig& config) { return config.d_model; }
};

class Gpt2 final : public Decoder<Gpt2Body> {
 public:
  Gpt2(const config::ModelConfig& config, Device device, Recompute recompute = Recompute::none,
       DType compute = DType::f32, ops::AttentionKernels attention = ops::AttentionKernels::flash,
       Layout layout = {});

  /// GPT-2's initialisation: normal(0, 0.02), residual projections 0.02 / sqrt(2 L), biases 0,
  /// LayerNorm weights 1.
  InitRule init_rule(const ParamInfo& info) const override;

 private:
  LayerParams bind_layer(std::int64_t l, bool grads) const override;
  TensorSlice layer_slice(const std::string& name) const override;
  void forward_layer(std::size_t l) override;
  void forward_mlp(std::size_t l) override;
  void backward_layer(std::size_t l) override;
  void decode_layer(std::size_t l, int pos) override;
  void final_norm_forward(const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                          const Tensor& weight, const Tensor& bias) override;
  void final_norm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias, const Tensor& dout,
                           const Tensor& x, const Tensor& weight, const Tensor& mean, const Tensor& rstd) override;
};

}  // namespace llmtrain::model
