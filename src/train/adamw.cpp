#include "train/adamw.h"

#include <cmath>

#include "ops/nn.h"

namespace llmtrain::train {

double AdamW::update(model::Gpt2& model, const config::OptimConfig& optim, double grad_clip, double lr,
                     std::int64_t step) {
  const double norm = std::sqrt(ops::sum_squares(model.grads()));
  const double scale = grad_clip > 0 && norm > grad_clip ? grad_clip / (norm + 1e-6) : 1.0;
  for (const auto& info : model.param_infos()) {
    const Tensor m(m_.data() + info.offset, DType::f32, Device::cpu, {info.numel});
    const Tensor v(v_.data() + info.offset, DType::f32, Device::cpu, {info.numel});
    ops::adamw_update(model.param(info).reshape({info.numel}), model.grad(info).reshape({info.numel}), m, v,
                      {float(lr), float(optim.beta1), float(optim.beta2), float(optim.eps),
                       info.decay ? float(optim.weight_decay) : 0.0f, int(step), float(scale)});
  }
  return norm;
}

}  // namespace llmtrain::train
