// The optimizer interface: one update over a rank's pieces of the parameters it owns, and the
// state it keeps as named tensors laid out like those pieces. The trainer, the checkpoints and
// `plan` see an optimizer only through this header and optim/registry.h (which builds one from
// optim.name), so a new optimizer is a file of its own plus its registration.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"
#include "model/model.h"
#include "optim/piece.h"

namespace llmtrain::dist {
class Communicator;
}

namespace llmtrain::optim {

/// What one update gets. The tensors are the rank's local arrays (the pieces end to end) on the
/// model's device.
struct UpdateArgs {
  const std::vector<model::ParamInfo>& infos;  // which flat elements are which parameter; the same every call
  Tensor params;           // (size(),) f32: the master weights, updated in place
  Tensor grads;            // (size(),) f32: their gradients, summed over the data-parallel group
  double grad_norm = 0.0;  // the global gradient norm (all ranks' gradients)
  double grad_clip = 0.0;  // gradients are scaled so that the norm is at most this (0: no clipping)
  double lr = 0.0;         // this update's learning rate (optim/lr_schedule.h)
  std::int64_t step = 0;   // the update's number, 1-based
  Tensor working = {};     // (size(),) bf16 when it has data: receives the updated weights rounded to
                           // bf16 (the model's working copy under mixed precision)
  // The ranks whose pieces together hold every parameter whole, when this rank's pieces are a
  // shard of them (ZeRO's data-parallel group, moving the memory of the model's device: NCCL on
  // GPUs); null when each rank's pieces hold whole parameters. An optimizer that needs whole
  // tensors (Muon) gathers them through it.
  dist::Communicator* shard_group = nullptr;
  // The tensor-parallel group (the model's device's memory, as shard_group) when it has more than
  // one rank: parameters whose ParamInfo::slice is not whole are split over it. An optimizer that
  // needs whole tensors gathers them through it.
  dist::Communicator* tensor_group = nullptr;
};

/// How a state tensor lies over the ranks.
enum class StateLayout {
  // One element per element of the pieces, laid out as them: element i belongs to the parameter
  // element the weights' local arrays hold at i. Checkpoints save and load such a tensor as ranges
  // of the whole model's flat buffer, so over any mesh.
  like_params,
  // One element per element of the runs `held` of the local arrays only, end to end (state kept
  // for some parameters: Muon's momentum for its matrices, AdamW's moments for the rest).
  // Checkpoints store it as like_params, zero where it holds nothing, so that its file is the same
  // on every mesh and for every split of the parameters between optimizers.
  held_runs,
};

/// One tensor of an optimizer's state, under the name checkpoints store it by.
struct StateTensor {
  std::string name;  // e.g. "adamw.m": unique among the optimizers a run uses
  Tensor tensor;     // f32 on the model's device: (size(),), or (elements of `held`,)
  StateLayout layout = StateLayout::like_params;
  std::vector<model::FlatRange> held = {};  // held_runs: sorted, disjoint runs of [0, size())
};

class Optimizer {
 public:
  explicit Optimizer(std::vector<Piece> pieces) : pieces_(std::move(pieces)), size_(total_size(pieces_)) {}
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  /// One update of the weights of the pieces.
  virtual void update(const UpdateArgs& args) = 0;
  /// The state it keeps, named; the same tensors in the same order for the optimizer's life (a
  /// resume writes into them before the first update).
  virtual std::vector<StateTensor> state() const = 0;

  /// The runs of the flat buffer it updates, in local order.
  const std::vector<Piece>& pieces() const { return pieces_; }
  /// Elements of each local array (the pieces' together).
  std::int64_t size() const { return size_; }
  /// Bytes of its state, all tensors together.
  std::size_t state_bytes() const {
    std::size_t bytes = 0;
    for (const StateTensor& s : state()) bytes += s.tensor.bytes();
    return bytes;
  }

 private:
  std::vector<Piece> pieces_;
  std::int64_t size_ = 0;
};

}  // namespace llmtrain::optim
