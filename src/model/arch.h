// One ArchSpec per architecture (model.arch): everything that differs between GPT-2 and Llama
// outside their layer bodies, in one place, so that no other code switches on the architecture.
// Its facts as data (norm, positions, MLP, biases, grouped-query attention, head tying) are the
// architecture's row in config/arch_traits.h, which the config's rules read too (config/ sits
// below model/); traits() hands them to code at or above model/. Parameter count and activation
// bytes come from the models' own parameter lists and activation layout code (measured, nothing
// allocated), so `llmtrain plan` cannot disagree with the models.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "config/arch_traits.h"
#include "config/config.h"
#include "model/decoder.h"
#include "model/model.h"

namespace llmtrain::model {

struct ArchSpec {
  config::Arch arch;
  /// The architecture's facts (config/arch_traits.h).
  const config::ArchTraits& traits() const { return config::arch_traits(arch); }
  /// The names of the parameters outside the layers.
  EndNames names;
  /// The output head's own parameter name, or "" when it is tied to the token embedding.
  std::string head_name(const config::ModelConfig& config) const {
    return config::head_is_tied(traits(), config.tie_embeddings) ? "" : names.head;
  }
  /// The model, its parameters allocated and uninitialised (make_model calls this).
  std::unique_ptr<Model> (*make)(const config::ModelConfig& config, Device device, Recompute recompute,
                                 DType compute, ops::AttentionKernels attention, Layout layout);
  /// Exact parameter count, from the model's parameter list.
  std::int64_t (*parameter_count)(const config::ModelConfig& config);
  /// Bytes of the activation buffer at (B,T), measured by the model's layout code, on a rank whose
  /// share of the model is `shape` (its part of the widths and of the residual stream's rows, and
  /// the rows a MoE layer's experts may receive).
  std::size_t (*activation_bytes)(const config::ModelConfig& config, Recompute recompute, DType compute, int B,
                                  int T, const ActsShape& shape);
  /// What each layer's attention call has at (B, Tl) rows of every sequence on a rank whose share
  /// of the model is `shape` (its heads, and the memory the model lends it), measured by the
  /// model's layout code: what a view splitting the sequences (parallel/context_attention.h) needs
  /// of its own beyond it.
  AttentionRoom (*attention_room)(const config::ModelConfig& config, Recompute recompute, DType compute, int B,
                                  int Tl, const ActsShape& shape);

  // Hugging Face (export --format hf, model.init_from).
  /// The export's config.json, as the transformers class that loads it (its "architectures")
  /// reads it.
  nlohmann::json (*hf_config)(const config::ModelConfig& config);
  /// Whether Hugging Face stores this parameter transposed, (in, out) (GPT-2's Conv1D weights).
  bool (*hf_transposed)(const std::string& name);
  /// A name prefix that published files may leave out ("transformer." of GPT2LMHeadModel), or "".
  const char* hf_optional_prefix;
  /// config.json keys that a model.init_from folder must agree on, as (Hugging Face key, model.* key):
  /// what the weights' shapes do not show.
  std::vector<std::pair<std::string, std::string>> hf_checked_keys;
};

/// The spec of model.arch.
const ArchSpec& arch_spec(config::Arch arch);

}  // namespace llmtrain::model
