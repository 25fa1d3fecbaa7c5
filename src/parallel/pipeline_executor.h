// One stage's share of an update or of a validation pass, in its schedule's order
// (parallel/pipeline_schedule.h): the forwards and backwards of the micro-batches through the stage's
// model chunks, with the activations and gradients to and from the neighbouring stages. Training
// without a pipeline is the degenerate schedule of one stage (F0 B0 F1 B1 ...: each micro-step's
// forward, then its backward) with nothing to transfer, so an update and a validation have one
// path whatever the layout (Megatron's get_forward_backward_func, with no pipelining as a schedule
// of its own there).
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <vector>

#include "config/config.h"
#include "data/dataset.h"
#include "dist/communicator.h"
#include "model/model.h"
#include "ops/buffer.h"
#include "parallel/pipeline_schedule.h"

namespace llmtrain::parallel {

class GradientStrategy;  // parallel/gradient_strategy.h

class PipelineExecutor {
 public:
  /// The executor of `model` (this stage's chunks) for updates of `micro_batches` micro-batches
  /// (a pipeline's: pipeline_micro_batches). `comm` is the stages in order over host memory (the
  /// loss and the tied embedding's sums), `link` the same stages over the memory the activations
  /// live in (the transfers); this stage is comm's rank. Gives the model one activation slot per
  /// micro-batch its schedule keeps in flight.
  PipelineExecutor(model::Model& model, const config::Config& config, dist::Communicator& comm,
                   dist::Communicator& link, int micro_batches);

  /// One update's forwards and backwards. `batch(k)` gives micro-batch k (every stage reads them:
  /// the first needs the tokens, the last the targets), asked for in order 0, 1, ...; each
  /// forward's loss gradient is scaled by `dloss_scale`. `gradients` (if given) starts reducing the
  /// gradients inside the update's last backward where that may be (see overlaps_reduction).
  /// Returns this stage's loss sum (the last stage's; a deferred loss stays in the model) and adds
  /// the time spent waiting for the neighbours to `waited`.
  double forward_backward(const std::function<const data::MicroBatch&(int)>& batch, float dloss_scale,
                          GradientStrategy* gradients, double& waited);
  /// After an update's backwards: `loss_sum` and a tied embedding's gradients (held by the first
  /// and last stages) summed over the stages; nothing to do for one stage.
  void reduce_over_stages(double& loss_sum);

  /// Validation: `batches` global batches of `loader` (micro-batches of B sequences of T tokens),
  /// forwards only; returns the loss sum and the count of positions it covers, summed over the
  /// stages (the last stage's).
  std::array<double, 2> forward_only(data::BatchLoader& loader, std::int64_t batches, int B, int T);
  /// Forwards only of `micro` (B sequences of T tokens each, with targets), through the stages in
  /// turn; on the last stage `each(k, loss)` follows micro-batch k's forward (its loss sum, and its
  /// per-position losses in the model's losses()). Every stage passes the same micro-batches.
  void forward_micro_batches(const std::vector<data::MicroBatch>& micro, int B, int T,
                             const std::function<void(int, double)>& each);

  /// Whether the gradients' reduction may start inside the last backward: only
  /// without a pipeline, where one chunk finishes its gradients in buffer order and no sum over
  /// the stages (the tied embedding's) comes between backward and the reduction.
  bool overlaps_reduction() const { return stages_ == 1; }
  int stage() const { return stage_; }
  int stages() const { return stages_; }

 private:
  /// Runs `ops` with the transfer `groups` around them (transfer_groups): each group started
  /// together and finished before the next op, the op's results copied out for the group after
  /// it (a copy, so that the slot or the shared gradient buffer may be overwritten at once). A
  /// forward takes an activation slot, its backward (or, `forward_only`, the forward itself) gives
  /// it back. `compute` runs one op with its chunk and slot selected; the time spent waiting for
  /// the neighbours is added to `waited`.
  void run(const std::vector<PipelineOp>& ops, const std::vector<std::vector<StageTransfer>>& groups,
           bool forward_only, const std::function<void(const PipelineOp&)>& compute, double& waited);
  void sum_tied_embedding();

  model::Model& model_;
  dist::Communicator& comm_;
  dist::Communicator& link_;
  const int stage_, stages_;
  const int B_, T_;  // an update's micro-batches: B sequences of T tokens
  std::vector<PipelineOp> schedule_;  // this stage's order of work in an update
  std::vector<std::vector<StageTransfer>> transfer_groups_;  // its transfers, grouped around those ops
  std::vector<ops::Buffer> outbox_;   // the copies of one group's sends
  const model::ParamInfo* tied_ = nullptr;  // a tied embedding held by the first and last stages
  std::int64_t tied_numel_ = 0;             // its elements there
  ops::Buffer tied_peer_;                   // the other end's gradients of it, received (model's device)
};

}  // namespace llmtrain::parallel
