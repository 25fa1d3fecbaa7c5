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
    [](const config::ModelConfig& c, Recompute r, DType d, int B, int T, int tensor_size, bool sequence_parallel) {
      return Gpt2::measure_activations(c, r, d, B, T, tensor_size, sequence_parallel);
    },
    [](const config::ModelConfig& c, Recompute r, DType d, int B, int Tl, int tensor_size, bool sequence_parallel,
       int context_size, bool ring) {
      return Gpt2::measure_context_work(c, r, d, B, Tl, tensor_size, sequence_parallel, context_size, ring);
    },
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
    [](const config::ModelConfig& c, Recompute r, DType d, int B, int T, int tensor_size, bool sequence_parallel) {
      return Llama::measure_activations(c, r, d, B, T, tensor_size, sequence_parallel);
    },
    [](const config::ModelConfig& c, Recompute r, DType d, int B, int Tl, int tensor_size, bool sequence_parallel,
       int context_size, bool ring) {
      return Llama::measure_context_work(c, r, d, B, Tl, tensor_size, sequence_parallel, context_size, ring);
    },
    llama_hf_config,
    never_transposed,
    "",
    {{"rope_theta", "rope_theta"},
     {"rms_norm_eps", "norm_eps"},
     {"tie_word_embeddings", "tie_embeddings"},
     {"head_dim", "d_model / model.n_head"}},
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
