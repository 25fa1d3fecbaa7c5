// What a checkpoint takes from training, as the Checkpointer sees it: the position in the data,
// the weights and the optimizer state, and where each part sits in the whole model. The Trainer
// provides it; the Checkpointer knows nothing else of the Trainer.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "core/tensor.h"
#include "data/sampler.h"
#include "model/model.h"
#include "train/adamw.h"
#include "train/tensor_parallel.h"

namespace llmtrain::train {

class CheckpointSource {
 public:
  virtual ~CheckpointSource() = default;

  /// Tokens trained on so far, and where the sampler stands (the next update's samples).
  virtual std::int64_t tokens_seen() const = 0;
  virtual data::SamplerState sampler_state() const = 0;
  /// The whole model's parameter count (every rank's parts together).
  virtual std::int64_t num_params() const = 0;
  /// The whole model's parameter list (names, shapes, flat offsets of the one-rank layout).
  virtual const model::Model& logical_model() const = 0;
  /// The device the model trains on.
  virtual Device device() const = 0;
  /// This rank's fp32 master weights of the runs the optimizer updates, laid out as its m and v
  /// (on the model's device).
  virtual Tensor master() const = 0;
  /// The optimizer's state: its moments m and v (local arrays on the model's device).
  virtual const AdamW& optimizer() const = 0;
  /// Where this rank's optimizer state sits in the whole model's flat buffer (the parts a
  /// checkpoint takes from this rank: a replicated parameter's from tensor rank 0 only).
  virtual std::vector<Placed> optimizer_placement() const = 0;
  /// Whether this rank writes an optimizer file (the first rank of a data-parallel group, or
  /// every rank when ZeRO shards the state).
  virtual bool writes_optimizer() const = 0;
  /// Called in each update before the weights and optimizer state change (a background
  /// checkpoint may still be copying them); empty: nothing to wait for.
  virtual void set_before_update(std::function<void()> hook) = 0;
};

}  // namespace llmtrain::train
