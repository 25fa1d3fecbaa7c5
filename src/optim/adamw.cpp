#include "optim/adamw.h"

#include <algorithm>
#include <cmath>

#include "ops/ops.h"

namespace llmtrain::optim {
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
                   std::int64_t step, const Tensor& working) {
  const double scale = grad_clip > 0 && grad_norm > grad_clip ? grad_clip / (grad_norm + 1e-6) : 1.0;
  if (!planned_) {
    // Each parameter's part inside each piece, at its place in the local arrays; neighbours alike
    // in weight decay merge into one run (a layer's 2-D weights and its biases alternate).
    std::vector<ops::AdamWRun> runs;
    for (const Piece& piece : pieces_) {
      for (const auto& info : infos) {
        const std::int64_t lo = std::max(info.offset, piece.begin), hi = std::min(info.offset + info.numel, piece.end);
        if (lo >= hi) continue;
        const std::int64_t at = piece.local + (lo - piece.begin);
        if (!runs.empty() && runs.back().decay == info.decay && runs.back().offset + runs.back().length == at) {
          runs.back().length += hi - lo;
        } else {
          runs.push_back({at, hi - lo, info.decay});
        }
      }
    }
    plan_ = ops::AdamWPlan(runs, params.device);
    planned_ = true;
  }
  if (plan_.runs().empty()) return;  // nothing of the model on this rank
  ops::adamw_update_runs(params, grads, m(), v(), working, plan_,
                         {float(lr), float(optim.beta1), float(optim.beta2), float(optim.eps),
                          float(optim.weight_decay), int(step), float(scale)});
}

}  // namespace llmtrain::optim
