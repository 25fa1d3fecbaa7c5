// Tensor parallelism's parts outside the model: the model's collectives over a dist::Communicator,
// and the map between a rank's local flat buffer and the whole model's (logical) one, which
// checkpoints, initialisation and the gradient norm need.
#pragma once

#include <cstdint>
#include <vector>

#include "dist/communicator.h"
#include "model/flat_layout.h"
#include "model/model.h"
#include "ops/buffer.h"
#include "optim/piece.h"
#include "parallel/tensor_parallel.h"

namespace llmtrain::parallel {

/// TensorGroup over a communicator of the tensor-parallel group (device memory). Its
/// collectives are queued (dist::Communicator::queue_*): over NCCL ordered on the compute stream
/// with no host wait, and bf16 tensors summed in bf16; where the communicator sums f32 only
/// (MPI, host memory), bf16 tensors are summed in f32 and rounded once.
class CommTensorGroup final : public TensorGroup {
 public:
  CommTensorGroup(dist::Communicator& comm, Device device) : comm_(comm), device_(device) {}
  void all_reduce_sum(const Tensor& t) override;
  void all_reduce_max(const Tensor& t) override;
  void all_gather(const Tensor& part, const Tensor& full) override;
  void reduce_scatter(const Tensor& full, const Tensor& part) override;

 private:
  dist::Communicator& comm_;
  Device device_;
  Tensor widened(const Tensor& t, std::int64_t room = 0);  // t converted into wide_ (f32), room after it
  ops::Buffer wide_;  // bf16 sums in f32
};

/// A run of a rank's local arrays (weights, gradients, optimizer state: see optim::Piece) and
/// where it sits in the whole model's flat buffer.
struct Placed {
  model::FlatRange logical;
  std::int64_t local = 0;  // offset in the local arrays
};

/// The local arrays of `pieces` (flat ranges of the model's local buffer, end to end), placed in
/// the whole model's flat buffer through `segments` (model::Model::segments), in local order. Parts
/// not in `segments` (with owned_only: those another tensor rank lists) are left out.
std::vector<Placed> place(const std::vector<optim::Piece>& pieces, const std::vector<model::Segment>& segments);

/// The flat ranges of the model's local buffer whose gradients the global norm counts on this
/// rank: the parts it owns (a part several ranks hold alike, such as a replicated parameter, has
/// the same gradient on each and counts once).
std::vector<model::FlatRange> norm_ranges(const model::Model& model);

/// Sum of squares of `local` (the local arrays of `pieces`) over the flat ranges `counted`.
double sum_squares_in(const Tensor& local, const std::vector<optim::Piece>& pieces,
                      const std::vector<model::FlatRange>& counted);

}  // namespace llmtrain::parallel
