// The rules between config keys, checked once every key is read: the defaults that depend on
// other keys (model.n_kv_head, model.ffn_hidden, model.tie_embeddings, from the architecture's row
// in config/arch_traits.h), the model's shape, attention and precision, batch sizes, the
// pipeline's keys and the learning-rate schedule.
#pragma once

#include "config/config.h"
#include "config/origins.h"

namespace llmtrain::config {

/// Fills the keys whose default depends on others, then checks the rules between keys (InputError
/// naming the key and where its value came from). `tie_embeddings_given`: the config set
/// model.tie_embeddings (else the architecture's default applies).
void resolve_and_check(Config& c, const Origins& o, bool tie_embeddings_given);

}  // namespace llmtrain::config
