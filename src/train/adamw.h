// AdamW over the model's flat parameter buffer, with global-norm gradient clipping.
#pragma once

#include <cstdint>
#include <vector>

#include "config/config.h"
#include "model/gpt2.h"

namespace llmtrain::train {

class AdamW {
 public:
  explicit AdamW(std::int64_t num_params)
      : m_(std::size_t(num_params), 0.0f), v_(std::size_t(num_params), 0.0f) {}

  /// Scales the gradient so its global norm is at most `grad_clip` (0: no clipping), then takes
  /// AdamW step `step` (1-based) at learning rate `lr`; weight decay only on 2-D parameters.
  /// Returns the gradient's global norm before clipping.
  double update(model::Gpt2& model, const config::OptimConfig& optim, double grad_clip, double lr,
                std::int64_t step);

  const float* m() const { return m_.data(); }  // (P,) first moments
  const float* v() const { return v_.data(); }  // (P,) second moments

 private:
  std::vector<float> m_, v_;
};

}  // namespace llmtrain::train
