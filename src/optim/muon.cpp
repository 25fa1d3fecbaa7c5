#include "optim/muon.h"

#include <algorithm>
#include <cmath>

#include "core/bf16.h"
#include "core/error.h"

namespace llmtrain::optim {

std::vector<MuonMatrix> muon_matrices(const std::vector<model::ParamInfo>& infos) {
  std::vector<MuonMatrix> out;
  for (const model::ParamInfo& info : infos) {
    if (info.layer < 0 || info.shape.size() != 2) continue;
    const std::int64_t rows = info.shape[0], cols = info.shape[1];
    if (info.name.ends_with("attn.c_attn.weight") && rows % 3 == 0) {  // q, k and v stacked: (3 C, C)
      const char* parts[] = {"[q]", "[k]", "[v]"};
      for (int k = 0; k < 3; ++k) {
        out.push_back({info.name + parts[k], info.offset + k * (rows / 3) * cols, rows / 3, cols});
      }
    } else {
      out.push_back({info.name, info.offset, rows, cols});
    }
  }
  return out;
}

double muon_adjusted_lr(double lr, const std::string& adjust_lr, std::int64_t rows, std::int64_t cols) {
  if (adjust_lr == "original") return lr * std::sqrt(std::max(1.0, double(rows) / double(cols)));
  return lr * 0.2 * std::sqrt(double(std::max(rows, cols)));
}

Muon::Muon(std::vector<Piece> pieces, const config::OptimConfig& optim, Device device)
    : Optimizer(std::move(pieces)),
      optim_(optim),
      lr_(optim.muon.lr.value_or(optim.lr)),
      weight_decay_(optim.muon.weight_decay.value_or(optim.weight_decay)),
      ns_{optim.muon.ns_steps, optim.muon.ns_coefficients.at(0), optim.muon.ns_coefficients.at(1),
          optim.muon.ns_coefficients.at(2), optim.muon.eps, false} {
  if (device != Device::cpu) {
    throw InputError("optim.name: \"muon\" runs on the CPU only so far (no CUDA Newton-Schulz yet); "
                     "use optim.name \"adamw\" for GPU runs");
  }
  momentum_ = ops::Buffer(device, std::size_t(size()) * sizeof(float));
  m_ = ops::Buffer(device, std::size_t(size()) * sizeof(float));
  v_ = ops::Buffer(device, std::size_t(size()) * sizeof(float));
  if (size() > 0) {
    ops::zero(momentum());
    ops::zero(m());
    ops::zero(v());
  }
}

std::vector<StateTensor> Muon::state() const {
  return {{"muon.momentum", momentum()}, {"adamw.m", m()}, {"adamw.v", v()}};
}

void Muon::lay_out(const UpdateArgs& a) {
  // Each Muon matrix lies whole in one piece or outside them all (the mesh rules in
  // config/rules.cpp keep ZeRO and tensor parallelism, which split matrices, away).
  const std::vector<MuonMatrix> matrices = muon_matrices(a.infos);
  std::vector<std::pair<std::int64_t, std::int64_t>> taken;  // flat ranges Muon updates
  for (const MuonMatrix& mat : matrices) {
    const auto info = std::find_if(a.infos.begin(), a.infos.end(), [&](const model::ParamInfo& i) {
      return mat.offset >= i.offset && mat.offset < i.offset + i.numel;
    });
    if (info != a.infos.end() && !info->slice.whole()) {
      throw RuntimeError("muon: " + mat.name + " is split over the tensor-parallel group; Muon needs whole matrices");
    }
    for (const Piece& piece : pieces()) {
      const std::int64_t lo = std::max(mat.offset, piece.begin), hi = std::min(mat.offset + mat.numel(), piece.end);
      if (lo >= hi) continue;
      if (lo != mat.offset || hi != mat.offset + mat.numel()) {
        throw RuntimeError("muon: " + mat.name + " is split between ranks; Muon needs whole matrices");
      }
      matrices_.push_back({piece.local + (mat.offset - piece.begin), mat.rows, mat.cols});
      taken.emplace_back(mat.offset, mat.offset + mat.numel());
    }
  }
  // AdamW's runs: every parameter's part inside each piece, less the Muon matrices.
  std::vector<ops::AdamWRun> runs;
  const auto add = [&](std::int64_t at, std::int64_t length, bool decay) {
    if (length <= 0) return;
    if (!runs.empty() && runs.back().decay == decay && runs.back().offset + runs.back().length == at) {
      runs.back().length += length;
    } else {
      runs.push_back({at, length, decay});
    }
  };
  for (const Piece& piece : pieces()) {
    for (const model::ParamInfo& info : a.infos) {
      std::int64_t lo = std::max(info.offset, piece.begin);
      const std::int64_t hi = std::min(info.offset + info.numel, piece.end);
      for (const auto& [begin, end] : taken) {  // the matrices of this parameter, in order
        if (end <= lo || begin >= hi) continue;
        add(piece.local + (lo - piece.begin), begin - lo, info.decay);
        lo = end;
      }
      add(piece.local + (lo - piece.begin), hi - lo, info.decay);
    }
  }
  adamw_plan_ = ops::AdamWPlan(runs, Device::cpu);
  planned_ = true;
}

void Muon::update(const UpdateArgs& a) {
  if (!planned_) lay_out(a);
  const double scale = a.grad_clip > 0 && a.grad_norm > a.grad_clip ? a.grad_clip / (a.grad_norm + 1e-6) : 1.0;
  if (!adamw_plan_.runs().empty()) {
    ops::adamw_update_runs(a.params, a.grads, m(), v(), a.working, adamw_plan_,
                           {float(a.lr), float(optim_.beta1), float(optim_.beta2), float(optim_.eps),
                            float(optim_.weight_decay), int(a.step), float(scale)});
  }
  // The schedule's factor at this step (a.lr = factor x optim.lr), applied to Muon's lr alike.
  const double lr = lr_ * (a.lr / optim_.lr);
  const float mu = float(optim_.muon.momentum), keep = float(1.0 - lr * weight_decay_), s = float(scale);
  NewtonSchulz ns = ns_;
  ns.bf16 = a.working.data != nullptr;  // bf16 runs orthogonalise in bf16
  float *w = a.params.as<float>(), *buf = momentum().as<float>();
  const float* grad = a.grads.as<float>();
  std::uint16_t* working = a.working.data ? a.working.as<std::uint16_t>() : nullptr;
  for (const Placed& mat : matrices_) {
    const std::int64_t n = mat.rows * mat.cols;
    u_.resize(std::size_t(n));
    float *wm = w + mat.local, *bm = buf + mat.local;
    const float* gm = grad + mat.local;
    for (std::int64_t i = 0; i < n; ++i) {
      const float g = s * gm[i];
      bm[i] += (1.0f - mu) * (g - bm[i]);
      u_[std::size_t(i)] = optim_.muon.nesterov ? g + mu * (bm[i] - g) : bm[i];
    }
    newton_schulz(u_.data(), u_.data(), mat.rows, mat.cols, ns, scratch_);
    const float step = float(muon_adjusted_lr(lr, optim_.muon.adjust_lr, mat.rows, mat.cols));
    for (std::int64_t i = 0; i < n; ++i) {
      wm[i] = wm[i] * keep - step * u_[std::size_t(i)];
      if (working) working[mat.local + i] = float_to_bf16_bits(wm[i]);
    }
  }
}

}  // namespace llmtrain::optim
