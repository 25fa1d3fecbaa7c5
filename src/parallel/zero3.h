// Fully sharded data parallelism (ZeRO 3): each rank of the data-parallel group keeps only its
// shard of the fp32 master weights, of the gradients and (in optim/) of the optimizer state.
//
// The shards follow units formed from the model's parameter runs (model::ParamRun: one per layer,
// plus the runs of parameters outside the layers), one unit per run. A unit of n elements over W ranks is cut into W parts of S = ceil(n / W)
// elements; rank r owns flat elements [begin + r S, begin + (r + 1) S) of it, clipped to the
// unit (the last ranks' parts may be short or empty). This rank's parts of all units, laid end to
// end, are its local arrays: master weights, gradients, m and v.
//
// As forward and backward reach each layer and each end of the model (model::PassEvent, heard as
// the model's observer; the model's weights live in storage this class owns,
// model::Layout::external_storage, bound unit by unit), the units it reads are gathered in the
// compute dtype (bf16 under mixed precision) into one of a few working slots, the next layer's
// gather is started meanwhile (prefetch), and the slot is freed after the layer's forward
// (dist.reshard_after_forward) and after its backward, except the first layer's after backward: it
// stays gathered for the next micro-step's forward (until the weights change, or its slot is
// needed). The ends are units too, gathered for the part of the pass that reads them (the
// embedding's run for its forward, the final norm's and head's from the head's forward to the end
// of its backward; a tied head reads the embedding's run again), in slots laid out by
// parallel/zero3_slots.h: either the layers' own (FSDP's way) or slots of their own, where a unit
// that has one stays gathered until the weights change. Each request is waited for alone: a
// gather does not wait for the reduce-scatter started after it (the NCCL communicator waits for
// each request's own event). Each unit's gradients go to a zeroed f32 slot and are
// reduce-scattered into this rank's gradient shard as soon as its backward is done, every
// micro-step (a tied table after the head's backward and again after the embedding's, or once at
// the end when it keeps a gradient slot of its own).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "dist/communicator.h"
#include "model/model.h"
#include "ops/buffer.h"
#include "optim/piece.h"
#include "parallel/grad_sync.h"
#include "parallel/zero3_slots.h"

namespace llmtrain::parallel {

class Zero3 final : public model::PassObserver {
 public:
  /// Shards `model` (built with external storage: model::Model::external_storage) over `comm`, the
  /// data-parallel group over the memory the model lives in; `host_comm` is the same group over host
  /// memory (norms). Installs itself as the model's observer; the master weights start at zero
  /// (load() fills them).
  Zero3(model::Model& model, dist::Communicator& comm, dist::Communicator& host_comm, bool reshard_after_forward);
  ~Zero3() override;
  Zero3(const Zero3&) = delete;
  Zero3& operator=(const Zero3&) = delete;

  /// This rank's parts of the flat buffer, in local order (empty parts left out).
  const std::vector<optim::Piece>& pieces() const { return pieces_; }
  /// Local arrays, (local_size,) f32 on the model's device.
  Tensor master() const;
  Tensor grads() const;  // summed over the group once finish() returned

  /// Fills this rank's master weights from the whole flat weights `flat` (P,) f32 in host memory.
  void load(const float* flat);

  /// Before an update's first micro-step: the gradient shard is zeroed.
  void zero_grads();
  /// After the last micro-step's backward: waits for the reduce-scatters in flight and returns the
  /// global gradient norm; `loss_sum` (this rank's) is summed over the group in the same call.
  double finish(double& loss_sum);
  void set_norm_scope(NormScope scope) { norm_ = std::move(scope); }
  void set_expert_scope(ExpertScope scope) { expert_ = std::move(scope); }
  /// After the optimizer changed the master weights: every gathered copy is out of date.
  void weights_changed();

  /// Bytes of the buffers held: shards (master weights and gradients), gathered weights and
  /// gradient slots. (The optimizer state shard is the optimizer's.)
  std::size_t state_bytes() const;

  void on(model::PassEvent event, int layer) override;

 private:
  struct Unit;
  struct WeightSlot;
  struct GradSlot;

  Unit& layer_unit(int layer);
  std::vector<Unit*> end_units(model::ModelEnd end);
  void* weights_of(const Unit& u) const;
  bool fits(const Unit& u, const Zero3Slot& shape) const;
  int free_slot(const Unit& u) const;
  void gather(Unit& u);
  void wait_gathered(Unit& u);
  void release_weights(Unit& u);
  void release_end(Unit& u);
  void prefetch(Unit& u);
  void prefetch_after(int layer);
  void begin_backward(Unit& u);
  void reduce_gradients(Unit& u);
  void finish_reduction(GradSlot& slot);
  void accumulate(const Unit& u, const float* summed_part);
  void bind(const Unit& u);

  model::Model& model_;
  dist::Communicator& comm_;
  dist::Communicator& host_comm_;
  const bool reshard_after_forward_;
  const int W_, rank_;
  const Device device_;
  const DType compute_;
  std::vector<Unit> units_;
  std::vector<std::size_t> layer_units_;     // per layer: its index in units_
  std::vector<std::size_t> end_units_[2];    // per model::ModelEnd: the units it reads
  std::vector<optim::Piece> pieces_;
  std::int64_t local_size_ = 0;
  ops::Buffer master_, grads_;
  std::vector<WeightSlot> weight_slots_;
  std::vector<GradSlot> grad_slots_;
  std::uint64_t reductions_started_ = 0;
  int first_layer_ = -1;  // the first layer forward reaches (the last backward leaves)
  int last_layer_ = -1;   // the last layer forward reaches (the first backward reaches)
  int kept_layer_ = -1;   // the first layer, kept gathered after backward for the next forward
  NormScope norm_;
  ExpertScope expert_;
};

}  // namespace llmtrain::parallel
