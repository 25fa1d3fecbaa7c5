// AdamW over a range of the model's flat parameter buffer (all of it, or this rank's ZeRO
// shard), with global-norm gradient clipping.
#pragma once

#include <cstdint>
#include <vector>

#include "config/config.h"
#include "model/gpt2.h"

namespace llmtrain::train {

class AdamW {
 public:
  /// State for the flat-buffer elements [begin, end).
  AdamW(std::int64_t begin, std::int64_t end)
      : begin_(begin), end_(end), m_(std::size_t(end - begin), 0.0f), v_(std::size_t(end - begin), 0.0f) {}

  /// One AdamW step `step` (1-based) at learning rate `lr` on params [begin, end), from `grads`
  /// (end - begin) scaled so the global gradient norm `grad_norm` is at most `grad_clip`
  /// (0: no clipping). Weight decay only on 2-D parameters.
  void update(model::Gpt2& model, const float* grads, double grad_norm, const config::OptimConfig& optim,
              double grad_clip, double lr, std::int64_t step);

  /// The same on one process, over the whole buffer: computes the norm of model.grads().
  /// Returns that norm (before clipping).
  double update(model::Gpt2& model, const config::OptimConfig& optim, double grad_clip, double lr,
                std::int64_t step);

  std::int64_t begin() const { return begin_; }
  std::int64_t end() const { return end_; }
  float* m() { return m_.data(); }  // (end - begin) first moments
  float* v() { return v_.data(); }  // (end - begin) second moments

 private:
  std::int64_t begin_, end_;
  std::vector<float> m_, v_;
};

}  // namespace llmtrain::train
