// GPT-2, built only from ops::. All parameters live in one flat fp32 buffer and their gradients
// in another, laid out in reverse layer order (ln_f, layer L-1, ..., layer 0, wpe, wte) so that
// the gradients backward finishes first form the front of the buffer: all-reduce buckets, ZeRO
// shards and checkpoints are ranges of these buffers.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "config/config.h"
#include "core/tensor.h"
#include "ops/buffer.h"

namespace llmtrain::model {

/// One parameter tensor: its Hugging Face GPT-2 name (weights in torch.nn.Linear's (out, in)
/// layout), shape, place in the flat buffer and whether AdamW decays it (2-D tensors only).
struct ParamInfo {
  std::string name;
  std::vector<std::int64_t> shape;
  std::int64_t offset = 0;
  std::int64_t numel = 0;
  bool decay = false;
};

class Gpt2 {
 public:
  Gpt2(const config::ModelConfig& config, Device device);

  const config::ModelConfig& config() const { return config_; }
  const std::vector<ParamInfo>& param_infos() const { return infos_; }
  const ParamInfo& param_info(const std::string& name) const;
  std::int64_t num_params() const { return num_params_; }

  Tensor params() const { return params_.view(DType::f32, {num_params_}); }  // (P,)
  Tensor grads() const { return grads_.view(DType::f32, {num_params_}); }    // (P,)
  /// A view of one parameter (or its gradient) with its shape.
  Tensor param(const ParamInfo& info) const;
  Tensor grad(const ParamInfo& info) const;

  /// GPT-2's initialisation: normal(0, 0.02), residual projections 0.02 / sqrt(2 L), biases 0,
  /// LayerNorm weights 1. Element i of the flat buffer depends only on (seed, i).
  void init_weights(std::uint64_t seed);

  /// Forward pass on inputs (B,T) with T <= context_length. With targets, returns the summed loss
  /// over the B T positions; with dloss_scale > 0 it also leaves d(loss sum * dloss_scale)/dlogits
  /// in place of the logits, ready for backward(). Without targets returns 0 and keeps the logits.
  double forward(const std::int32_t* inputs, const std::int32_t* targets, int B, int T, float dloss_scale);
  /// Adds this micro-batch's gradients into grads() (after forward with dloss_scale > 0). As
  /// backward goes, `grads_ready(n)` (if given) says that the first n elements of grads() are final,
  /// so their reduction across ranks can start while the rest is computed.
  void backward(const std::function<void(std::int64_t)>& grads_ready = {});
  void zero_grads();

  /// (B,T,V) logits of the last forward without dloss_scale.
  Tensor logits() const;

  /// Incremental decoding of one sequence with a KV cache: feed its tokens at positions 0, 1,
  /// 2, ... (below context_length), each costing one position; returns the (V,) logits that
  /// predict the next token. Position 0 starts a new sequence.
  Tensor decode_step(std::int32_t token, int pos);

 private:
  struct LayerParams {
    Tensor ln1_w, ln1_b, qkv_w, qkv_b, attproj_w, attproj_b, ln2_w, ln2_b, fc_w, fc_b, fcproj_w, fcproj_b;
  };
  struct Params {
    Tensor wte, wpe, lnf_w, lnf_b;
    std::vector<LayerParams> layers;
  };
  // Activations of one micro-batch (and, in a second set, their gradients).
  struct LayerActs {
    Tensor ln1, ln1_mean, ln1_rstd, qkv, atty, att, attproj, residual2, ln2, ln2_mean, ln2_rstd, fch, fch_gelu,
        fcproj, residual3;
  };
  struct Acts {
    Tensor inputs, targets, encoded, lnf, lnf_mean, lnf_rstd, logits, losses;
    std::vector<LayerActs> layers;
  };

  Params bind_params(const ops::Buffer& buffer) const;
  Acts bind_acts(ops::Buffer& buffer, int B, int T, bool measure_only, std::size_t* bytes) const;
  void ensure_acts(int B, int T);

  config::ModelConfig config_;
  Device device_;
  std::vector<ParamInfo> infos_;
  std::int64_t num_params_ = 0;
  std::vector<std::int64_t> layer_grads_end_;  // per layer l: grads [0, end) are final after its backward
  ops::Buffer params_, grads_;
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
  ops::Buffer acts_buffer_, grad_acts_buffer_;
  Acts a_, ga_;
};

}  // namespace llmtrain::model
