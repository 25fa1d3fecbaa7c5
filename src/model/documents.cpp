#include "model/documents.h"

#include <filesystem>
#include <optional>

#include "core/error.h"
#include "data/shard.h"
#include "data/tokenizer.h"

namespace llmtrain::model {

Model::Documents documents_for(const config::DataConfig& data, const config::ModelConfig& model,
                               const std::string& shard_dir, Device device) {
  Model::Documents documents;
  if (!data.document_mask && !data.reset_positions) return documents;
  const char* key = data.document_mask ? "data.document_mask" : "data.reset_positions";
  const std::optional<std::uint32_t> eot = data::recorded_eot_token(shard_dir, model.vocab_size);
  if (!eot) {
    throw InputError(std::string(key) + ": the tokenizer recorded in " + shard_dir +
                     "/tokenizer.json has no end-of-text token, so the documents of a sequence cannot be told apart");
  }
  if (data.document_mask && device == Device::cuda && model.attention == config::Attention::cudnn) {
    throw InputError("data.document_mask: cuDNN's attention (model.attention \"cudnn\") has no document mask; "
                     "use model.attention \"auto\" or \"flash\"");
  }
  documents.eot = std::int32_t(*eot);
  documents.mask = data.document_mask;
  documents.reset_positions = data.reset_positions;
  return documents;
}

std::string shard_folder(const std::vector<std::string>& paths, const std::string& key) {
  const std::vector<std::string> shards = data::expand_paths(paths, key);
  const std::string folder = std::filesystem::path(shards.front()).parent_path().string();
  return folder.empty() ? "." : folder;
}

}  // namespace llmtrain::model
