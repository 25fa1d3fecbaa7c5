// How a data-parallel group shares the gradients and the optimizer's work, behind one interface
// so that an update runs the same calls whichever is configured: bucketed sync (parallel/grad_sync.h:
// ZeRO 0 all-reduces buckets of the flat gradient buffer as backward finishes them, ZeRO 1 and 2
// reduce-scatter it and all-gather the updated weights) or fully sharded units (parallel/zero3.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "config/config.h"
#include "core/tensor.h"
#include "dist/communicator.h"
#include "model/model.h"
#include "optim/piece.h"
#include "parallel/grad_sync.h"

namespace llmtrain::parallel {

class GradientStrategy {
 public:
  virtual ~GradientStrategy() = default;

  /// The runs of the model's local flat buffer whose fp32 weights this rank keeps (all of them, or
  /// under ZeRO 3 its shards), in local order; `local` is where each starts in held_weights().
  virtual std::vector<optim::Piece> held() const = 0;
  /// Those weights, end to end, f32 on the model's device: the start-up writes its initial weights
  /// there, then calls weights_loaded().
  virtual Tensor held_weights() const = 0;
  virtual void weights_loaded() = 0;
  /// The runs of the flat buffer whose optimizer update this rank makes, in local order.
  virtual std::vector<optim::Piece> pieces() const = 0;

  /// Before an update's first micro-step: the gradients it accumulates start from zero.
  virtual void zero_grads() = 0;
  /// Before the update's last backward: the gradients' reduction starts during it, as the model's
  /// pass events report them finished, where this strategy does so (else nothing starts early).
  virtual void reduce_during_next_backward() = 0;
  /// After the last micro-step's backward: completes the reduction and returns the global
  /// gradient norm; `loss_sum` (this rank's) is summed over the group in the same collective.
  virtual double finish(double& loss_sum) = 0;

  /// The local arrays the optimizer updates (pieces() end to end, f32 on the model's device):
  /// the master weights and their gradients, summed over the group once finish() returned.
  virtual Tensor master() const = 0;
  virtual Tensor grads() const = 0;
  /// The bf16 working copy the optimizer writes in the same pass (mixed precision, where this
  /// rank updates every weight), else empty.
  virtual Tensor working_weights() const = 0;
  /// After the optimizer changed master(): the weights the next forward reads are brought up to
  /// date (ZeRO 1/2: all-gathered; ZeRO 3: gathered again when next needed).
  virtual void weights_updated() = 0;

  /// Whether every rank of the group holds all of this part of the model's weights (replicas,
  /// which can be compared), rather than shards of them.
  virtual bool replicated() const = 0;
  /// Whether each rank of the group holds only a shard of the optimizer state.
  virtual bool shards_optimizer() const = 0;
  /// Bytes of the buffers it holds for the reduction (and, for ZeRO 3, the shards).
  virtual std::size_t state_bytes() const = 0;
};

/// ZeRO 3 (dist.zero_stage 3; `model` built sharded): fully sharded units; else bucketed sync
/// of the model's flat gradient buffer. `comm` is the data-parallel group over the memory the
/// model lives in, `host_comm` the same ranks over host memory; `norm` says which gradients the
/// global norm counts and which other groups it is summed over; `expert` which gradients the
/// expert group then sums.
std::unique_ptr<GradientStrategy> make_gradient_strategy(model::Model& model, const config::DistConfig& dist,
                                                         dist::Communicator& comm, dist::Communicator& host_comm,
                                                         NormScope norm, ExpertScope expert = {});

}  // namespace llmtrain::parallel
