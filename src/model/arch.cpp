#include "model/arch.h"

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/gpt2.h"
#include "model/llama.h"

namespace llmtrain::model {
namespace {

template <class M>
std::unique_ptr<Model> make(const config::ModelConfig& config, Device device, Recompute recompute, DType compute,
                            ops::AttentionKernels attention, Layout layout) {
  return std::make_unique<M>(config, device, recompute, compute, attention, layout);
}

// transformers' GPT2Config.
nlohmann::json gpt2_hf_config(const config::ModelConfig& c) {
  return {
      {"architectures", {"GPT2LMHeadModel"}},
      {"model_type", "gpt2"},
      {"vocab_size", c.vocab_size},
      {"n_positions", c.context_length},
      {"n_ctx", c.context_length},
      {"n_embd", c.d_model},
      {"n_layer", c.n_layer},
      {"n_head", c.n_head},
      {"n_inner", c.ffn_hidden},
      {"activation_function", "gelu_new"},
      {"layer_norm_epsilon", 1e-5},
      {"resid_pdrop", 0.0},
      {"embd_pdrop", 0.0},
      {"attn_pdrop", 0.0},
      {"initializer_range", 0.02},
      {"tie_word_embeddings", true},
      {"scale_attn_weights", true},
      {"torch_dtype", "float32"},
  };
}

// Conv1D layers of Hugging Face's GPT-2 store weights as (in, out).
bool gpt2_hf_transposed(const std::string& name) {
  return name.ends_with("attn.c_attn.weight") || name.ends_with("attn.c_proj.weight") ||
         name.ends_with("mlp.c_fc.weight") || name.ends_with("mlp.c_proj.weight");
}

// transformers' MixtralConfig (normalize_top_k, no qk_norm) or Qwen3MoeConfig (qk_norm) from the
// dense llama keys `j`; what neither represents stops with one line naming the key.
nlohmann::json llama_moe_hf_config(const config::ModelConfig& c, nlohmann::json j) {
  const config::MoeConfig& m = c.moe;
  const auto refuse = [](const std::string& key, const std::string& why) {
    throw InputError("model.moe." + key + ": " + why +
                     " has no Hugging Face MixtralForCausalLM or Qwen3MoeForCausalLM form (export --format hf, "
                     "model.init_from)");
  };
  if (m.shared_experts > 0) refuse("shared_experts", "shared experts");
  if (m.first_dense_layers > 0) refuse("first_dense_layers", "dense first layers");
  if (m.router != "softmax") refuse("router", "the \"" + m.router + "\" router");
  if (m.route_scale != 1.0) refuse("route_scale", "a route_scale other than 1");
  if (m.bias_update_rate > 0) refuse("bias_update_rate", "the expert bias of aux-loss-free balancing");
  if (!c.qk_norm && !m.normalize_top_k) {
    refuse("normalize_top_k", "normalize_top_k false without model.qk_norm (Mixtral always renormalises)");
  }
  j.erase("mlp_bias");
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", c.rope_theta}};
  j["num_experts_per_tok"] = m.top_k;
  j["router_aux_loss_coef"] = m.aux_loss_coef;
  j["output_router_logits"] = false;
  j["sliding_window"] = nullptr;
  if (!c.qk_norm) {
    j["architectures"] = {"MixtralForCausalLM"};
    j["model_type"] = "mixtral";
    j["num_local_experts"] = m.experts;
    j["intermediate_size"] = m.ffn_hidden;
    j["router_jitter_noise"] = 0.0;
    j.erase("attention_bias");
    return j;
  }
  j["architectures"] = {"Qwen3MoeForCausalLM"};
  j["model_type"] = "qwen3_moe";
  j["num_experts"] = m.experts;
  j["moe_intermediate_size"] = m.ffn_hidden;
  j["norm_topk_prob"] = m.normalize_top_k;
  j["decoder_sparse_step"] = 1;
  j["mlp_only_layers"] = nlohmann::json::array();
  j["use_sliding_window"] = false;
  j["max_window_layers"] = c.n_layer;
  return j;
}

// transformers' LlamaConfig, or with model.qk_norm its Qwen3Config (the same layer with q_norm and
// k_norm; rope_parameters is how transformers 5 reads the rotary base, rope_theta how 4 does).
nlohmann::json llama_hf_config(const config::ModelConfig& c) {
  nlohmann::json j = {
      {"architectures", {c.qk_norm ? "Qwen3ForCausalLM" : "LlamaForCausalLM"}},
      {"model_type", c.qk_norm ? "qwen3" : "llama"},
      {"vocab_size", c.vocab_size},
      {"hidden_size", c.d_model},
      {"intermediate_size", c.ffn_hidden},
      {"num_hidden_layers", c.n_layer},
      {"num_attention_heads", c.n_head},
      {"num_key_value_heads", c.n_kv_head},
      {"head_dim", c.d_model / c.n_head},
      {"max_position_embeddings", c.context_length},
      {"rms_norm_eps", c.norm_eps},
      {"rope_theta", c.rope_theta},
      {"rope_scaling", nullptr},
      {"hidden_act", "silu"},
      {"attention_bias", false},
      {"attention_dropout", 0.0},
      {"mlp_bias", false},
      {"tie_word_embeddings", c.tie_embeddings},
      {"initializer_range", 0.02},
      {"torch_dtype", "float32"},
  };
  if (c.moe.enabled) return llama_moe_hf_config(c, std::move(j));
  if (c.qk_norm) {
    j.erase("mlp_bias");
    j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", c.rope_theta}};
    j["use_sliding_window"] = false;
    j["sliding_window"] = nullptr;
    j["max_window_layers"] = c.n_layer;
  }
  return j;
}

bool never_transposed(const std::string&) { return false; }

const ArchSpec gpt2_spec{
    config::Arch::gpt2,
    Gpt2Body::names,
    make<Gpt2>,
    Gpt2::parameter_count,
    Gpt2::measure_activations,
    Gpt2::measure_attention_room,
    gpt2_hf_config,
    gpt2_hf_transposed,
    "transformer.",
    {},
};

const ArchSpec llama_spec{
    config::Arch::llama,
    LlamaBody::names,
    make<Llama>,
    Llama::parameter_count,
    Llama::measure_activations,
    Llama::measure_attention_room,
    llama_hf_config,
    never_transposed,
    "",
    {{"rope_theta", "rope_theta"},
     {"rms_norm_eps", "norm_eps"},
     {"tie_word_embeddings", "tie_embeddings"},
     {"head_dim", "d_model / model.n_head"},
     {"num_experts_per_tok", "moe.top_k"},
     {"norm_topk_prob", "moe.normalize_top_k"}},
};

}  // namespace

const ArchSpec& arch_spec(config::Arch arch) {
  switch (arch) {
    case config::Arch::gpt2: return gpt2_spec;
    case config::Arch::llama: return llama_spec;
  }
  throw RuntimeError("model.arch: no spec for value " + std::to_string(int(arch)));
}

// Declared in model/model.h, where its callers look for it; defined here, with the specs, so
// that the model interface does not include the architectures.
std::unique_ptr<Model> make_model(const config::ModelConfig& config, Device device, Recompute recompute,
                                  DType compute, ops::AttentionKernels attention, Layout layout) {
  return arch_spec(config.arch).make(config, device, recompute, compute, attention, layout);
}

}  // namespace llmtrain::model
