// A Llama-style decoder built only from ops::: RMSNorm, rotary position embeddings (Hugging
// Face's rotate_half layout), grouped-query attention, a SwiGLU MLP, no biases, and an output head
// that is its own matrix unless model.tie_embeddings. Parameters are named as in Hugging Face's
// LlamaForCausalLM and laid out in the flat buffer in backward-completion order: lm_head (when
// untied), model.norm, layers L-1 .. 0, model.embed_tokens.
//
// Activation memory: the residual stream needs only ONE gradient buffer, accumulated in place
// through the whole backward pass (each residual connection adds its branch's input gradient to
// it), and every other activation gradient lives in one layer-sized scratch reused by all layers.
// train.recompute trades compute for the forward activations: "mlp" recomputes the gate, up and
// SwiGLU outputs from the kept RMSNorm output, "full" keeps only each layer's output and reruns
// the layer's forward pass during backward.
#pragma once

#include "model/model.h"

namespace llmtrain::model {

class Llama final : public Model {
 public:
  Llama(const config::ModelConfig& config, Device device, Recompute recompute = Recompute::none,
        DType compute = DType::f32, ops::AttentionKernels attention = ops::AttentionKernels::flash,
        Layout layout = {});

  void init_weights(std::uint64_t seed) override;
  double forward(const std::int32_t* inputs, const std::int32_t* targets, int B, int T, float dloss_scale) override;
  void backward(const std::function<void(std::int64_t)>& grads_ready = {}) override;
  Tensor logits() override;
  Tensor decode_step(std::int32_t token, int pos) override;
  StageIO stage_io() override;
  std::string tied_embedding() const override { return config_.tie_embeddings ? "model.embed_tokens.weight" : ""; }
  void prepare_activations(int B, int T) override { ensure_acts(B, T); }
  std::size_t activation_bytes(int B, int T) const override;

  /// Exact parameter count of `config`, from the parameter list alone (nothing allocated).
  static std::int64_t parameter_count(const config::ModelConfig& config);
  /// Activation bytes at (B,T): bind_acts with a measuring Carver (nothing allocated).
  /// (tensor_size: this rank's part of a tensor-parallel group of that size.)
  static std::size_t measure_activations(const config::ModelConfig& config, Recompute recompute, DType compute,
                                         int B, int T, int tensor_size = 1, bool sequence_parallel = false);

 private:
  struct LayerParams {
    Tensor in_norm, qkv, o, post_norm, gate, up, down;  // qkv: q_proj, k_proj, v_proj stacked ((NH+2NKV)HS, C)
  };
  struct Params {
    Tensor embed, norm, head;
    std::vector<LayerParams> layers;
  };
  // Forward activations of one layer; which of them are the layer's own and which share one
  // scratch with every other layer depends on the recompute mode (see bind_acts).
  struct LayerActs {
    Tensor ln1, rstd1, qkv, qkvr, atty, lse, attproj, residual2, ln2, rstd2, gate, up, swi, down, residual3;
  };
  struct Acts {
    Tensor inputs, targets, encoded, lnf, rstdf, logits, losses;
    Tensor full_in, full_out, lnf_full;  // sequence parallelism: whole-token gathers and partial sums
    std::vector<LayerActs> layers;
  };
  // Activation gradients: the residual stream's, and one layer's worth of scratch.
  struct GradActs {
    Tensor residual, lnf, ln1, qkv, qkvr, atty, ln2, gate, up, swi;
    // All of ln1 .. swi. gate, up, qkvr and qkv (accumulated into) are zeroed before each layer's
    // backward; the others are written by their first writer.
    Tensor scratch;
  };

  Params bind_params(bool grads) const;
  LayerParams bind_layer(std::int64_t l, bool grads) const;
  void bind_roots(Params& p, bool grads) const;  // the parameters outside the layers this stage holds
  void select_activations() override;
  void bind_unit(const Unit& unit) override;
  /// Lays the activations of (B,T) out with `carver` into a, g; returns the bytes they take. The
  /// one activation layout: a measuring Carver sizes the buffer (and `plan`), a real one binds it.
  static std::size_t bind_acts(const config::ModelConfig& config, Recompute recompute, DType compute, Carver& carver,
                               int B, int T, Acts& a, GradActs& g, const ActsShape& shape);
  /// This rank's part of parameter `name` under tensor parallelism.
  TensorSlice slice_of(const std::string& name) const;
  void ensure_acts(int B, int T);
  void forward_layer(std::size_t l);
  void forward_mlp(const LayerParams& lp, const LayerActs& la, const Tensor& ln2);
  int rotated_heads() const;

  Recompute recompute_;
  std::int64_t HS_, QKV_;  // head size; width of the packed q, k, v rows ((NH + 2 NKV) HS)
  std::int64_t NH_, NKV_;  // this rank's query and key/value heads (all of them without tensor parallelism)
  int kv_sharers_ = 1;     // ranks that hold the same key/value head (tensor parallel size > n_kv_head)
  ops::Buffer kv_grads_;   // backward_qkv_shared_kv's slots
  void backward_qkv_shared_kv(std::size_t l, const Tensor& dln1, const Tensor& ln1);
  Params p_, g_;

  int acts_B_ = 0, acts_T_ = 0;
  ops::Buffer acts_buffer_, logits_f32_;  // logits_f32_: logits() and decode_step() in mixed precision
  Acts a_;                         // the activation slot in use
  std::vector<Acts> acts_slots_;  // every slot's
  GradActs ga_;

  // Buffers of decode_step: one position's activations and each layer's key/value cache, whose
  // rows hold the NKV grouped heads once ((maxT, NKV HS)).
  struct Decoder {
    ops::Buffer buffer;
    Tensor token, x, ln, rstd, qkv, qkvr, atty, proj, x2, gate, up, swi, logits;
    std::vector<Tensor> k_cache, v_cache;
  };
  void ensure_decoder();
  Decoder d_;
};

}  // namespace llmtrain::model
