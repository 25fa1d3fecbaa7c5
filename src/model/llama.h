// A Llama-style decoder built only from ops::: RMSNorm, rotary position embeddings (Hugging
// Face's rotate_half layout), grouped-query attention, a SwiGLU MLP, no biases, and an output head
// that is its own matrix unless model.tie_embeddings. Parameters are named as in Hugging Face's
// LlamaForCausalLM and laid out in the flat buffer in backward-completion order: lm_head (when
// untied), model.norm, layers L-1 .. 0, model.embed_tokens. The loops, the ends and the
// activation slots are the decoder skeleton's (model/decoder.h); this is Llama's layer:
// train.recompute "mlp" recomputes the gate, up and SwiGLU outputs from the kept RMSNorm output,
// "full" all but each layer's output. model.qk_norm (Qwen3's q_norm and k_norm) normalises each
// query and key head of the projected qkv before the rotary embedding.
#pragma once

#include <utility>
#include <vector>

#include "model/decoder_passes.h"
#include "model/moe_layer.h"

namespace llmtrain::model {

/// Llama's layer types and layout code (see Decoder's Body).
struct LlamaBody {
  static constexpr config::Arch arch = config::Arch::llama;
  static constexpr const char* name = "Llama";
  static constexpr EndNames names{"model.embed_tokens.weight", nullptr, "model.norm", "lm_head.weight"};

  struct Params {
    Tensor in_norm, qkv, o, post_norm, gate, up, down;  // qkv: q_proj, k_proj, v_proj stacked ((NH+2NKV)HS, C)
    MoeWeights moe;  // a Mixture-of-Experts layer's MLP (model.moe), in place of gate, up and down
    Tensor q_norm, k_norm;  // model.qk_norm: the per-head RMSNorm weights (HS), adjacent (else empty)
  };
  // Forward activations of one layer; which of them are the layer's own and which share one
  // scratch with every other layer depends on the recompute mode (model/decoder.h).
  struct Acts {
    Tensor ln1, rstd1, qkv, qkvr, atty, lse, attproj, residual2, ln2, rstd2, gate, up, swi, down, residual3;
    MoeActs moe;
    Tensor qkn, rstd_qk;  // model.qk_norm: qkv with its q and k heads normalised (rope's input), (N, NH + NKV) rstd
  };
  // One layer's activation gradients. gate, up, qkvr and qkv (accumulated into) are zeroed before
  // each layer's backward; the others are written by their first writer.
  struct Grads {
    Tensor ln1, qkv, qkvr, atty, ln2, gate, up, swi;
    MoeGrads moe;
    Tensor qkn;  // model.qk_norm: the gradient of the normalised qkv (rope backward's output)
  };
  // decode_step's tensors; the key/value cache rows hold the NKV grouped heads once (kv_width NKV HS).
  struct Decoding {
    Tensor qkv, qkvr, atty, proj, gate, up, swi;
    MoeActs moe;
    Tensor qkn, rstd_qk;  // model.qk_norm
  };

  static void for_each_param(const config::ModelConfig& config, const ParamVisitor& f);
  static void lay_out_unread(ActsCarver& take, const config::ModelConfig& config, const ActsDims& dims, Acts& la);
  static void lay_out_mlp(ActsCarver& take, const config::ModelConfig& config, const ActsDims& dims, Acts& la);
  static void lay_out_kept(ActsCarver& take, const config::ModelConfig& config, const ActsDims& dims, Acts& la);
  static void lay_out_grads(ActsCarver& take, const config::ModelConfig& config, const ActsDims& dims, Grads& g);
  static std::pair<Tensor, Tensor> attention_grads(const Grads& g) { return {g.qkvr, g.atty}; }
  static void lay_out_decoding(ActsCarver& take, const config::ModelConfig& config, Decoding& d);
  static std::int64_t kv_width(const config::ModelConfig& config) {
    return config.n_kv_head * (config.d_model / config.n_head);
  }
};

class Llama final : public Decoder<LlamaBody> {
 public:
  Llama(const config::ModelConfig& config, Device device, Recompute recompute = Recompute::none,
        DType compute = DType::f32, ops::AttentionKernels attention = ops::AttentionKernels::flash,
        Layout layout = {});

  /// normal(0, 0.02) for every matrix, the two projections that feed the residual stream scaled
  /// by 1 / sqrt(2 L); norms 1.
  InitRule init_rule(const ParamInfo& info) const override;
  MoeStats take_moe_stats() override;

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
  int rotated_heads() const { return int(NH_ + NKV_); }
  /// Adds MoE layer l's router statistics of a forward into moe_stats_.
  void add_moe_stats(std::size_t l, const MoeLayerStats& s);
  void backward_qkv_shared_kv(std::size_t l, const Tensor& dln1, const Tensor& ln1);
  /// The tensor rope reads of qkv (N, (NH + 2 NKV) HS): qkv itself, or with model.qk_norm qkn, its
  /// q and k heads normalised (rstd_qk (N, NH + NKV) saved).
  const Tensor& normed_qkv(const LayerParams& lp, const Tensor& qkv, const Tensor& qkn, const Tensor& rstd_qk,
                           std::int64_t NH, std::int64_t NKV);

  std::int64_t HS_, QKV_;  // head size; width of the packed q, k, v rows ((NH + 2 NKV) HS)
  std::int64_t NH_, NKV_;  // this rank's query and key/value heads (all of them without tensor parallelism)
  int kv_sharers_ = 1;     // ranks that hold the same key/value head (tensor parallel size > n_kv_head)
  ops::Buffer kv_grads_;   // backward_qkv_shared_kv's slots
  MoeStats moe_stats_;     // the MoE layers' router statistics since take_moe_stats
};

}  // namespace llmtrain::model
