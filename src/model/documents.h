// Packed sequences: data.document_mask and data.reset_positions resolved at start-up into the
// model's Documents (model/model.h), with the end-of-text id of the tokenizer recorded beside the
// shards (tokenizer.json, which `llmtrain tokenize` writes).
#pragma once

#include <string>

#include "config/config.h"
#include "core/tensor.h"
#include "model/model.h"

namespace llmtrain::model {

/// The Documents of `data` for shards in `shard_dir` on `device`: none unless data.document_mask
/// or data.reset_positions asks. InputError (one line naming the key and the file) when the
/// tokenizer beside the shards has no end-of-text token, or on a GPU (no CUDA attention kernel has
/// the mask yet, and reset positions have not been checked there; `attention` names
/// model.attention's choice for the message).
Model::Documents documents_for(const config::DataConfig& data, const config::ModelConfig& model,
                               const std::string& shard_dir, Device device);

/// The folder of the first shard of `paths` (globs allowed), where its tokenizer.json lies.
std::string shard_folder(const std::vector<std::string>& paths, const std::string& key);

}  // namespace llmtrain::model
