// AdamW over a range of the model's flat parameter buffer (all of it, or this rank's ZeRO
// shard), with global-norm gradient clipping. Its moments live on the model's device.
#pragma once

#include <cstdint>
#include <vector>

#include "config/config.h"
#include "model/model.h"
#include "ops/buffer.h"

namespace llmtrain::train {

class AdamW {
 public:
  /// State for the flat-buffer elements [begin, end), zero, on `device`.
  AdamW(std::int64_t begin, std::int64_t end, Device device = Device::cpu);

  /// One AdamW step `step` (1-based) at learning rate `lr` on params [begin, end), from `grads`
  /// (end - begin,) on the model's device, scaled so the global gradient norm `grad_norm` is at
  /// most `grad_clip` (0: no clipping). Weight decay only on 2-D parameters.
  void update(model::Model& model, const Tensor& grads, double grad_norm, const config::OptimConfig& optim,
              double grad_clip, double lr, std::int64_t step);

  std::int64_t begin() const { return begin_; }
  std::int64_t end() const { return end_; }
  Tensor m() const { return m_.view(DType::f32, {end_ - begin_}); }  // first moments
  Tensor v() const { return v_.view(DType::f32, {end_ - begin_}); }  // second moments

 private:
  std::int64_t begin_, end_;
  ops::Buffer m_, v_;
};

}  // namespace llmtrain::train
