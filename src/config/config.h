// The run configuration: typed structs with defaults, loaded strictly from JSON.
//
// Each section lists its keys once, in `fields()`, together with the range each value must lie
// in; the strict reader, the writer of the resolved config and the documentation table in
// configs/README.md all follow that one list.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "config/choices.h"

namespace llmtrain::config {

/// An integer in [min, max].
struct IntRange {
  std::int64_t min;
  std::int64_t max = std::numeric_limits<std::int64_t>::max();
};

/// A number in the interval from min to max; each end open or closed.
struct NumberRange {
  double min;
  double max = std::numeric_limits<double>::infinity();
  bool min_open = false;
  bool max_open = false;
};
inline constexpr NumberRange positive{0.0, std::numeric_limits<double>::infinity(), true, false};
inline constexpr NumberRange non_negative{0.0};
inline constexpr NumberRange unit_open_right{0.0, 1.0, false, true};  // [0, 1)

/// A list of integers, each in `each` (a JSON array; [] for none).
struct IntList {
  IntRange each;
};

/// A string from a fixed list.
struct OneOf {
  std::vector<std::string> values;
};

/// optim.name: one of optimizer_names().
struct OptimizerName {};

/// The names optim.name accepts: "adamw", and those optim::register_optimizer (optim/registry.h)
/// added since, which also holds what each selects.
std::vector<std::string> optimizer_names();
/// Adds `name` to optimizer_names() (once).
void add_optimizer_name(const std::string& name);

/// One of an enum's names (config/choices.h): the member's type says which.
struct Named {};

/// Any string (paths). A list of paths accepts a string or an array of strings.
struct AnyString {};

/// true or false.
struct Boolean {};

/// data.train: a path or a list of paths (one source), or a list of {"path", "weight"} objects.
struct WeightedPaths {};

/// data.val: a path or a list of paths (one unnamed set), or an object {"NAME": paths, ...}.
struct NamedPaths {};

/// train.eval_tasks: a list of {"task", "path", "limit", "name"} objects.
struct TaskList {};

/// Whether a key may differ between a checkpoint's config and the config that resumes from it:
/// the model's shape and the data order (global_batch_size) must stay; the rest may change.
/// A field's optional fourth descriptor; may_change when not given.
enum class OnResume { may_change, must_match };

/// model.moe: a Mixture-of-Experts MLP in the llama family's layers (docs/moe.md), read as one
/// object whose keys are each checked like a section's (config/moe_keys.cpp). `enabled` false
/// (the key absent or null): every layer keeps its dense MLP.
struct MoeConfig {
  bool enabled = false;
  std::int64_t experts = 0;            // E routed experts per MoE layer
  std::int64_t top_k = 0;              // k experts per token
  std::int64_t ffn_hidden = 0;         // each routed expert's SwiGLU width
  std::int64_t shared_experts = 0;     // always-on experts, added to the routed output
  std::int64_t shared_ffn_hidden = 0;  // each shared expert's width; 0: ffn_hidden (resolved on load)
  std::int64_t first_dense_layers = 0; // the first N layers keep model.ffn_hidden's dense MLP
  std::string router = "softmax";      // "softmax" or "sigmoid" (DeepSeek-V3)
  bool normalize_top_k = true;         // softmax: the k weights renormalised to sum 1
  double route_scale = 1.0;            // the k weights' factor
  double aux_loss_coef = 0.01;         // switch load-balancing loss
  double z_loss_coef = 0.0;            // router z-loss
  double bias_update_rate = 0.0;       // aux-loss-free balancing (the expert bias moves by it per update)
  double capacity_factor = 0.0;        // 0: dropless
  bool operator==(const MoeConfig&) const = default;
};

/// model.moe: an object of MoeConfig's keys, or null.
struct MoeKeys {};

struct ModelConfig {
  Arch arch = Arch::gpt2;
  std::int64_t vocab_size = 50257;
  std::int64_t context_length = 1024;
  std::int64_t n_layer = 12;
  std::int64_t n_head = 12;
  std::int64_t n_kv_head = 0;   // 0: same as n_head (resolved on load)
  std::int64_t d_model = 768;
  std::int64_t ffn_hidden = 0;  // 0: 4 * d_model (resolved on load)
  double norm_eps = 1e-5;       // llama: RMSNorm epsilon
  double rope_theta = 10000.0;  // llama: rotary embedding base
  bool tie_embeddings = true;   // output head shares the token embedding; unset: gpt2 true, llama false
  bool qk_norm = false;         // llama: RMSNorm over each query and key head before RoPE (Qwen3, OLMoE)
  Attention attention = Attention::automatic;  // GPU attention kernels: auto, our flash attention, or cuDNN's fused attention
  std::string init_from;        // Hugging Face style safetensors file or folder; empty: random init
  MoeConfig moe;                // Mixture-of-Experts MLPs (llama); absent: dense

  template <class Visitor>
  void fields(Visitor&& v) {
    v("arch", arch, Named{}, OnResume::must_match);
    v("vocab_size", vocab_size, IntRange{1, std::int64_t{1} << 31}, OnResume::must_match);
    v("context_length", context_length, IntRange{1, 1 << 20}, OnResume::must_match);
    v("n_layer", n_layer, IntRange{1, 1024}, OnResume::must_match);
    v("n_head", n_head, IntRange{1, 1024}, OnResume::must_match);
    v("n_kv_head", n_kv_head, IntRange{0, 1024}, OnResume::must_match);
    v("d_model", d_model, IntRange{1, 1 << 17}, OnResume::must_match);
    v("ffn_hidden", ffn_hidden, IntRange{0, 1 << 20}, OnResume::must_match);
    v("norm_eps", norm_eps, NumberRange{0.0, 1.0, true, true}, OnResume::must_match);
    v("rope_theta", rope_theta, positive, OnResume::must_match);
    v("tie_embeddings", tie_embeddings, Boolean{}, OnResume::must_match);
    v("qk_norm", qk_norm, Boolean{}, OnResume::must_match);
    v("attention", attention, Named{});
    v("init_from", init_from, AnyString{});
    v("moe", moe, MoeKeys{}, OnResume::must_match);
  }
};

/// One source of training data: its shard paths or globs, its share of the samples, and the name
/// its tokens are reported under (tokens_seen/NAME; empty: its index in the list).
struct TrainSource {
  std::vector<std::string> paths;
  double weight = 1.0;
  std::string name;
  bool operator==(const TrainSource&) const = default;
};

/// data.train: one source (a path or a list, `weighted` false) or weighted sources.
struct TrainData {
  std::vector<TrainSource> sources;  // empty: none given
  bool weighted = false;             // given as [{"path", "weight"}, ...] (and written back so)
  bool empty() const { return sources.empty(); }
  /// Every source's paths, in order.
  std::vector<std::string> paths() const;
  /// The name source `index` is reported under.
  std::string name(std::size_t index) const;
};

/// One validation set: its name ("" for the unnamed set of the plain form) and its shards.
struct ValSet {
  std::string name;
  std::vector<std::string> paths;
  bool operator==(const ValSet&) const = default;
};

/// data.val: one unnamed set (a path or a list) or named sets, in name order.
struct ValData {
  std::vector<ValSet> sets;  // empty: no validation
  bool named = false;        // given as {"NAME": paths, ...}
  bool empty() const { return sets.empty(); }
  /// Every set's paths, in order.
  std::vector<std::string> paths() const;
};

struct DataConfig {
  TrainData train;  // token shard files: one source or weighted sources
  ValData val;      // validation shards: one set or named sets
  bool shuffle = true;
  std::int64_t seed = 1234;
  // A resume whose data.train weights or shard files differ from the checkpoint's continues with
  // the new mixture from the checkpoint's step (false: refused, train/data_record.h).
  bool resume_changed_mixture = false;
  // Packed sequences: the end-of-text token of the tokenizer beside the shards ends a document.
  bool document_mask = false;    // attention stays within each document of a sequence
  bool reset_positions = false;  // positions count from each document's first token

  template <class Visitor>
  void fields(Visitor&& v) {
    v("train", train, WeightedPaths{});
    v("val", val, NamedPaths{});
    v("shuffle", shuffle, Boolean{});
    v("seed", seed, IntRange{0});
    v("resume_changed_mixture", resume_changed_mixture, Boolean{});
    v("document_mask", document_mask, Boolean{});
    v("reset_positions", reset_positions, Boolean{});
  }
};

/// A multiple-choice benchmark run at every validation (train.eval_tasks).
struct EvalTask {
  std::string task;        // "hellaswag", "hellaswag_llmc" or "choice"
  std::string path;        // its JSON Lines file
  std::int64_t limit = 0;  // the first N examples; 0: all
  std::string name;        // its scores' prefix (NAME/acc, ...); empty: `task`
  bool operator==(const EvalTask&) const = default;
  std::string metric_name() const { return name.empty() ? task : name; }
};

struct TrainConfig {
  std::int64_t micro_batch_size = 4;   // sequences per rank per micro-step
  std::int64_t global_batch_size = 8;  // sequences per optimizer update, all ranks together
  std::int64_t max_steps = 1000;
  double grad_clip = 1.0;  // max global gradient norm; 0 disables clipping
  std::int64_t seed = 1337;
  std::int64_t log_every = 10;
  std::int64_t eval_every = 100;  // 0: no periodic validation
  std::int64_t eval_batches = 20;
  Precision precision = Precision::fp32;
  std::int64_t max_bad_steps = 5;  // non-finite updates in a row before the run stops
  double peak_tflops = 0.0;        // dense peak of one device for MFU; 0: unknown (MFU not reported)
  Recompute recompute = Recompute::none;  // activations backward recomputes
  bool deterministic = true;  // bitwise-reproducible GPU kernels; false: faster bf16 flash attention backward
  std::vector<EvalTask> eval_tasks;  // benchmarks scored at every validation

  template <class Visitor>
  void fields(Visitor&& v) {
    v("micro_batch_size", micro_batch_size, IntRange{1});
    v("global_batch_size", global_batch_size, IntRange{1}, OnResume::must_match);
    v("max_steps", max_steps, IntRange{1});
    v("grad_clip", grad_clip, non_negative);
    v("seed", seed, IntRange{0});
    v("log_every", log_every, IntRange{1});
    v("eval_every", eval_every, IntRange{0});
    v("eval_batches", eval_batches, IntRange{1});
    v("precision", precision, Named{});
    v("max_bad_steps", max_bad_steps, IntRange{1});
    v("peak_tflops", peak_tflops, non_negative);
    v("recompute", recompute, Named{});
    v("deterministic", deterministic, Boolean{});
    v("eval_tasks", eval_tasks, TaskList{});
  }
};

/// optim.muon: the Muon optimizer's keys (optim/muon.h), read as one object whose keys are each
/// checked like a section's (config/muon_keys.cpp).
struct MuonConfig {
  std::optional<double> lr;            // absent: optim.lr (the schedule scales it alike)
  double momentum = 0.95;
  bool nesterov = true;
  std::int64_t ns_steps = 5;           // Newton-Schulz iterations
  std::vector<double> ns_coefficients{3.4445, -4.7750, 2.0315};  // (a, b, c)
  std::string adjust_lr = "match_rms_adamw";  // or "original"
  std::optional<double> weight_decay;  // absent: optim.weight_decay
  double eps = 1e-7;                   // floor of the Frobenius norm Newton-Schulz divides by
  bool operator==(const MuonConfig&) const = default;
};

/// optim.muon: an object of MuonConfig's keys.
struct MuonKeys {};

struct OptimConfig {
  std::string name = "adamw";  // the optimizer (optim/registry.h); its state is what checkpoints hold
  double lr = 6e-4;
  double min_lr = 6e-5;
  std::int64_t warmup_steps = 100;
  std::string schedule = "cosine";
  double weight_decay = 0.1;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  MuonConfig muon;  // read whatever optim.name is; used when it is "muon"

  template <class Visitor>
  void fields(Visitor&& v) {
    v("name", name, OptimizerName{}, OnResume::must_match);
    v("lr", lr, positive);
    v("min_lr", min_lr, non_negative);
    v("warmup_steps", warmup_steps, IntRange{0});
    v("schedule", schedule, OneOf{{"cosine", "linear", "constant"}});
    v("weight_decay", weight_decay, non_negative);
    v("beta1", beta1, unit_open_right);
    v("beta2", beta2, unit_open_right);
    v("eps", eps, positive);
    v("muon", muon, MuonKeys{});
  }
};

struct DistConfig {
  std::int64_t zero_stage = 0;
  bool reshard_after_forward = true;   // ZeRO 3: free each layer's gathered weights after its forward
  std::int64_t tensor_parallel = 1;    // ranks per tensor-parallel group (the fastest mesh axis)
  bool sequence_parallel = false;      // tensor parallelism: norms and residual adds on 1/tensor_parallel of the tokens
  std::int64_t context_parallel = 1;   // ranks that split each sequence (mesh axis after tensor)
  ContextParallelMode context_parallel_mode = ContextParallelMode::ring;  // how they share keys and values
  std::int64_t expert_parallel = 1;    // ranks that split each MoE layer's experts (out of the data ranks)
  std::int64_t pipeline_parallel = 1;  // pipeline stages (the slowest mesh axis)
  PipelineSchedule pipeline_schedule = PipelineSchedule::one_f_one_b;  // order of micro-batches on a stage
  std::int64_t virtual_stages = 1;     // interleaved: model chunks per stage
  std::vector<std::int64_t> pipeline_layers;  // layers per virtual stage, by hand; empty: balanced by cost
  double bucket_mb = 25.0;
  double timeout_s = 600.0;
  std::int64_t replica_check_every = 100;  // steps between weight checksum comparisons; 0: never

  template <class Visitor>
  void fields(Visitor&& v) {
    v("zero_stage", zero_stage, IntRange{0, 3});
    v("reshard_after_forward", reshard_after_forward, Boolean{});
    v("tensor_parallel", tensor_parallel, IntRange{1, 4096});
    v("sequence_parallel", sequence_parallel, Boolean{});
    v("context_parallel", context_parallel, IntRange{1, 4096});
    v("context_parallel_mode", context_parallel_mode, Named{});
    v("expert_parallel", expert_parallel, IntRange{1, 4096});
    v("pipeline_parallel", pipeline_parallel, IntRange{1, 4096});
    v("pipeline_schedule", pipeline_schedule, Named{});
    v("virtual_stages", virtual_stages, IntRange{1, 1024});
    v("pipeline_layers", pipeline_layers, IntList{IntRange{1, 1024}});
    v("bucket_mb", bucket_mb, positive);
    v("timeout_s", timeout_s, positive);
    v("replica_check_every", replica_check_every, IntRange{0});
  }
};

struct CheckpointConfig {
  std::int64_t every = 1000;  // steps between checkpoints; 0: only at the end of the run
  std::int64_t keep_last = 3;
  std::string dir;  // empty: RUN_DIR/checkpoints
  bool async = true;  // written by a background thread from a host copy (where memory allows)

  template <class Visitor>
  void fields(Visitor&& v) {
    v("every", every, IntRange{0});
    v("keep_last", keep_last, IntRange{1});
    v("dir", dir, AnyString{});
    v("async", async, Boolean{});
  }
};

struct Config {
  ModelConfig model;
  DataConfig data;
  TrainConfig train;
  OptimConfig optim;
  DistConfig dist;
  CheckpointConfig checkpoint;

  template <class Visitor>
  void sections(Visitor&& v) {
    v("model", model);
    v("data", data);
    v("train", train);
    v("optim", optim);
    v("dist", dist);
    v("checkpoint", checkpoint);
  }
};

/// One `--set KEY=VALUE` from the command line, as typed.
struct Override {
  std::string text;
};

/// Parses the file at `path` (empty: defaults only), applies `overrides` in order, reads every
/// key strictly and checks the cross-field rules. Throws InputError naming the key path and
/// where the bad value came from (the file, or the --set that gave it).
Config load_config(const std::string& path, const std::vector<Override>& overrides = {});

/// Same as load_config, from JSON text already in memory; `origin` names it in errors.
Config parse_config(const std::string& text, const std::string& origin,
                    const std::vector<Override>& overrides = {});

/// False for the keys whose fields say OnResume::must_match ("model.n_layer"); true for the
/// others, and for any key path the config does not have.
bool may_change_on_resume(const std::string& key_path);

/// The resolved config: every key, defaults filled in.
nlohmann::json to_json(const Config& config);

/// Checks that need the mesh: global_batch_size divisible by micro_batch_size x the data-parallel
/// size (the ranks that see different data). Returns the gradient-accumulation micro-steps per update.
std::int64_t grad_accum_steps(const Config& config, int data_parallel_size);

}  // namespace llmtrain::config
