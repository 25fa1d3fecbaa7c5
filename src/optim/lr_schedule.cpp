#include "optim/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace llmtrain::optim {

double learning_rate(const config::OptimConfig& optim, std::int64_t max_steps, std::int64_t step) {
  if (step <= optim.warmup_steps) return optim.lr * double(step) / double(optim.warmup_steps);
  if (optim.schedule == "constant") return optim.lr;
  const std::int64_t decay_steps = max_steps - optim.warmup_steps;
  const double progress = std::clamp(double(step - optim.warmup_steps) / double(decay_steps), 0.0, 1.0);
  const double span = optim.lr - optim.min_lr;
  if (optim.schedule == "linear") return optim.lr - span * progress;
  return optim.min_lr + 0.5 * span * (1.0 + std::cos(std::numbers::pi * progress));  // cosine
}

}  // namespace llmtrain::optim
