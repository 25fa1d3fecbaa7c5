#include "optim/adamw.h"

#include <algorithm>
#include <cmath>

#include "ops/ops.h"

namespace llmtrain::optim {

AdamW::AdamW(std::vector<Piece> pieces, const config::OptimConfig& optim, Device device)
    : Optimizer(std::move(pieces)),
      optim_(optim),
      m_(device, std::size_t(size()) * sizeof(float)),
      v_(device, std::size_t(size()) * sizeof(float)) {
  if (size() > 0) {
    ops::zero(m());
    ops::zero(v());
  }
}

std::vector<StateTensor> AdamW::state() const { return {{"adamw.m", m()}, {"adamw.v", v()}}; }

void AdamW::update(const UpdateArgs& a) {
  const double scale = a.grad_clip > 0 && a.grad_norm > a.grad_clip ? a.grad_clip / (a.grad_norm + 1e-6) : 1.0;
  if (!planned_) {
    // Each parameter's part inside each piece, at its place in the local arrays; neighbours alike
    // in weight decay merge into one run (a layer's 2-D weights and its biases alternate).
    std::vector<ops::AdamWRun> runs;
    for (const Piece& piece : pieces()) {
      for (const auto& info : a.infos) {
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
    plan_ = ops::AdamWPlan(runs, a.params.device);
    planned_ = true;
  }
  if (plan_.runs().empty()) return;  // nothing of the model on this rank
  ops::adamw_update_runs(a.params, a.grads, m(), v(), a.working, plan_,
                         {float(a.lr), float(optim_.beta1), float(optim_.beta2), float(optim_.eps),
                          float(optim_.weight_decay), int(a.step), float(scale)});
}

}  // namespace llmtrain::optim
