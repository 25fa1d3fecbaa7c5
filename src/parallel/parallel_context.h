// One rank's place on the mesh, read once from the communicators of the mesh-axis table
// (dist/mesh.h): the model's layout over the ranks, the group adapters its forward and backward
// communicate through (tensor, context, expert: those of more than one rank), attached to the
// model in one call, and what the gradient strategy needs of the axes (the gradient norm's scope,
// the expert group's shared gradients). The trainer builds one and spells no axis itself.
#pragma once

#include <memory>

#include "config/config.h"
#include "core/tensor.h"
#include "dist/communicator.h"
#include "model/model.h"
#include "parallel/context_attention.h"
#include "parallel/expert_parallel_comm.h"
#include "parallel/grad_sync.h"
#include "parallel/tensor_parallel.h"

namespace llmtrain::parallel {

class ParallelContext {
 public:
  /// This rank's place in `comms` (the run's communicators) for `config`, on `device`.
  ParallelContext(const config::Config& config, const dist::Communicators& comms, Device device);
  ~ParallelContext();
  ParallelContext(const ParallelContext&) = delete;
  ParallelContext& operator=(const ParallelContext&) = delete;

  /// This rank's part of the model: ZeRO 3's external storage, its share of the widths (tensor
  /// parallelism) and of the experts (expert parallelism), which live as long as this context, and
  /// in a pipeline its stage's layers (virtual stages stage, stage + P, ...).
  const model::Layout& layout() const { return layout_; }
  /// Whether this rank's model is only a part of the whole one (split over tensor, expert or
  /// pipeline ranks, or its weights in ZeRO 3's storage).
  bool partial_model() const;
  /// Gives `model` (built with layout()) the groups its passes communicate over, and under context
  /// parallelism its view of the split sequences. They live as long as this context.
  void attach(model::Model& model);
  /// Which gradients the global norm counts on this rank and the groups it is summed over: under
  /// tensor, expert or pipeline parallelism, the parts this rank owns, summed over those groups.
  NormScope norm_scope(const model::Model& model) const;
  /// Under expert parallelism, the gradients the expert group holds alike and that group; else none.
  ExpertScope expert_scope(const model::Model& model) const;

 private:
  const dist::Communicators& comms_;
  Device device_;
  model::Layout layout_;
  std::unique_ptr<TensorGroup> tensor_;
  std::unique_ptr<TensorParallel> widths_;
  int context_rank_ = 0, context_size_ = 1;
  bool context_ring_ = true;
  std::unique_ptr<ContextGroup> context_;
  std::unique_ptr<ContextAttention> sequences_;
  std::unique_ptr<ExpertParallel> experts_;
};

}  // namespace llmtrain::parallel
