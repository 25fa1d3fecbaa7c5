// Checkpoints (DESIGN.md layout) and Hugging Face weights in and out.
//
//   DIR/step_00000100/model.safetensors        fp32 weights, named as in the model: where one rank
//                                              holds the whole model's state (one rank, or ZeRO 0
//                                              data parallelism alone)
//   DIR/step_00000100/model-00003.safetensors  else: each writing rank's weights, as ranges of the
//                                              whole model's flat buffer ("ranges", "weights")
//   DIR/step_00000100/optim-00003.safetensors  the optimizer's state tensors of the same ranges,
//                                              by the names it gives them ("adamw.m", "adamw.v")
//   DIR/step_00000100/state.json               step, tokens, sampler, world size, config, data
//                                              sources, and each file's CRC-32, whole and per
//                                              chunk, and the runs its ranges lie in ("spans")
//   DIR/step_00000100/COMPLETE                 written last
//   DIR/latest                                 names the newest complete checkpoint
//
// No rank gathers the model: each writes the ranges it owns, and a resume opens only the files
// and reads only the ranges it needs (on any mesh), checking the CRC-32 of each chunk it reads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "config/config.h"
#include "core/error.h"
#include "dist/communicator.h"
#include "model/model.h"

namespace llmtrain::checkpoint {

/// A range [begin, end) of the model's flat parameter buffer: the one range type of gradients,
/// ZeRO units, the optimizer and checkpoints (model/flat_layout.h).
using FlatRange = model::FlatRange;

/// One array of the optimizer's state (optim::StateTensor) under the name the optimizer gives it:
/// laid out like the weights, or (`partial`) holding only the sorted runs `held` of the rank's
/// local arrays, end to end; it is written as zero where it holds nothing.
struct NamedState {
  std::string name;
  const float* data = nullptr;
  bool partial = false;
  std::vector<FlatRange> held = {};
};

/// One rank's part of the training state: ranges of the whole model's flat buffer, and their fp32
/// weights and optimizer state tensors, each laid end to end (as many elements as the ranges
/// hold). One range [0, P): the rank holds the whole state.
struct StatePart {
  std::vector<FlatRange> ranges;
  const float* weights = nullptr;
  std::vector<NamedState> optimizer;
  /// Where each range starts in the arrays (elements); empty: end to end from 0. So a rank
  /// writes its state from where it lives, without compacting copies.
  std::vector<std::int64_t> at = {};
  std::int64_t size() const;
};

struct SaveRequest {
  std::string root;            // DIR above
  std::int64_t step = 0;
  std::int64_t keep_last = 3;  // older complete checkpoints are deleted after this one is complete
  const model::Model* model = nullptr;  // the whole model's parameters (names, shapes, flat offsets)
  StatePart part;              // this rank's
  nlohmann::json state;        // tokens_seen, sampler, ... ; "step" and "files" are added here
  std::size_t write_chunk = 32 << 20;  // bytes per write(2) call
  bool writes = true;          // false: another rank writes the same state (a data-parallel replica)
};

/// The most runs state.json lists for one file: enough for a ZeRO 3 shard of a model of a hundred
/// layers or more (a run per layer); a file of more ranges is listed by fewer, wider runs.
inline constexpr std::size_t max_index_spans = 128;

/// `ranges` (any order) as at most `limit` sorted disjoint runs that cover them: touching ones
/// joined, then the smallest gaps closed until `limit` remain (empty ranges left out).
std::vector<FlatRange> index_spans(std::vector<FlatRange> ranges, std::size_t limit = max_index_spans);

/// What one rank wrote of a checkpoint: each file's name, CRC-32 and size, or why it could not.
struct WrittenPart {
  struct File {
    std::string name;
    std::uint32_t crc32 = 0;
    std::int64_t bytes = 0;
    std::int64_t chunk_bytes = 0;         // the CRC-32 of each chunk of this many bytes:
    std::vector<std::uint32_t> chunk_crc32;  // in order (the last chunk may be short)
    // At most max_index_spans runs of the whole model's flat buffer that cover the file's
    // ranges (index_spans): state.json's index of which file a reader opens for which ranges.
    std::vector<FlatRange> spans;
  };
  std::vector<File> files;
  std::string error;     // empty: every file is written, fsynced and renamed into place
  double seconds = 0.0;  // from the first byte to the last file's rename
  std::string dir;       // the folder written (prepare_dir's)
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
///    complete and creates the step folder; then every rank learns the folder. A complete
///    checkpoint of the same step is never deleted here: the new one is written beside it (a
///    hidden `.replacing-step_N`) and commit swaps it in once complete. Returns the folder to
///    write into.
std::string prepare_dir(const std::string& root, std::int64_t step, dist::Communicator& comm);
/// The folder of step `step`'s checkpoint under `root` (ROOT/step_%08d).
std::string step_dir(const std::string& root, std::int64_t step);
/// 2. write_part (no communication; any thread): this rank's files, its weights as
///    model-RANK.safetensors and its moments as optim-RANK.safetensors (a rank holding the whole
///    state: model.safetensors, named tensors; only rank 0 writes when every rank does), each file
///    in its own thread, streamed to a temporary name with its CRC-32s computed as it goes,
///    fsynced, renamed. An I/O failure is returned in `error`, not thrown.
WrittenPart write_part(const SaveRequest& request, const std::string& dir, int rank, int world_size);
/// 3. commit (collective, every rank with its write_part): the ranks agree that all their files
///    are durable (else RuntimeError on every rank: on a failing rank its own error, on the others
///    which rank failed). Then rank 0 writes state.json (with every file's checksum), COMPLETE,
///    `latest`, and renames checkpoints beyond keep_last to hidden `.pruned-step_N` folders (the
///    caller deletes them: remove_pruned). So a crash at any moment before leaves the previous
///    checkpoint as `latest`, whole.
Committed commit(const SaveRequest& request, const WrittenPart& mine, dist::Communicator& comm);

/// Deletes the folders commit() set aside in `root` (a crash's leftovers too); best effort (what
/// cannot be deleted now is tried again after the next save). Slow for large checkpoints: the
/// caller may run it in the background.
void remove_pruned(const std::string& root);

/// The three parts in a row (called by every rank); returns the checkpoint's folder.
std::string save(const SaveRequest& request, dist::Communicator& comm);

/// A checkpoint found from a path: a step folder, a checkpoints folder (its `latest`) or a run
/// folder (RUN/checkpoints/latest). Its files' sizes are checked against state.json; their
/// checksums as they are read (load_state, load_model) or all at once (verify_files).
/// The step folder a path names: itself, or the one `latest` names in it or in its checkpoints/.
std::string resolve_dir(const std::string& path);

/// InputError naming `file` and the key unless `state` is a state.json as save() writes it: step,
/// tokens_seen, world_size, zero_stage, sampler.{epoch,next_sample} integers in range, a config
/// object, and files: plain file names (model.safetensors or model-*.safetensors among them) with
/// crc32 and bytes, and optionally chunk_bytes and chunk_crc32 (one per chunk of the file).
void validate_state(const nlohmann::json& state, const std::string& file);

/// The commit marker (COMPLETE) of a checkpoint whose state.json holds `state_text`: state.json's
/// CRC-32 and size, as JSON. Written last, it records the one file that state.json itself cannot.
std::string complete_marker(std::string_view state_text);

/// DamagedCheckpoint unless `state_text` (state.json of the checkpoint in `dir`) has the size and
/// CRC-32 recorded in dir/COMPLETE; an empty COMPLETE (an earlier version's) records none and
/// passes. InputError naming COMPLETE when it is not a marker.
void check_state_file(const std::string& dir, std::string_view state_text);

struct Found {
  std::string dir;
  nlohmann::json state;
  config::Config config;
};
Found find(const std::string& path);

/// The step folders under `root` that hold a COMPLETE file, newest first (full paths).
std::vector<std::string> complete_checkpoints(const std::string& root);

/// A damaged checkpoint: a file whose bytes do not match their checksum, or that does not hold
/// what state.json and its header say. (A resume that finds one on any rank may fall back to an
/// older checkpoint.)
class DamagedCheckpoint : public InputError {
 public:
  using InputError::InputError;
};

/// Which state load_state reads: the fp32 weights, or the optimizer's state tensors (by name).
enum class StateKind { weights, optimizer };

class StateIndex;

/// load_state's reader, kept open for many reads (an export reads one tensor at a time): the
/// files' ranges are indexed once.
class StateReader {
 public:
  /// `names`: the optimizer's state tensors to read (StateKind::optimizer), in the order of the
  /// output arrays; for the weights none.
  StateReader(const Found& found, StateKind kind, const std::vector<std::string>& names = {});
  ~StateReader();
  StateReader(const StateReader&) = delete;
  StateReader& operator=(const StateReader&) = delete;
  void read(const std::vector<FlatRange>& ranges, const std::vector<float*>& out) const;
  /// The files opened so far: those holding ranges read (state.json's spans say which), and every
  /// file of a checkpoint whose state.json lists no spans (an earlier version's).
  std::size_t files_opened() const;

 private:
  std::unique_ptr<StateIndex> index_;
  std::string dir_;
  StateKind kind_;
};

/// Fills `out` (one array for weights; for the optimizer one per name of `names`, the tensors its
/// state() lists, e.g. "adamw.m" and "adamw.v") with the state of the flat
/// ranges `ranges` of the whole model, laid end to end, from whichever files hold them: any world
/// size, ZeRO stage or layout wrote them, this version or an earlier one (model.safetensors named
/// tensors; optimizer files with ranges in their metadata). Reads only the chunks of the files
/// that hold those ranges (matched by a sorted merge: O((n + m) log m) for n wanted and m held
/// ranges), and checks each chunk's CRC-32 as it reads it (files with only a whole-file CRC-32:
/// the whole file). DamagedCheckpoint naming the file on a mismatch or on ranges not covered.
void load_state(const Found& found, StateKind kind, const std::vector<FlatRange>& ranges,
                const std::vector<float*>& out, const std::vector<std::string>& names = {});

/// Reads every file of the checkpoint and checks it against state.json's CRC-32s; DamagedCheckpoint
/// naming the first that differs.
void verify_files(const Found& found);

/// Fills the model's parameters: the whole model's, or those of a part (a pipeline stage, a
/// tensor-parallel rank's layout), each segment read from the files that hold it.
void load_weights(const Found& found, model::Model& model);

/// InputError unless the checkpoint's weight files are large enough for the fp32 parameters of
/// the model its config describes (checked before anything of that size is allocated or read).
void check_weights_fit(const Found& found);

/// The checkpoint's model on the CPU, built from its config, with its weights.
std::unique_ptr<model::Model> load_model(const Found& found);

/// "GPT2LMHeadModel" or "LlamaForCausalLM": the transformers class of this config's exports.
std::string hf_architecture(const config::ModelConfig& config);

/// Writes DIR/model.safetensors and DIR/config.json that transformers' GPT2LMHeadModel or
/// LlamaForCausalLM loads (GPT-2's Conv1D weights transposed to (in, out); a tied lm_head left out).
void export_hf(const model::Model& model, const std::string& dir);
/// How export_hf_streamed writes: the dtype of the weights (F32 or BF16) and the most bytes a
/// file of them holds (more: Hugging Face's shards, model-0000K-of-0000N.safetensors and
/// model.safetensors.index.json).
struct HfExportOptions {
  bool bf16 = false;
  std::int64_t shard_bytes = std::int64_t(5) << 30;
};
struct HfExported {
  std::vector<std::string> files;  // the weight files written, in order
  std::int64_t bytes = 0;
};
/// Writes a checkpoint's weights as export_hf does, one tensor at a time from the checkpoint's
/// files (whatever ranks wrote them): the model is never built, and memory holds about one tensor.
HfExported export_hf_streamed(const Found& found, const std::string& dir, const HfExportOptions& options);

/// Writes DIR/config.json as transformers (and Optimum, beside an ONNX export) read it:
/// architecture, vocabulary and shapes. Written atomically.
void write_hf_config(const config::ModelConfig& config, const std::string& dir);

/// Reads Hugging Face weights into the model: a safetensors file, or a folder holding
/// model.safetensors or the shards model.safetensors.index.json lists; GPT-2 names with or without
/// the "transformer." prefix; F32, BF16 or F16. InputError naming the file and tensor on any
/// missing, unexpected or misshapen tensor, and (Llama) when the folder's config.json disagrees
/// with the config on rope_theta, rms_norm_eps or tie_word_embeddings.
void import_hf(const std::string& path, model::Model& model);

/// Fills `out` with the flat ranges `ranges` (laid end to end) of the whole model whose parameters
/// `logical` lists (the one-rank layout's names, shapes and offsets: a sharded model without
/// buffers will do), from Hugging Face weights as import_hf reads them: only the wanted elements
/// of each tensor (a tensor stored transposed, as GPT-2's Conv1D weights, is read as a piece of
/// each stored row). Every tensor's name and shape is checked as import_hf does. Returns the bytes
/// of tensor data read from the files.
std::size_t import_hf_ranges(const std::string& path, const model::Model& logical,
                             const std::vector<FlatRange>& ranges, float* out);

}  // namespace llmtrain::checkpoint
