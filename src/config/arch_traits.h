// What an architecture is, as data: the facts about GPT-2 and Llama that code outside their model
// classes needs (the config's defaults and rules, memory and communication plans, pipeline cost
// models, exports). One row per model.arch, in arch_traits.cpp.
//
// Why here and not in model/: the config's rules need these facts, and config/ sits below model/
// in the layer order, so the facts live at the lowest layer that asks them. model::ArchSpec
// (model/arch.h) is the architecture's whole description and builds on this row (ArchSpec::traits):
// code at or above model/ asks the spec, config/ asks the row. Nothing else switches on model.arch.
#pragma once

#include <cstdint>

#include "config/choices.h"

namespace llmtrain::config {

/// The normalisation of the residual stream's branches and of the final norm.
enum class Norm {
  layernorm,  // LayerNorm with weight and bias (GPT-2)
  rmsnorm,    // RMSNorm, weight only (Llama)
};
/// How positions enter the model.
enum class Positions {
  learned,  // a (context_length, C) table added to the token embedding (GPT-2's wpe)
  rotary,   // rotary embeddings applied to q and k (Llama)
};
/// The MLP.
enum class Mlp {
  gelu,    // c_fc, GELU (tanh form), c_proj (GPT-2)
  swiglu,  // gate, up, SiLU(gate) * up, down (Llama)
};

struct ArchTraits {
  Arch arch;
  Norm norm;
  Positions positions;
  Mlp mlp;
  bool biases;  // the linear layers have biases
  /// Fewer key/value heads than query heads (model.n_kv_head); under tensor parallelism a
  /// key/value head is then split like the query heads or replicated on the ranks that use it.
  bool grouped_query_attention;
  /// The output head may be a matrix of its own (model.tie_embeddings false); else always tied.
  bool untied_head;
  /// model.tie_embeddings when the config does not say.
  bool tied_by_default;
  /// RMSNorm over each query and key head before the rotary embedding (model.qk_norm) is possible.
  bool head_norms;
};

/// The row of `arch`.
const ArchTraits& arch_traits(Arch arch);

/// model.ffn_hidden when the config does not say: 4 C for a GELU MLP; 2/3 of that for SwiGLU
/// (three matrices instead of two), rounded up to a multiple of 256.
std::int64_t default_ffn_hidden(const ArchTraits& traits, std::int64_t d_model);
/// Parameters per channel of one norm: 2 for LayerNorm (weight, bias), 1 for RMSNorm.
int norm_params_per_channel(const ArchTraits& traits);
/// Whether the output head shares the token embedding under `tie_embeddings` (model.tie_embeddings).
bool head_is_tied(const ArchTraits& traits, bool tie_embeddings);

}  // namespace llmtrain::config
