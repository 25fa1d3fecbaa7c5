// AdamW over this rank's parts of the model's flat parameter buffer (all of it, its ZeRO 1/2
// range, or its ZeRO 3 parts of every unit), with global-norm gradient clipping, behind the
// Optimizer interface (optim/optimizer.h). Its moments live on the model's device, as the state
// tensors "adamw.m" and "adamw.v".
#pragma once

#include <cstdint>
#include <vector>

#include "config/config.h"
#include "core/tensor.h"
#include "ops/buffer.h"
#include "ops/ops.h"
#include "optim/optimizer.h"
#include "optim/piece.h"

namespace llmtrain::optim {

class AdamW final : public Optimizer {
 public:
  /// optim.name's value for AdamW.
  static constexpr const char* name = "adamw";
  /// Bytes of state per parameter element: f32 m and v.
  static constexpr std::int64_t bytes_per_param = 8;

  /// Zero state for `pieces` (their local offsets cover [0, sum of their sizes)), on `device`,
  /// with optim's betas, eps and weight decay.
  AdamW(std::vector<Piece> pieces, const config::OptimConfig& optim, Device device = Device::cpu);

  /// One AdamW step: the gradients are scaled so that the global norm is at most grad_clip;
  /// weight decay only on 2-D parameters (ParamInfo::decay). One kernel launch on the GPU for the
  /// whole update, which also writes the bf16 working copy when there is one.
  void update(const UpdateArgs& args) override;
  /// "adamw.m" and "adamw.v": the first and second moments.
  std::vector<StateTensor> state() const override;

  Tensor m() const { return m_.view(DType::f32, {size()}); }  // first moments
  Tensor v() const { return v_.view(DType::f32, {size()}); }  // second moments

 private:
  config::OptimConfig optim_;
  ops::Buffer m_, v_;
  // The runs of the local arrays with and without weight decay, laid out on the first update.
  ops::AdamWPlan plan_;
  bool planned_ = false;
};

}  // namespace llmtrain::optim
