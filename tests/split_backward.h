// A pipeline stage's order for two micro-batches in two activation slots: F0 F1 B0 B1, then, with
// the weight gradients deferred (a zero-bubble schedule's split), W0 W1. The split tests run it
// with and without the deferral and compare the gradients bit for bit.
#pragma once

#include <functional>
#include <vector>

#include "model/model.h"
#include "ops/ops.h"

namespace llmtrain::test {

struct TwoSlotRun {
  std::vector<double> losses;                   // each slot's forward's
  std::vector<float> after_backward, gradients;  // f32 on the host: after B0 B1, after W0 W1
};

/// Runs `model` (its gradients zeroed first) with `forward(slot)` as slot's forward; `split`
/// defers the weight gradients to W0 W1 (else those add nothing).
inline TwoSlotRun run_two_slots(model::Model& model, bool split, const std::function<double(int)>& forward) {
  const auto host_grads = [&] {
    std::vector<float> out(static_cast<std::size_t>(model.num_params()));
    ops::copy(Tensor(out.data(), DType::f32, Device::cpu, {model.num_params()}), model.grads());
    return out;
  };
  model.zero_grads();
  model.set_activation_slots(2);
  model.set_weight_grads_deferred(split);
  TwoSlotRun run;
  for (int slot = 0; slot < 2; ++slot) {
    model.use_activation_slot(slot);
    run.losses.push_back(forward(slot));
  }
  for (int slot = 0; slot < 2; ++slot) {
    model.use_activation_slot(slot);
    model.backward();
  }
  run.after_backward = host_grads();
  for (int slot = 0; slot < 2; ++slot) {
    model.use_activation_slot(slot);
    model.backward_weights();
  }
  run.gradients = host_grads();
  return run;
}

}  // namespace llmtrain::test
