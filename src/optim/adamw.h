// AdamW over this rank's parts of the model's flat parameter buffer (all of it, its ZeRO 1/2
// range, or its ZeRO 3 parts of every unit), with global-norm gradient clipping. Its moments live
// on the model's device.
#pragma once

#include <cstdint>
#include <vector>

#include "config/config.h"
#include "model/model.h"
#include "ops/buffer.h"
#include "ops/ops.h"

namespace llmtrain::optim {

/// A run of the flat buffer that this rank updates: flat elements [begin, end), stored from
/// `local` on in the rank's local arrays (weights, gradients, m, v: the pieces end to end).
struct Piece : model::FlatRange {
  std::int64_t local = 0;
};

class AdamW {
 public:
  /// Zero state for `pieces` (their local offsets cover [0, sum of their sizes)), on `device`.
  AdamW(std::vector<Piece> pieces, Device device = Device::cpu);

  /// One AdamW step `step` (1-based) at learning rate `lr`: `params` and `grads` are the local
  /// arrays (size(),) f32 on the model's device; the gradients are scaled so the global norm
  /// `grad_norm` is at most `grad_clip` (0: no clipping). Weight decay only on 2-D parameters
  /// (`infos` says which flat elements are which; the same every call). `working` (size(),) bf16,
  /// when it has data, receives the updated weights rounded to bf16 in the same pass (the model's
  /// working copy under mixed precision). One kernel launch on the GPU for the whole update.
  void update(const std::vector<model::ParamInfo>& infos, const Tensor& params, const Tensor& grads,
              double grad_norm, const config::OptimConfig& optim, double grad_clip, double lr, std::int64_t step,
              const Tensor& working = {});

  const std::vector<Piece>& pieces() const { return pieces_; }
  std::int64_t size() const { return size_; }
  Tensor m() const { return m_.view(DType::f32, {size_}); }  // first moments
  Tensor v() const { return v_.view(DType::f32, {size_}); }  // second moments

 private:
  std::vector<Piece> pieces_;
  std::int64_t size_ = 0;
  ops::Buffer m_, v_;
  // The runs of the local arrays with and without weight decay, laid out on the first update.
  ops::AdamWPlan plan_;
  bool planned_ = false;
};

}  // namespace llmtrain::optim
