// Muon (MomentUm Orthogonalized by Newton-Schulz) over the model's hidden matrices, AdamW over
// every other parameter, behind the Optimizer interface (optim/optimizer.h). The update is
// torch.optim.Muon's: momentum buf <- buf + (1 - mu)(g - buf), u = g + mu (buf - g) (Nesterov) or
// buf, O = Newton-Schulz(u) (optim/newton_schulz.h), W <- W (1 - lr wd) - lr_adj O with lr_adj
// from the matrix's logical (out, in) shape. The hidden matrices are each layer's 2-D weights
// (GPT-2's fused c_attn as its q, k and v blocks, each orthogonalised on its own; each expert's
// matrices of a MoE layer apart); the embeddings, the output head, norms, biases and MoE routers
// are AdamW's, with optim's keys. One schedule scales both learning rates. State:
// "muon.momentum" (the momentum of the Muon matrices' elements: 4 bytes each) and "adamw.m",
// "adamw.v" (AdamW's moments of the other elements: 8 bytes each), each for its own elements only
// (StateLayout::held_runs), so that a Muon run keeps about 4 bytes of state per parameter where
// AdamW keeps 8.
// Under ZeRO (UpdateArgs::shard_group) each matrix is orthogonalised once, by an owner rank chosen
// round-robin over the matrices, which gathers the other ranks' parts of u and sends theirs of O
// back (point-to-point transfers through the data-parallel communicator, counted there). Under
// tensor parallelism (UpdateArgs::tensor_group) a column-parallel matrix is split in rows and a
// row-parallel one in columns: the rank of the tensor group that owns it (round-robin again, after
// the data owners) gathers the slices, orthogonalises the whole and sends each rank its slice of
// O back. With both, the data owner first gathers its tensor rank's slice, then the tensor step
// runs among the data owners of that matrix (one per tensor rank).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "config/config.h"
#include "dist/communicator.h"
#include "core/tensor.h"
#include "model/model.h"
#include "ops/buffer.h"
#include "ops/ops.h"
#include "optim/newton_schulz.h"
#include "optim/optimizer.h"
#include "optim/piece.h"

namespace llmtrain::optim {

/// One matrix Muon orthogonalises: `rows` x `cols` (out, in) elements, row-major from `offset` of
/// the flat buffer whose ParamInfo it comes from.
/// Under tensor parallelism `rows` x `cols` is this rank's slice of the (full_rows, full_cols)
/// matrix: `slice` (at most one block, in the matrix's own indices) says which.
struct MuonMatrix {
  std::string name;  // the parameter's name; "...c_attn.weight[q]" for a block of a fused one
  std::int64_t offset = 0, rows = 0, cols = 0;
  std::int64_t full_rows = 0, full_cols = 0;
  model::TensorSlice slice;
  std::int64_t numel() const { return rows * cols; }
};

/// Whether Muon updates this parameter: every 2-D parameter of a transformer layer but a MoE
/// layer's router, and a MoE layer's experts (E, out, in); the rest is AdamW's.
bool muon_updates(const model::ParamInfo& info);

/// The matrices of `infos` that Muon updates (muon_updates; GPT-2's c_attn split into q, k and
/// v; each expert's (out, in) matrix on its own, named "...gate_proj[e]"), in their order. RuntimeError for a tensor-parallel slice of more than one block of a
/// matrix.
std::vector<MuonMatrix> muon_matrices(const std::vector<model::ParamInfo>& infos);

/// lr_adj for a (rows, cols) matrix: lr sqrt(max(1, rows / cols)) ("original") or
/// lr 0.2 sqrt(max(rows, cols)) ("match_rms_adamw").
double muon_adjusted_lr(double lr, const std::string& adjust_lr, std::int64_t rows, std::int64_t cols);

class Muon final : public Optimizer {
 public:
  /// optim.name's value for Muon.
  static constexpr const char* name = "muon";
  /// Bytes of state per element of a Muon matrix: the f32 momentum (the other elements keep
  /// AdamW's m and v, AdamW::bytes_per_param).
  static constexpr std::int64_t momentum_bytes = 4;

  /// Zero state for `pieces` of the parameters `infos` (this rank's model's) on `device` (the CPU
  /// or a GPU: every step of the update, Newton-Schulz and the transfers included, runs where the
  /// parameters are).
  Muon(std::vector<Piece> pieces, const std::vector<model::ParamInfo>& infos, const config::OptimConfig& optim,
       Device device = Device::cpu);

  /// One update: gradients scaled so that the global norm is at most grad_clip, then Muon on the
  /// matrices and AdamW on the rest, both at args.lr's place in the schedule.
  void update(const UpdateArgs& args) override;
  /// "muon.momentum", "adamw.m" and "adamw.v".
  std::vector<StateTensor> state() const override;

  /// The momentum of the Muon matrices' elements of the pieces (muon_runs(), end to end).
  Tensor momentum() const { return momentum_.view(DType::f32, {total(muon_runs_)}); }
  /// AdamW's moments of the other elements (adamw_runs(), end to end).
  Tensor m() const { return m_.view(DType::f32, {total(adamw_runs_)}); }
  Tensor v() const { return v_.view(DType::f32, {total(adamw_runs_)}); }
  /// The runs of the local arrays that hold Muon matrices' elements, and the others (together
  /// [0, size())), each sorted.
  const std::vector<model::FlatRange>& muon_runs() const { return muon_runs_; }
  const std::vector<model::FlatRange>& adamw_runs() const { return adamw_runs_; }

 private:
  // One part of a Muon matrix on one rank of the shard group: elements [at, at + length) of the
  // matrix, at `local` in that rank's local arrays and at `state` in its momentum and u (known
  // for this rank's parts only).
  struct Part {
    int rank = 0;
    std::int64_t at = 0, length = 0, local = 0, state = 0;
  };
  // Which block of a matrix one tensor rank holds (dim -1: the whole matrix, replicated).
  struct Slice {
    int dim = -1;
    std::int64_t first = 0, count = 0;
    bool owner = true;  // false: a replica of another rank's block (it receives O, sends nothing)
  };
  // A Muon matrix and where its parts lie; `owner` orthogonalises it (matrices round-robin over
  // the shard group's ranks), with `tensor_owner` of the tensor group when it is split there.
  struct Placed {
    std::int64_t rows = 0, cols = 0;            // this tensor rank's slice
    std::int64_t full_rows = 0, full_cols = 0;  // the whole matrix
    int owner = 0, tensor_owner = 0;
    std::vector<Part> parts;
    std::vector<Slice> slices;  // each tensor rank's, when split over the tensor group; else empty
  };
  void lay_out(const UpdateArgs& a);
  // Each tensor rank's slice of every matrix (all-gathered over the tensor group once).
  static std::vector<std::vector<Slice>> place_slices(dist::Communicator& tensor, Device device,
                                                      const std::vector<MuonMatrix>& matrices);
  // ZeRO: this rank's parts of u to each matrix's owner, whose whole_ then holds its slice.
  void gather_parts(dist::Communicator& group, const Tensor& u, std::vector<dist::PeerTransfer>& scatter);
  // The tensor ranks' blocks of a split matrix: from `parts` into full (R, C) or back (to_parts);
  // parts[r] is rank r's block, flat (no data: skipped).
  void copy_blocks(const Placed& mat, const Tensor& full, const std::vector<Tensor>& parts, bool to_parts);
  // O in place of u's slice `local` of each matrix in `held` (held whole by this rank): through
  // the tensor group's owner when split over it, else here; one batched Newton-Schulz per shape.
  void orthogonalise(dist::Communicator* tensor, const std::vector<std::pair<std::size_t, float*>>& held);

  static std::int64_t total(const std::vector<model::FlatRange>& runs) {
    std::int64_t n = 0;
    for (const model::FlatRange& r : runs) n += r.size();
    return n;
  }

  config::OptimConfig optim_;
  double lr_ = 0.0, weight_decay_ = 0.0;  // Muon's peak lr and weight decay
  NewtonSchulz ns_;
  NewtonSchulzWork ns_work_;
  Device device_ = Device::cpu;
  std::vector<model::FlatRange> muon_runs_, adamw_runs_;
  ops::Buffer momentum_, m_, v_;
  std::vector<Placed> matrices_;  // those with a part on this rank
  int rank_ = 0;
  ops::AdamWPlan adamw_plan_;  // the elements outside the matrices
  bool planned_ = false;
  // On the device, each laid out once: u, then O, laid out as the momentum; the matrices
  // this rank owns, gathered (ZeRO); the split matrices this tensor rank owns, whole, their other
  // tensor ranks' slices, and a column-split one transposed.
  ops::Buffer u_;
  std::vector<ops::Buffer> whole_, full_;
  std::vector<std::vector<ops::Buffer>> slices_;
  ops::Buffer transposed_;
};

}  // namespace llmtrain::optim
