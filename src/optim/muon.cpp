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

namespace {

// Every rank's pieces as flat ranges (rank r's at [r]): all-gathered through `group` once, each
// bound as three 21-bit chunks held exactly by f32 (the collectives move f32 and bf16 only).
std::vector<std::vector<model::FlatRange>> all_pieces(dist::Communicator& group, const std::vector<Piece>& mine) {
  const std::size_t W = static_cast<std::size_t>(group.world_size());
  constexpr std::int64_t chunk = std::int64_t{1} << 21;
  float count = float(mine.size());
  std::vector<float> counts(W, 0.0f);
  group.all_gather(&count, counts.data(), 1);
  std::size_t most = 0;
  for (const float c : counts) most = std::max(most, std::size_t(c));
  std::vector<float> send(6 * most, 0.0f), recv(6 * most * W);
  for (std::size_t k = 0; k < mine.size(); ++k) {
    const std::int64_t bounds[2] = {mine[k].begin, mine[k].end};
    for (std::size_t e = 0; e < 2; ++e) {
      for (std::size_t c = 0; c < 3; ++c) send[6 * k + 3 * e + c] = float((bounds[e] >> (21 * (2 - c))) % chunk);
    }
  }
  group.all_gather(send.data(), recv.data(), std::int64_t(6 * most));
  std::vector<std::vector<model::FlatRange>> out(W);
  for (std::size_t r = 0; r < W; ++r) {
    const float* at = recv.data() + 6 * most * r;
    for (std::size_t k = 0; k < std::size_t(counts[r]); ++k, at += 6) {
      const auto bound = [&](const float* x) {
        return (std::int64_t(x[0]) * chunk + std::int64_t(x[1])) * chunk + std::int64_t(x[2]);
      };
      out[r].push_back({bound(at), bound(at + 3)});
    }
  }
  return out;
}

}  // namespace

void Muon::lay_out(const UpdateArgs& a) {
  // Where each Muon matrix lies: whole in this rank's pieces or outside them (one rank, data,
  // context or pipeline parallelism), or in parts over the shard group's ranks (ZeRO).
  const int W = a.shard_group ? a.shard_group->world_size() : 1;
  rank_ = a.shard_group ? a.shard_group->rank() : 0;
  std::vector<std::vector<model::FlatRange>> ranges(static_cast<std::size_t>(W));
  if (W > 1) {
    ranges = all_pieces(*a.shard_group, pieces());
  } else {
    for (const Piece& p : pieces()) ranges[0].push_back(p);
  }
  const std::vector<MuonMatrix> matrices = muon_matrices(a.infos);
  std::vector<std::pair<std::int64_t, std::int64_t>> taken;  // flat ranges Muon updates here
  for (std::size_t j = 0; j < matrices.size(); ++j) {
    const MuonMatrix& mat = matrices[j];
    const auto info = std::find_if(a.infos.begin(), a.infos.end(), [&](const model::ParamInfo& i) {
      return mat.offset >= i.offset && mat.offset < i.offset + i.numel;
    });
    if (info != a.infos.end() && !info->slice.whole()) {
      throw RuntimeError("muon: " + mat.name + " is split over the tensor-parallel group; Muon needs whole matrices");
    }
    Placed placed{mat.rows, mat.cols, int(j % std::size_t(W)), {}};
    std::int64_t covered = 0;
    bool mine = false;
    for (int r = 0; r < W; ++r) {
      for (const model::FlatRange& piece : ranges[std::size_t(r)]) {
        const std::int64_t lo = std::max(mat.offset, piece.begin), hi = std::min(mat.offset + mat.numel(), piece.end);
        if (lo >= hi) continue;
        Part part{r, lo - mat.offset, hi - lo, 0};
        if (r == rank_) {
          const auto local = std::find_if(pieces().begin(), pieces().end(),
                                          [&](const Piece& p) { return p.begin == piece.begin && p.end == piece.end; });
          part.local = local->local + (lo - local->begin);
          taken.emplace_back(lo, hi);
          mine = true;
        }
        placed.parts.push_back(part);
        covered += hi - lo;
      }
    }
    if (covered == 0) continue;  // on another pipeline stage
    if (covered != mat.numel()) {
      throw RuntimeError("muon: the ranks hold " + std::to_string(covered) + " of the " + std::to_string(mat.numel()) +
                         " elements of " + mat.name);
    }
    if (mine || placed.owner == rank_) matrices_.push_back(std::move(placed));
  }
  std::sort(taken.begin(), taken.end());
  whole_.resize(matrices_.size());
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
      for (const auto& [begin, end] : taken) {  // the matrices' parts inside this run, in order
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

void Muon::orthogonalise_sharded(dist::Communicator& group, float* u) {
  // Gather: each part to its matrix's owner (the owner's own parts copied in place).
  std::vector<dist::PeerTransfer> gather, scatter;
  for (std::size_t j = 0; j < matrices_.size(); ++j) {
    const Placed& mat = matrices_[j];
    if (mat.owner == rank_) whole_[j].resize(std::size_t(mat.rows * mat.cols));
    for (const Part& part : mat.parts) {
      if (mat.owner == rank_ && part.rank == rank_) {
        std::copy(u + part.local, u + part.local + part.length, whole_[j].data() + part.at);
      } else if (mat.owner == rank_) {
        gather.push_back({dist::PeerTransfer::recv, whole_[j].data() + part.at, part.length, DType::f32, part.rank});
        scatter.push_back({dist::PeerTransfer::send, whole_[j].data() + part.at, part.length, DType::f32, part.rank});
      } else if (part.rank == rank_) {
        gather.push_back({dist::PeerTransfer::send, u + part.local, part.length, DType::f32, mat.owner});
        scatter.push_back({dist::PeerTransfer::recv, u + part.local, part.length, DType::f32, mat.owner});
      }
    }
  }
  group.start_transfers(gather)->wait();
  for (std::size_t j = 0; j < matrices_.size(); ++j) {
    const Placed& mat = matrices_[j];
    if (mat.owner != rank_) continue;
    newton_schulz(whole_[j].data(), whole_[j].data(), mat.rows, mat.cols, ns_, scratch_);
    for (const Part& part : mat.parts) {
      if (part.rank == rank_) {
        std::copy(whole_[j].data() + part.at, whole_[j].data() + part.at + part.length, u + part.local);
      }
    }
  }
  // Scatter: each rank's parts of O back into its u.
  group.start_transfers(scatter)->wait();
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
  ns_.bf16 = a.working.data != nullptr;  // bf16 runs orthogonalise in bf16
  float *w = a.params.as<float>(), *buf = momentum().as<float>();
  const float* grad = a.grads.as<float>();
  std::uint16_t* working = a.working.data ? a.working.as<std::uint16_t>() : nullptr;
  u_.resize(std::size_t(size()));
  // Momentum and u on this rank's parts, elementwise.
  for (const Placed& mat : matrices_) {
    for (const Part& part : mat.parts) {
      if (part.rank != rank_) continue;
      for (std::int64_t i = part.local; i < part.local + part.length; ++i) {
        const float g = s * grad[i];
        buf[i] += (1.0f - mu) * (g - buf[i]);
        u_[std::size_t(i)] = optim_.muon.nesterov ? g + mu * (buf[i] - g) : buf[i];
      }
    }
  }
  // O in place of u: each whole matrix here at once, split ones through their owners.
  const bool sharded = a.shard_group && a.shard_group->world_size() > 1;
  if (sharded) {
    orthogonalise_sharded(*a.shard_group, u_.data());
  } else {
    for (const Placed& mat : matrices_) {
      float* at = u_.data() + mat.parts.front().local;
      newton_schulz(at, at, mat.rows, mat.cols, ns_, scratch_);
    }
  }
  for (const Placed& mat : matrices_) {
    const float step = float(muon_adjusted_lr(lr, optim_.muon.adjust_lr, mat.rows, mat.cols));
    for (const Part& part : mat.parts) {
      if (part.rank != rank_) continue;
      for (std::int64_t i = part.local; i < part.local + part.length; ++i) {
        w[i] = w[i] * keep - step * u_[std::size_t(i)];
        if (working) working[i] = float_to_bf16_bits(w[i]);
      }
    }
  }
}

}  // namespace llmtrain::optim
