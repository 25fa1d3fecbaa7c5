// Checkpoints (DESIGN.md layout) and Hugging Face GPT-2 weights in and out.
//
//   DIR/step_00000100/model.safetensors   fp32 weights, named and laid out as in the model
//   DIR/step_00000100/optim-00000.safetensors  AdamW m and v of ranges of the flat buffer
//   DIR/step_00000100/state.json          step, tokens, sampler, world size, config, checksums
//   DIR/step_00000100/COMPLETE            written last
//   DIR/latest                            names the newest complete checkpoint
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "config/config.h"
#include "dist/communicator.h"
#include "model/model.h"

namespace llmtrain::checkpoint {

/// A range [begin, end) of the model's flat parameter buffer: the one range type of gradients,
/// ZeRO units, the optimizer and checkpoints (model/flat_layout.h).
using FlatRange = model::FlatRange;

/// One rank's AdamW state: flat-buffer ranges, and their moments laid end to end (as many
/// elements as the ranges hold, each). One range [0, P): every rank holds the whole state.
struct OptimizerShard {
  std::vector<FlatRange> ranges;
  const float* m = nullptr;
  const float* v = nullptr;
  std::int64_t size() const;
};

struct SaveRequest {
  std::string root;            // DIR above
  std::int64_t step = 0;
  std::int64_t keep_last = 3;  // older complete checkpoints are deleted after this one is complete
  const model::Model* model = nullptr;  // names and shapes of the weights
  const float* weights = nullptr;       // the flat weights to write (host memory); null: the model's params()
  OptimizerShard optimizer;    // this rank's
  nlohmann::json state;        // tokens_seen, sampler, ... ; "step" and "files" are added here
  std::size_t write_chunk = 32 << 20;  // bytes per write(2) call
  bool write_optimizer = true;  // false: another rank writes the same state
};

/// What one rank wrote of a checkpoint: each file's name, CRC-32 and size, or why it could not.
struct WrittenPart {
  struct File {
    std::string name;
    std::uint32_t crc32 = 0;
    std::int64_t bytes = 0;
  };
  std::vector<File> files;
  std::string error;     // empty: every file is written, fsynced and renamed into place
  double seconds = 0.0;  // from the first byte to the last file's rename
  std::int64_t bytes() const;
};

/// A checkpoint made complete by commit(): every rank's bytes, and the slowest rank's write time.
struct Committed {
  std::string dir;
  std::int64_t bytes = 0;
  double write_seconds = 0.0;
};

/// A save in three parts, so that the writing can run in the background (train/checkpointer.h):
/// 1. prepare_dir (collective): rank 0 removes an earlier attempt at this step that never became
///    complete and creates the step folder; then a barrier. Returns the folder.
std::string prepare_dir(const std::string& root, std::int64_t step, dist::Communicator& comm);
/// 2. write_part (no communication; any thread): this rank's files. Rank 0 the weights, each rank
///    its optimizer range as optim-RANK.safetensors (only rank 0 when every rank holds the whole
///    state), each file in its own thread, streamed to a temporary name with its CRC-32 computed
///    as it goes, fsynced, renamed. An I/O failure is returned in `error`, not thrown.
WrittenPart write_part(const SaveRequest& request, const std::string& dir, int rank, int world_size);
/// 3. commit (collective, every rank with its write_part): the ranks agree that all their files
///    are durable (else RuntimeError on every rank: on a failing rank its own error, on the others
///    which rank failed). Then rank 0 writes state.json (with every file's checksum), COMPLETE,
///    `latest`, and deletes checkpoints beyond keep_last. So a crash at any moment before leaves
///    the previous checkpoint as `latest`, whole.
Committed commit(const SaveRequest& request, const WrittenPart& mine, dist::Communicator& comm);

/// The three parts in a row (called by every rank); returns the checkpoint's folder.
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

/// Fills m and v with the AdamW state of the flat-buffer `ranges`, laid end to end, taken from
/// the checkpoint's optimizer files whatever world size and ZeRO stage wrote them. A file holds
/// one range (metadata range_begin, range_end) or several ("ranges": "b0:e0,b1:e1,..."), its
/// tensors adamw.m and adamw.v theirs end to end.
void load_optimizer(const Found& found, const std::vector<FlatRange>& ranges, float* m, float* v);

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
