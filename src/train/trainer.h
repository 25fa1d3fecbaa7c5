// One rank's training state and its optimizer updates. run_training (train/run.h) composes the
// Trainer with the Reporter (train/reporter.h) and the Checkpointer (train/checkpointer.h); the
// Checkpointer sees it only as a CheckpointSource.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "config/config.h"
#include "data/dataset.h"
#include "data/tokenizer.h"
#include "dist/communicator.h"
#include "eval/choice_eval.h"
#include "parallel/attention_choice.h"
#include "model/model.h"
#include "model/moe_layer.h"
#include "ops/buffer.h"
#include "optim/optimizer.h"
#include "parallel/gradient_strategy.h"
#include "parallel/pipeline_executor.h"
#include "parallel/parallel_context.h"
#include "train/checkpointer.h"
#include "train/options.h"
#include "train/step_result.h"

namespace llmtrain::train {

/// Owns one rank's training state: the data (train and validation), the model (and its host copy
/// on a GPU), the gradients' data-parallel strategy, the optimizer (optim.name), the pipeline executor, the sampler
/// position and the tokens seen. Built from a checkpoint when `resume` is given, else from the
/// config's initialisation.
class Trainer final : public CheckpointSource {
 public:
  /// Reads the data first (a bad shard stops the run before anything is written), resolves
  /// model.attention (every rank the same way; InputError for a "cudnn" that cuDNN refuses), then
  /// builds this rank's part of the model and the optimizer. Each rank computes or reads only the
  /// weights it keeps (its segments, or its ZeRO 3 shards): nothing is broadcast.
  /// checkpoint::DamagedCheckpoint on every rank when any rank found the checkpoint damaged.
  Trainer(const TrainOptions& options, const dist::Communicators& comms, const checkpoint::Found* resume);

  /// One optimizer update, number `step` (1-based): the micro-steps, the gradient sync, clipping
  /// and the optimizer's update. A non-finite loss or gradient norm skips the update (the same on every rank).
  StepResult step(std::int64_t step);

  /// The validation losses over train.eval_batches of each set of data.val, and their mean, and
  /// the scores of train.eval_tasks; nullopt when there is neither.
  std::optional<Validation> validate();

  /// The first update this run makes (1, or the resumed checkpoint's step + 1).
  std::int64_t first_step() const { return first_step_; }
  /// The whole model's parameter count (every rank's parts together).
  std::int64_t num_params() const override { return model_->logical_params(); }
  std::int64_t train_samples() const { return train_data_.num_samples(); }
  std::int64_t micro_steps() const { return accum_; }
  std::int64_t tokens_seen() const override { return tokens_seen_; }
  data::SamplerState sampler_state() const override { return sampler_state_; }
  const optim::Optimizer& optimizer() const override { return *optimizer_; }
  /// Bytes this rank holds of weights, gradients and optimizer state (and the buffers that
  /// reduce or gather them), by llmtrain's own count of its buffers: constant through a run.
  std::size_t state_bytes() const;
  /// The attention kernels model.attention resolved to, and why.
  const parallel::AttentionChoice& attention() const { return attention_; }
  /// What model.init_from cost this rank: "read X MiB of tensor data for the Y MiB of weights it
  /// keeps (Rx)"; "" when the weights came from elsewhere.
  const std::string& init_note() const { return init_note_; }
  /// What each of train.eval_tasks costs per validation: "train.eval_tasks NAME: N sequences in M
  /// micro-batches, P positions (padding each to the context: Q)".
  const std::vector<std::string>& task_notes() const { return task_notes_; }
  /// Called in each update before the weights and optimizer state change (a background
  /// checkpoint may still be copying them); empty: nothing to wait for.
  void set_before_update(std::function<void()> hook) override { before_update_ = std::move(hook); }
  /// The whole model's parameter list (names, shapes, flat offsets of the one-rank layout): the
  /// model itself without tensor parallelism, else a description without buffers.
  const model::Model& logical_model() const override;
  /// This rank's fp32 master weights of the runs optimizer() updates, laid out as its state.
  Tensor master() const override { return gradients_->master(); }
  Device device() const override { return device_; }
  /// Where this rank's optimizer state sits in the whole model's flat buffer (the parts a
  /// checkpoint takes from this rank: a replicated parameter's from tensor rank 0 only).
  std::vector<parallel::Placed> optimizer_placement() const override;
  /// Whether this rank writes an optimizer file (the first rank of a data-parallel group, or
  /// every rank when ZeRO shards the state).
  bool writes_optimizer() const override;

 private:
  /// Mixture of Experts: the model's router statistics of this update, reduced over the data ranks, into result.
  void take_moe_stats(StepResult& result);
  /// aux-loss-free balancing: each MoE layer's expert bias += bias_update_rate sign(mean load - load),
  /// the loads the update's global batch's (take_moe_stats), in the master weights (before the optimizer).
  void update_expert_bias();
  // This rank's initial weights, laid out as its held weights, into `to` (host memory): from the
  // checkpoint, model.init_from or train.seed, range by range.
  // Returns the bytes of tensor data read from model.init_from (0 when it is not read).
  std::size_t load_initial_weights(const checkpoint::Found* resume, float* to) const;
  // Every sequence's log-likelihood of its last `ending` tokens, on every rank, by the
  // validation's forward passes (any mesh).
  std::vector<double> sequence_logliks(const std::vector<eval::ChoiceSequence>& sequences);

  const config::Config& config_;
  Device device_;
  const dist::Communicators& comms_;  // every rank, and each mesh axis's group (dist/mesh.h)
  int context_ = 1;                // ranks per context-parallel group: they read the same sequences
  std::int64_t accum_ = 1;
  double tokens_per_step_ = 0;
  data::TokenDataset train_data_;
  std::vector<std::pair<std::string, std::unique_ptr<data::TokenDataset>>> val_sets_;  // data.val's, by name
  std::optional<data::Blender> source_counts_;  // a mixture's samples per source up to sampler_state_
  std::unique_ptr<data::Tokenizer> task_tokenizer_;  // train.eval_tasks: the run's tokenizer
  struct ScoredTask {
    config::EvalTask task;
    std::vector<eval::ChoiceExample> examples;
    std::vector<eval::ChoiceSequence> sequences;  // every choice, tokenized once
  };
  std::vector<ScoredTask> tasks_;  // train.eval_tasks with their examples
  std::int64_t first_step_ = 1, tokens_seen_ = 0, bad_in_a_row_ = 0;
  std::vector<double> moe_loads_;  // the last update's tokens per expert (MoE layers x E), over the global batch
  data::SamplerState sampler_state_;
  parallel::AttentionChoice attention_;
  std::string init_note_;
  std::vector<std::string> task_notes_;
  std::unique_ptr<data::BatchLoader> loader_;
  std::unique_ptr<model::Model> model_;
  std::unique_ptr<model::Model> logical_;  // logical_model() when this rank's model is only part of it
  std::unique_ptr<parallel::GradientStrategy> gradients_;  // bucketed sync (ZeRO 0-2) or ZeRO 3
  std::unique_ptr<optim::Optimizer> optimizer_;  // optim.name's (optim/registry.h)
  std::unique_ptr<parallel::ParallelContext> parallel_;  // this rank's place on the mesh, and the model's groups
  int stages_ = 1;                      // pipeline stages
  std::unique_ptr<parallel::PipelineExecutor> pipeline_;  // its schedule (the one-stage one without a pipeline)
  std::function<void()> before_update_;
};

}  // namespace llmtrain::train
