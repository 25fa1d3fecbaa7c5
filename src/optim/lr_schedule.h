// Learning-rate schedule: linear warmup to optim.lr, then cosine, linear or constant to min_lr.
#pragma once

#include <cstdint>

#include "config/config.h"

namespace llmtrain::optim {

/// The learning rate of update `step` (1-based): lr * step / warmup_steps during warmup, then
/// decaying from lr at the end of warmup to min_lr at max_steps.
double learning_rate(const config::OptimConfig& optim, std::int64_t max_steps, std::int64_t step);

}  // namespace llmtrain::optim
