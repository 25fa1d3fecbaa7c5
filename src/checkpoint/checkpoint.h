// Checkpoints (DESIGN.md layout) and Hugging Face GPT-2 weights in and out.
//
//   DIR/step_00000100/model.safetensors   fp32 weights, named and laid out as in the model
//   DIR/step_00000100/optim-00000.safetensors  AdamW m and v as a range of the flat buffer
//   DIR/step_00000100/state.json          step, tokens, sampler, world size, config, checksums
//   DIR/step_00000100/COMPLETE            written last
//   DIR/latest                            names the newest complete checkpoint
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "config/config.h"
#include "dist/communicator.h"
#include "model/model.h"

namespace llmtrain::checkpoint {

/// One rank's AdamW state: the flat-buffer range [begin, end) and its moments (end - begin each).
struct OptimizerShard {
  std::int64_t begin = 0, end = 0;
  const float* m = nullptr;
  const float* v = nullptr;
};

struct SaveRequest {
  std::string root;            // DIR above
  std::int64_t step = 0;
  std::int64_t keep_last = 3;  // older complete checkpoints are deleted after this one is complete
  const model::Model* model = nullptr;
  OptimizerShard optimizer;    // this rank's
  nlohmann::json state;        // tokens_seen, sampler, ... ; "step" and "files" are added here
};

/// Writes one checkpoint, every rank its part: rank 0 the weights, each rank its optimizer range
/// as optim-RANK.safetensors (only rank 0 when every rank holds the whole state); each file to a
/// temporary name, fsynced, renamed. After a barrier rank 0 writes state.json (with every file's
/// checksum), then COMPLETE, then `latest`, then deletes checkpoints beyond keep_last. Called by
/// every rank; returns the checkpoint's folder.
std::string save(const SaveRequest& request, dist::Communicator& comm);

/// A checkpoint found from a path: a step folder, a checkpoints folder (its `latest`) or a run
/// folder (RUN/checkpoints/latest). Its files are checked against the checksums in state.json.
/// The step folder a path names: itself, or the one `latest` names in it or in its checkpoints/.
std::string resolve_dir(const std::string& path);

/// InputError naming `file` and the key unless `state` is a state.json as save() writes it: step,
/// tokens_seen, world_size, zero_stage, sampler.{epoch,next_sample} integers in range, a config
/// object, and files: plain file names (model.safetensors among them) with crc32 and bytes.
void validate_state(const nlohmann::json& state, const std::string& file);

struct Found {
  std::string dir;
  nlohmann::json state;
  config::Config config;
};
Found find(const std::string& path);

/// The step folders under `root` that hold a COMPLETE file, newest first (full paths).
std::vector<std::string> complete_checkpoints(const std::string& root);

/// Fills m and v (end - begin each) with the AdamW state of flat-buffer range [begin, end), taken
/// from the checkpoint's optimizer files whatever world size and ZeRO stage wrote them.
void load_optimizer(const Found& found, std::int64_t begin, std::int64_t end, float* m, float* v);

/// Fills the model's parameters from DIR/model.safetensors of a found checkpoint.
void load_weights(const Found& found, model::Model& model);

/// The checkpoint's model on the CPU, built from its config, with its weights.
std::unique_ptr<model::Model> load_model(const Found& found);

/// "GPT2LMHeadModel" or "LlamaForCausalLM": the transformers class of this config's exports.
std::string hf_architecture(const config::ModelConfig& config);

/// Writes DIR/model.safetensors and DIR/config.json that transformers' GPT2LMHeadModel or
/// LlamaForCausalLM loads (GPT-2's Conv1D weights transposed to (in, out); a tied lm_head left out).
void export_hf(const model::Model& model, const std::string& dir);
/// Writes DIR/config.json as transformers (and Optimum, beside an ONNX export) read it:
/// architecture, vocabulary and shapes. Written atomically.
void write_hf_config(const config::ModelConfig& config, const std::string& dir);

/// Reads Hugging Face weights into the model: a safetensors file, or a folder holding
/// model.safetensors or the shards model.safetensors.index.json lists; GPT-2 names with or without
/// the "transformer." prefix; F32, BF16 or F16. InputError naming the file and tensor on any
/// missing, unexpected or misshapen tensor, and (Llama) when the folder's config.json disagrees
/// with the config on rope_theta, rms_norm_eps or tie_word_embeddings.
void import_hf(const std::string& path, model::Model& model);

}  // namespace llmtrain::checkpoint
