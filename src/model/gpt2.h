// GPT-2, built only from ops::. Parameters are named as in Hugging Face's GPT2LMHeadModel and
// laid out in the flat buffer in backward-completion order (ln_f, layer L-1, ..., layer 0, wpe,
// wte); the output head is tied to the token embedding. Activation memory as in llama.h: one
// residual-stream gradient accumulated in place, one layer's scratch for the other gradients,
// and train.recompute ("mlp": c_fc and GELU outputs; "full": all but each layer's output).
#pragma once

#include "model/model.h"

namespace llmtrain::model {

class Gpt2 final : public Model {
 public:
  Gpt2(const config::ModelConfig& config, Device device, Recompute recompute = Recompute::none,
       DType compute = DType::f32, ops::AttentionKernels attention = ops::AttentionKernels::flash,
       Layout layout = {});

  /// GPT-2's initialisation: normal(0, 0.02), residual projections 0.02 / sqrt(2 L), biases 0,
  /// LayerNorm weights 1.
  void init_weights(std::uint64_t seed) override;
  double forward(const std::int32_t* inputs, const std::int32_t* targets, int B, int T, float dloss_scale) override;
  void backward(const std::function<void(std::int64_t)>& grads_ready = {}) override;
  Tensor logits() override;
  Tensor decode_step(std::int32_t token, int pos) override;
  StageIO stage_io() override;
  std::string tied_embedding() const override { return "transformer.wte.weight"; }
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
    Tensor ln1_w, ln1_b, qkv_w, qkv_b, attproj_w, attproj_b, ln2_w, ln2_b, fc_w, fc_b, fcproj_w, fcproj_b;
  };
  struct Params {
    Tensor wte, wpe, lnf_w, lnf_b;
    std::vector<LayerParams> layers;
  };
  // Forward activations of one layer; which are the layer's own and which share one scratch with
  // every other layer depends on the recompute mode (see bind_acts).
  struct LayerActs {
    Tensor ln1, ln1_mean, ln1_rstd, qkv, atty, lse, attproj, residual2, ln2, ln2_mean, ln2_rstd, fch, fch_gelu,
        fcproj, residual3;
  };
  struct Acts {
    Tensor inputs, targets, encoded, lnf, lnf_mean, lnf_rstd, logits, losses;
    Tensor full_in, full_out, lnf_full;  // sequence parallelism: whole-token gathers and partial sums
    std::vector<LayerActs> layers;
  };
  // Activation gradients: the residual stream's, and one layer's worth of scratch.
  struct GradActs {
    Tensor residual, lnf, ln1, qkv, atty, ln2, fch;
    Tensor scratch;  // all of ln1 .. fch: each written by its first writer in each layer's backward
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

  Recompute recompute_;
  Params p_, g_;

  // Buffers of decode_step: one position's activations and each layer's key/value cache.
  struct Decoder {
    ops::Buffer buffer;
    Tensor token, x, ln, mean, rstd, qkv, atty, proj, x2, fch, fch_gelu, logits;
    std::vector<Tensor> k_cache, v_cache;  // per layer (maxT, C)
  };
  void ensure_decoder();
  Decoder d_;

  int acts_B_ = 0, acts_T_ = 0;
  ops::Buffer acts_buffer_, logits_f32_;  // logits_f32_: f32 logits in mixed precision
  Acts a_;                         // the activation slot in use
  std::vector<Acts> acts_slots_;  // every slot's
  GradActs ga_;
};

}  // namespace llmtrain::model
