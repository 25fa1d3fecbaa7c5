#include "train/adamw.h"

#include <algorithm>
#include <cmath>

#include "ops/ops.h"

namespace llmtrain::train {
namespace {

std::int64_t total_size(const std::vector<Piece>& pieces) {
  std::int64_t n = 0;
  for (const Piece& p : pieces) n += p.size();
  return n;
}

}  // namespace

AdamW::AdamW(std::vector<Piece> pieces, Device device)
    : pieces_(std::move(pieces)),
      size_(total_size(pieces_)),
      m_(device, std::size_t(size_) * sizeof(float)),
      v_(device, std::size_t(size_) * sizeof(float)) {
  if (size_ > 0) {
    ops::zero(m());
    ops::zero(v());
  }
}

void AdamW::update(const std::vector<model::ParamInfo>& infos, const Tensor& params, const Tensor& grads,
                   double grad_norm, const config::OptimConfig& optim, double grad_clip, double lr,
                   std::int64_t step) {
  const double scale = grad_clip > 0 && grad_norm > grad_clip ? grad_clip / (grad_norm + 1e-6) : 1.0;
  const Device device = params.device;
  for (const Piece& piece : pieces_) {
    // Each parameter's part inside the piece: one call, with or without weight decay.
    for (const auto& info : infos) {
      const std::int64_t lo = std::max(info.offset, piece.begin), hi = std::min(info.offset + info.numel, piece.end);
      if (lo >= hi) continue;
      const std::int64_t at = piece.local + (lo - piece.begin);
      const auto view = [&](const Tensor& local) {
        return Tensor(local.as<float>() + at, DType::f32, device, {hi - lo});
      };
      ops::adamw_update(view(params), view(grads), view(m()), view(v()),
                        {float(lr), float(optim.beta1), float(optim.beta2), float(optim.eps),
                         info.decay ? float(optim.weight_decay) : 0.0f, int(step), float(scale)});
    }
  }
}

}  // namespace llmtrain::train
