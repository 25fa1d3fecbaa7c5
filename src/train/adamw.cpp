#include "train/adamw.h"

#include <algorithm>
#include <cmath>

#include "ops/ops.h"

namespace llmtrain::train {

AdamW::AdamW(std::int64_t begin, std::int64_t end, Device device)
    : begin_(begin),
      end_(end),
      m_(device, std::size_t(end - begin) * sizeof(float)),
      v_(device, std::size_t(end - begin) * sizeof(float)) {
  if (end > begin) {
    ops::zero(m());
    ops::zero(v());
  }
}

void AdamW::update(model::Model& model, const Tensor& grads, double grad_norm, const config::OptimConfig& optim,
                   double grad_clip, double lr, std::int64_t step) {
  const double scale = grad_clip > 0 && grad_norm > grad_clip ? grad_clip / (grad_norm + 1e-6) : 1.0;
  float* params = model.params().as<float>();
  const Device device = model.device();
  for (const auto& info : model.param_infos()) {
    // The part of this parameter inside [begin, end).
    const std::int64_t lo = std::max(info.offset, begin_), hi = std::min(info.offset + info.numel, end_);
    if (lo >= hi) continue;
    const auto view = [&](float* data, std::int64_t n) { return Tensor(data, DType::f32, device, {n}); };
    ops::adamw_update(view(params + lo, hi - lo), view(grads.as<float>() + (lo - begin_), hi - lo),
                      view(m().as<float>() + (lo - begin_), hi - lo), view(v().as<float>() + (lo - begin_), hi - lo),
                      {float(lr), float(optim.beta1), float(optim.beta2), float(optim.eps),
                       info.decay ? float(optim.weight_decay) : 0.0f, int(step), float(scale)});
  }
}

}  // namespace llmtrain::train
