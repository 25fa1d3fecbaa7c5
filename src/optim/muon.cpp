#include "optim/muon.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <map>
#include <utility>

#include "core/error.h"
#include "ops/muon_ops.h"

namespace llmtrain::optim {

bool muon_updates(const model::ParamInfo& info) {
  if (info.layer < 0) return false;
  if (info.shape.size() == 3) return info.name.find(".mlp.experts.") != std::string::npos;  // (E, out, in)
  return info.shape.size() == 2 && !info.name.ends_with(".mlp.gate.weight");  // a MoE layer's router is AdamW's
}

std::vector<MuonMatrix> muon_matrices(const std::vector<model::ParamInfo>& infos) {
  std::vector<MuonMatrix> out;
  for (const model::ParamInfo& info : infos) {
    if (!muon_updates(info)) continue;
    const std::int64_t rows = info.shape[0], cols = info.shape[1];
    const std::int64_t full_rows = info.full_shape.at(0), full_cols = info.full_shape.at(1);
    // This slice's block of a matrix whose rows (dim 0) start at `begin` of the parameter's.
    const auto block_of = [&](std::int64_t begin, std::int64_t n, const std::string& name) {
      model::TensorSlice slice;
      if (info.slice.whole()) return slice;
      slice.dim = info.slice.dim;
      slice.owner = info.slice.owner;
      for (const auto& [first, count] : info.slice.blocks) {
        if (slice.dim == 1) {
          slice.blocks.push_back({first, count});
        } else if (first >= begin && first + count <= begin + n) {
          slice.blocks.push_back({first - begin, count});
        }
      }
      if (slice.blocks.size() != 1) {
        throw RuntimeError("muon: " + name + " is split over the tensor-parallel group in " +
                           std::to_string(slice.blocks.size()) + " blocks; Muon gathers one block per rank");
      }
      return slice;
    };
    if (info.shape.size() == 3) {  // a MoE layer's experts, (E, out, in): each expert's matrix on its own
      // Under expert parallelism this rank's experts, each whole.
      if (info.slice.split_over_tensor()) throw RuntimeError("muon: " + info.name + " is split over the tensor-parallel group");
      const std::int64_t out_features = info.shape[1], in_features = info.shape[2];
      for (std::int64_t e = 0; e < info.shape[0]; ++e) {
        out.push_back({info.name + "[" + std::to_string(e) + "]", info.offset + e * out_features * in_features,
                       out_features, in_features, out_features, in_features, {}});
      }
      continue;
    }
    if (info.name.ends_with("attn.c_attn.weight") && rows % 3 == 0 && full_rows % 3 == 0) {  // q, k and v: (3 C, C)
      const char* parts[] = {"[q]", "[k]", "[v]"};
      for (int k = 0; k < 3; ++k) {
        const std::string name = info.name + parts[k];
        out.push_back({name, info.offset + k * (rows / 3) * cols, rows / 3, cols, full_rows / 3, full_cols,
                       block_of(k * (full_rows / 3), full_rows / 3, name)});
      }
    } else {
      out.push_back({info.name, info.offset, rows, cols, full_rows, full_cols, block_of(0, full_rows, info.name)});
    }
  }
  return out;
}

double muon_adjusted_lr(double lr, const std::string& adjust_lr, std::int64_t rows, std::int64_t cols) {
  if (adjust_lr == "original") return lr * std::sqrt(std::max(1.0, double(rows) / double(cols)));
  return lr * 0.2 * std::sqrt(double(std::max(rows, cols)));
}

namespace {

// Where local element `local` of a run of `runs` (sorted) lies in an array holding them end to end.
std::int64_t place_in(const std::vector<model::FlatRange>& runs, std::int64_t local) {
  std::int64_t at = 0;
  for (const model::FlatRange& r : runs) {
    if (local >= r.begin && local < r.end) return at + (local - r.begin);
    at += r.size();
  }
  throw RuntimeError("muon: local element " + std::to_string(local) + " is in none of the runs");
}

}  // namespace

Muon::Muon(std::vector<Piece> pieces, const std::vector<model::ParamInfo>& infos, const config::OptimConfig& optim,
           Device device)
    : Optimizer(std::move(pieces)),
      optim_(optim),
      lr_(optim.muon.lr.value_or(optim.lr)),
      weight_decay_(optim.muon.weight_decay.value_or(optim.weight_decay)),
      ns_{optim.muon.ns_steps, optim.muon.ns_coefficients.at(0), optim.muon.ns_coefficients.at(1),
          optim.muon.ns_coefficients.at(2), optim.muon.eps, false},
      ns_work_(device),
      device_(device) {
  // The local runs of the Muon matrices' elements, and the rest: which elements keep a momentum
  // and which AdamW's moments.
  std::vector<model::FlatRange> matrices;
  for (const model::ParamInfo& info : infos) {
    if (muon_updates(info)) matrices.push_back({info.offset, info.offset + info.numel});
  }
  std::sort(matrices.begin(), matrices.end(), [](const auto& a, const auto& b) { return a.begin < b.begin; });
  const auto add = [](std::vector<model::FlatRange>& runs, std::int64_t begin, std::int64_t end) {
    if (begin >= end) return;
    if (!runs.empty() && runs.back().end == begin) {
      runs.back().end = end;
    } else {
      runs.push_back({begin, end});
    }
  };
  std::vector<Piece> ordered = this->pieces();
  std::sort(ordered.begin(), ordered.end(), [](const Piece& a, const Piece& b) { return a.local < b.local; });
  for (const Piece& piece : ordered) {
    std::int64_t next = piece.begin;  // in the flat buffer
    for (const model::FlatRange& mat : matrices) {
      const std::int64_t lo = std::max(mat.begin, next), hi = std::min(mat.end, piece.end);
      if (lo >= hi) continue;
      add(adamw_runs_, piece.local + (next - piece.begin), piece.local + (lo - piece.begin));
      add(muon_runs_, piece.local + (lo - piece.begin), piece.local + (hi - piece.begin));
      next = hi;
    }
    add(adamw_runs_, piece.local + (next - piece.begin), piece.local + (piece.end - piece.begin));
  }
  const auto floats = [&](const std::vector<model::FlatRange>& runs) {
    return ops::Buffer(device, std::size_t(total(runs)) * sizeof(float));
  };
  momentum_ = floats(muon_runs_);
  m_ = floats(adamw_runs_);
  v_ = floats(adamw_runs_);
  if (total(muon_runs_) > 0) ops::zero(momentum());
  if (total(adamw_runs_) > 0) {
    ops::zero(m());
    ops::zero(v());
  }
}

std::vector<StateTensor> Muon::state() const {
  return {{"muon.momentum", momentum(), StateLayout::held_runs, muon_runs_},
          {"adamw.m", m(), StateLayout::held_runs, adamw_runs_},
          {"adamw.v", v(), StateLayout::held_runs, adamw_runs_}};
}

namespace {

// group.all_gather of small host arrays, staged through `device`'s memory: the memory the group
// moves (NCCL's on a GPU).
void all_gather_staged(dist::Communicator& group, Device device, const float* send, float* recv, std::int64_t shard) {
  if (device == Device::cpu) return group.all_gather(send, recv, shard);
  const std::int64_t W = group.world_size();
  const ops::Buffer staged(device, std::size_t((1 + W) * shard) * sizeof(float));
  const Tensor mine = staged.view(DType::f32, {shard});
  const Tensor all(static_cast<float*>(staged.data()) + shard, DType::f32, device, {W * shard});
  ops::copy(mine, Tensor(const_cast<float*>(send), DType::f32, Device::cpu, {shard}));
  group.all_gather(mine.as<float>(), all.as<float>(), shard);
  ops::copy(Tensor(recv, DType::f32, Device::cpu, {W * shard}), all);
}

// Every rank's pieces as flat ranges (rank r's at [r]): all-gathered through `group` once, each
// bound as three 21-bit chunks held exactly by f32 (the collectives move f32 and bf16 only).
std::vector<std::vector<model::FlatRange>> all_pieces(dist::Communicator& group, Device device,
                                                      const std::vector<Piece>& mine) {
  const std::size_t W = static_cast<std::size_t>(group.world_size());
  constexpr std::int64_t chunk = std::int64_t{1} << 21;
  float count = float(mine.size());
  std::vector<float> counts(W, 0.0f);
  all_gather_staged(group, device, &count, counts.data(), 1);
  std::size_t most = 0;
  for (const float c : counts) most = std::max(most, std::size_t(c));
  std::vector<float> send(6 * most, 0.0f), recv(6 * most * W);
  for (std::size_t k = 0; k < mine.size(); ++k) {
    const std::int64_t bounds[2] = {mine[k].begin, mine[k].end};
    for (std::size_t e = 0; e < 2; ++e) {
      for (std::size_t c = 0; c < 3; ++c) send[6 * k + 3 * e + c] = float((bounds[e] >> (21 * (2 - c))) % chunk);
    }
  }
  all_gather_staged(group, device, send.data(), recv.data(), std::int64_t(6 * most));
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

std::vector<std::vector<Muon::Slice>> Muon::place_slices(dist::Communicator& tensor, Device device,
                                                         const std::vector<MuonMatrix>& matrices) {
  // Per matrix (dim + 1, first, count, owner), each below 2^24 and so exact in f32.
  const std::size_t N = matrices.size(), T = std::size_t(tensor.world_size());
  std::vector<float> mine(4 * N), all(4 * N * T);
  for (std::size_t j = 0; j < N; ++j) {
    const model::TensorSlice& s = matrices[j].slice;
    const std::int64_t first = s.whole() ? 0 : s.blocks[0].first, count = s.whole() ? 0 : s.blocks[0].second;
    if (first + count >= (std::int64_t{1} << 24)) {
      throw RuntimeError("muon: " + matrices[j].name + " has over 2^24 rows or columns");
    }
    mine[4 * j] = float(s.dim + 1);
    mine[4 * j + 1] = float(first);
    mine[4 * j + 2] = float(count);
    mine[4 * j + 3] = s.owner ? 1.0f : 0.0f;
  }
  if (N > 0) all_gather_staged(tensor, device, mine.data(), all.data(), std::int64_t(4 * N));
  std::vector<std::vector<Slice>> out(N);
  for (std::size_t j = 0; j < N; ++j) {
    if (matrices[j].slice.whole()) continue;  // replicated over the tensor group: each rank has it whole
    for (std::size_t t = 0; t < T; ++t) {
      const float* at = all.data() + 4 * (N * t + j);
      out[j].push_back({int(at[0]) - 1, std::int64_t(at[1]), std::int64_t(at[2]), at[3] != 0.0f});
      if (out[j].back().dim != matrices[j].slice.dim) {
        throw RuntimeError("muon: the tensor ranks split " + matrices[j].name + " along different dimensions");
      }
    }
  }
  return out;
}

void Muon::lay_out(const UpdateArgs& a) {
  // Where each Muon matrix lies: whole in this rank's pieces or outside them (one rank, data,
  // context or pipeline parallelism), or in parts over the shard group's ranks (ZeRO); and, under
  // tensor parallelism, which slice of it each tensor rank holds.
  const int W = a.shard_group ? a.shard_group->world_size() : 1;
  const int T = a.tensor_group ? a.tensor_group->world_size() : 1;
  rank_ = a.shard_group ? a.shard_group->rank() : 0;
  std::vector<std::vector<model::FlatRange>> ranges(static_cast<std::size_t>(W));
  if (W > 1) {
    ranges = all_pieces(*a.shard_group, device_, pieces());
  } else {
    for (const Piece& p : pieces()) ranges[0].push_back(p);
  }
  const std::vector<MuonMatrix> matrices = muon_matrices(a.infos);
  std::vector<std::vector<Slice>> slices(matrices.size());
  if (T > 1) {
    slices = place_slices(*a.tensor_group, device_, matrices);
  } else {
    for (const MuonMatrix& mat : matrices) {
      if (!mat.slice.whole()) throw RuntimeError("muon: " + mat.name + " is split, but no tensor group was given");
    }
  }
  for (std::size_t j = 0; j < matrices.size(); ++j) {
    const MuonMatrix& mat = matrices[j];
    Placed placed{mat.rows, mat.cols, mat.full_rows, mat.full_cols, int(j % std::size_t(W)),
                  int((j / std::size_t(W)) % std::size_t(T)), {}, std::move(slices[j])};
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
          part.state = place_in(muon_runs_, part.local);
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
  std::size_t transposed_bytes = 0;
  whole_.resize(matrices_.size());
  full_.resize(matrices_.size());
  slices_.resize(matrices_.size());
  for (std::size_t j = 0; j < matrices_.size(); ++j) {  // the buffers of what this rank gathers
    const Placed& mat = matrices_[j];
    const auto floats = [&](std::int64_t n) { return ops::Buffer(device_, std::size_t(n) * sizeof(float)); };
    if (W > 1 && mat.owner != rank_) continue;  // another rank orthogonalises it
    if (W > 1) whole_[j] = floats(mat.rows * mat.cols);
    if (mat.slices.empty() || mat.tensor_owner != a.tensor_group->rank()) continue;
    full_[j] = floats(mat.full_rows * mat.full_cols);
    if (mat.slices.front().dim == 1) transposed_bytes = std::max(transposed_bytes, full_[j].bytes());
    slices_[j].resize(mat.slices.size());
    for (std::size_t r = 0; r < mat.slices.size(); ++r) {
      const Slice& s = mat.slices[r];
      if (int(r) != a.tensor_group->rank()) slices_[j][r] = floats(s.count * (s.dim == 0 ? mat.full_cols : mat.full_rows));
    }
  }
  if (transposed_bytes > 0) transposed_ = ops::Buffer(device_, transposed_bytes);
  if (total(muon_runs_) > 0) u_ = ops::Buffer(device_, std::size_t(total(muon_runs_)) * sizeof(float));
  // AdamW's runs: every parameter's part inside each piece that is not a Muon matrix's, its
  // moments where adamw_runs_ puts them.
  std::vector<ops::AdamWRun> runs;
  for (const Piece& piece : pieces()) {
    for (const model::ParamInfo& info : a.infos) {
      const std::int64_t lo = std::max(info.offset, piece.begin), hi = std::min(info.offset + info.numel, piece.end);
      if (lo >= hi || muon_updates(info)) continue;
      const std::int64_t local = piece.local + (lo - piece.begin), state = place_in(adamw_runs_, local);
      ops::AdamWRun* last = runs.empty() ? nullptr : &runs.back();
      if (last && last->decay == info.decay && last->offset + last->length == local && last->state + last->length == state) {
        last->length += hi - lo;
      } else {
        runs.push_back({local, hi - lo, info.decay, state});
      }
    }
  }
  adamw_plan_ = ops::AdamWPlan(runs, device_);
  planned_ = true;
}

namespace {

// Elements [at, at + n) of the flat tensor t (no data when t has none).
Tensor elements(const Tensor& t, std::int64_t at, std::int64_t n) {
  void* data = t.data ? static_cast<char*>(t.data) + std::size_t(at) * dtype_size(t.dtype) : nullptr;
  return Tensor(data, t.dtype, t.device, {n});
}

Tensor floats(const ops::Buffer& b, std::initializer_list<std::int64_t> shape) { return b.view(DType::f32, shape); }

// The matrices by shape: each group one batched Newton-Schulz, in place.
class ShapeGroups {
 public:
  void add(const Tensor& o) { groups_[{o.shape[0], o.shape[1]}].push_back(o); }
  void orthogonalise(const NewtonSchulz& p, NewtonSchulzWork& work) const {
    for (const auto& [shape, matrices] : groups_) newton_schulz(matrices, matrices, p, work);
  }

 private:
  std::map<std::pair<std::int64_t, std::int64_t>, std::vector<Tensor>> groups_;
};

}  // namespace

void Muon::gather_parts(dist::Communicator& group, const Tensor& u, std::vector<dist::PeerTransfer>& scatter) {
  // Each part to its matrix's owner (the owner's own parts copied in place); `scatter` gets the
  // transfers that bring O back.
  std::vector<dist::PeerTransfer> gather;
  for (std::size_t j = 0; j < matrices_.size(); ++j) {
    const Placed& mat = matrices_[j];
    const Tensor whole = mat.owner == rank_ ? floats(whole_[j], {mat.rows * mat.cols}) : Tensor();
    for (const Part& part : mat.parts) {
      const Tensor mine = elements(u, part.state, part.length), theirs = elements(whole, part.at, part.length);
      if (mat.owner == rank_ && part.rank == rank_) {
        ops::copy(theirs, mine);
      } else if (mat.owner == rank_) {
        gather.push_back({dist::PeerTransfer::recv, theirs.data, part.length, DType::f32, part.rank});
        scatter.push_back({dist::PeerTransfer::send, theirs.data, part.length, DType::f32, part.rank});
      } else if (part.rank == rank_) {
        gather.push_back({dist::PeerTransfer::send, mine.data, part.length, DType::f32, mat.owner});
        scatter.push_back({dist::PeerTransfer::recv, mine.data, part.length, DType::f32, mat.owner});
      }
    }
  }
  group.start_transfers(gather)->wait();
}

void Muon::copy_blocks(const Placed& mat, const Tensor& full, const std::vector<Tensor>& parts, bool to_parts) {
  // Rows blocks (dim 0) are contiguous in the row-major matrix; column blocks (dim 1) are rows of
  // its transpose, so they move by transposes through transposed_.
  const std::int64_t R = mat.full_rows, C = mat.full_cols;
  const bool columns = mat.slices.front().dim == 1;
  const Tensor transposed = columns ? floats(transposed_, {C, R}) : Tensor();
  if (columns && to_parts) ops::transpose(transposed, full);
  for (std::size_t r = 0; r < mat.slices.size(); ++r) {
    const Slice& s = mat.slices[r];
    if (!parts[r].data) continue;
    const Tensor part = parts[r];
    if (!columns) {
      const Tensor rows = elements(full.reshape({R * C}), s.first * C, s.count * C);
      ops::copy(to_parts ? part : rows, to_parts ? rows : part);
      continue;
    }
    const Tensor block = elements(transposed.reshape({R * C}), s.first * R, s.count * R).reshape({s.count, R});
    if (to_parts) {
      ops::transpose(part.reshape({R, s.count}), block);
    } else {
      ops::transpose(block, part.reshape({R, s.count}));
    }
  }
  if (columns && !to_parts) ops::transpose(full, transposed);
}

void Muon::orthogonalise(dist::Communicator* tensor, const std::vector<std::pair<std::size_t, float*>>& held) {
  const int t = tensor ? tensor->rank() : 0;
  std::vector<dist::PeerTransfer> gather, scatter;
  std::vector<std::pair<std::size_t, float*>> owned;  // split matrices this tensor rank orthogonalises
  ShapeGroups whole;                                  // the matrices held whole here
  for (const auto& [j, local] : held) {
    const Placed& mat = matrices_[j];
    if (mat.slices.empty()) {
      whole.add(Tensor(local, DType::f32, device_, {mat.rows, mat.cols}));
      continue;
    }
    if (mat.tensor_owner != t) {  // this rank's slice to the owner, and O's back
      if (mat.slices[std::size_t(t)].owner) {
        gather.push_back({dist::PeerTransfer::send, local, mat.rows * mat.cols, DType::f32, mat.tensor_owner});
      }
      scatter.push_back({dist::PeerTransfer::recv, local, mat.rows * mat.cols, DType::f32, mat.tensor_owner});
      continue;
    }
    for (std::size_t r = 0; r < mat.slices.size(); ++r) {
      const Slice& s = mat.slices[r];
      if (int(r) == t) continue;
      const std::int64_t n = s.count * (s.dim == 0 ? mat.full_cols : mat.full_rows);
      if (s.owner) gather.push_back({dist::PeerTransfer::recv, slices_[j][r].data(), n, DType::f32, int(r)});
      scatter.push_back({dist::PeerTransfer::send, slices_[j][r].data(), n, DType::f32, int(r)});
    }
    owned.emplace_back(j, local);
  }
  whole.orthogonalise(ns_, ns_work_);
  if (!gather.empty() || !scatter.empty()) tensor->start_transfers(gather)->wait();
  // The split matrices this rank owns: each assembled whole in full_ from the tensor ranks' slices
  // (its own in place in u; the owning slices cover the matrix), orthogonalised by shape, and O
  // sent back to every slice, replicas too.
  const auto parts_of = [&](std::size_t j, float* local, bool owning_only) {
    const Placed& mat = matrices_[j];
    std::vector<Tensor> parts(mat.slices.size());
    for (std::size_t r = 0; r < mat.slices.size(); ++r) {
      const Slice& s = mat.slices[r];
      const std::int64_t n = s.count * (s.dim == 0 ? mat.full_cols : mat.full_rows);
      if (int(r) == t) {
        parts[r] = Tensor(local, DType::f32, device_, {n});
      } else if (s.owner || !owning_only) {
        parts[r] = floats(slices_[j][r], {n});
      }
    }
    return parts;
  };
  ShapeGroups split;
  for (const auto& [j, local] : owned) {
    const Placed& mat = matrices_[j];
    const Tensor full = floats(full_[j], {mat.full_rows, mat.full_cols});
    copy_blocks(mat, full, parts_of(j, local, true), false);
    split.add(full);
  }
  split.orthogonalise(ns_, ns_work_);
  for (const auto& [j, local] : owned) {
    const Placed& mat = matrices_[j];
    copy_blocks(mat, floats(full_[j], {mat.full_rows, mat.full_cols}), parts_of(j, local, false), true);
  }
  if (!gather.empty() || !scatter.empty()) tensor->start_transfers(scatter)->wait();
}

void Muon::update(const UpdateArgs& a) {
  if (a.params.device != device_) {
    throw RuntimeError(std::string("muon: the parameters are on ") + device_name(a.params.device) +
                       ", the optimizer's state on " + device_name(device_));
  }
  if (!planned_) lay_out(a);
  const double scale = a.grad_clip > 0 && a.grad_norm > a.grad_clip ? a.grad_clip / (a.grad_norm + 1e-6) : 1.0;
  if (!adamw_plan_.runs().empty()) {
    ops::adamw_update_runs(a.params, a.grads, m(), v(), a.working, adamw_plan_,
                           {float(a.lr), float(optim_.beta1), float(optim_.beta2), float(optim_.eps),
                            float(optim_.weight_decay), int(a.step), float(scale)});
  }
  if (matrices_.empty()) return;
  // The schedule's factor at this step (a.lr = factor x optim.lr), applied to Muon's lr alike.
  const double lr = lr_ * (a.lr / optim_.lr);
  const float mu = float(optim_.muon.momentum), keep = float(1.0 - lr * weight_decay_), s = float(scale);
  ns_.bf16 = a.working.data != nullptr;  // bf16 runs orthogonalise in bf16
  const Tensor u = floats(u_, {total(muon_runs_)});
  // Momentum and u on this rank's parts, elementwise.
  for (const Placed& mat : matrices_) {
    for (const Part& part : mat.parts) {
      if (part.rank != rank_) continue;
      ops::muon_momentum(elements(momentum(), part.state, part.length), elements(a.grads, part.local, part.length),
                         elements(u, part.state, part.length), mu, optim_.muon.nesterov, s);
    }
  }
  // O in place of u: each matrix held whole here (ZeRO: gathered by its owner first), through
  // the tensor group's owner when split over it.
  const bool sharded = a.shard_group && a.shard_group->world_size() > 1;
  std::vector<dist::PeerTransfer> scatter;
  if (sharded) gather_parts(*a.shard_group, u, scatter);
  std::vector<std::pair<std::size_t, float*>> held;
  for (std::size_t j = 0; j < matrices_.size(); ++j) {
    if (!sharded) {
      held.emplace_back(j, u.as<float>() + matrices_[j].parts.front().state);
    } else if (matrices_[j].owner == rank_) {
      held.emplace_back(j, static_cast<float*>(whole_[j].data()));
    }
  }
  orthogonalise(a.tensor_group, held);
  if (sharded) {
    for (const auto& [j, whole] : held) {  // the owner's own parts of O, then the others' sent back
      const Tensor o(whole, DType::f32, device_, {matrices_[j].rows * matrices_[j].cols});
      for (const Part& part : matrices_[j].parts) {
        if (part.rank == rank_) ops::copy(elements(u, part.state, part.length), elements(o, part.at, part.length));
      }
    }
    a.shard_group->start_transfers(scatter)->wait();
  }
  for (const Placed& mat : matrices_) {
    const float step = float(muon_adjusted_lr(lr, optim_.muon.adjust_lr, mat.full_rows, mat.full_cols));
    for (const Part& part : mat.parts) {
      if (part.rank != rank_) continue;
      ops::muon_apply(elements(a.params, part.local, part.length), elements(u, part.state, part.length),
                      elements(a.working, part.local, part.length), keep, step);
    }
  }
}

}  // namespace llmtrain::optim
