#include "parallel/zero3.h"

#include <algorithm>
#include <cmath>
#include <tuple>

#include "core/error.h"
#include "ops/ops.h"
#include "parallel/expert_parallel_comm.h"
#include "parallel/tensor_parallel_comm.h"
#include "parallel/zero3_slots.h"

namespace llmtrain::parallel {

// A range of the flat buffer gathered and reduced as one piece: one of the model's parameter runs
// (a layer's parameters, or a run outside the layers, read by one or both ends of the model).
struct Zero3::Unit {
  model::FlatRange range;        // its flat elements
  int layer = -1;                // the layer its parameters belong to; -1: outside the layers
  std::size_t index = 0;         // its run in the model's param_runs()
  std::int64_t shard = 0;        // S: elements per rank (the unit padded to W S)
  std::int64_t part_begin = 0;   // this rank's flat elements [part_begin, part_end)
  std::int64_t part_end = 0;
  std::int64_t local = 0;        // where they start in the local arrays
  int slot = -1;                 // the weight slot holding the gathered weights, or -1
  bool current = false;          // the gathered weights are those of the master weights now
  std::unique_ptr<dist::Request> gathering;  // the gather in flight into them
  float* grads = nullptr;        // where backward adds this unit's gradients now
  bool embedding = false, head = false;  // outside the layers: the ends that read it
  int weight_home = -1, grad_home = -1;  // the slots it keeps for itself (parallel/zero3_slots.h), or -1

  std::int64_t part() const { return part_end - part_begin; }
};

// A buffer the gathered weights of one unit at a time live in.
struct Zero3::WeightSlot {
  ops::Buffer buffer;         // (capacity) compute dtype
  Zero3Slot shape;            // its capacity in elements, and whether layers or ends may take it
  int unit = -1;              // the unit in it, or -1
};

struct Zero3::GradSlot {
  ops::Buffer sums;    // (capacity) f32: what backward adds into
  ops::Buffer summed;  // (capacity / W) f32: this rank's part summed over the group
  Zero3Slot shape;
  Unit* unit = nullptr;  // the unit whose gradients it holds (being added, or reduced)
  bool reduced = false;  // the unit's reduction has started (the slot can be finished and taken)
  std::uint64_t started = 0;  // when, in reductions started: the oldest is finished first
  std::unique_ptr<dist::Request> reducing;
};

namespace {

Tensor flat(void* data, DType dtype, Device device, std::int64_t n) { return Tensor(data, dtype, device, {n}); }

char* at(void* base, std::int64_t element, DType dtype) {
  return static_cast<char*>(base) + std::size_t(element) * dtype_size(dtype);
}

}  // namespace

Zero3::Zero3(model::Model& model, dist::Communicator& comm, dist::Communicator& host_comm, bool reshard_after_forward)
    : model_(model),
      comm_(comm),
      host_comm_(host_comm),
      reshard_after_forward_(reshard_after_forward),
      W_(comm.world_size()),
      rank_(comm.rank()),
      device_(model.device()),
      compute_(model.compute_dtype()) {
  if (!model.external_storage()) throw RuntimeError("ZeRO 3: the model must be built with external storage");
  const auto& runs = model.param_runs();
  units_.resize(runs.size());
  layer_units_.assign(std::size_t(model.config().n_layer), 0);
  for (std::size_t i = 0; i < runs.size(); ++i) {
    Unit& u = units_[i];
    u.range = runs[i];
    u.layer = runs[i].layer;
    u.index = i;
    u.shard = (u.range.size() + W_ - 1) / W_;
    u.part_begin = std::min(u.range.end, u.range.begin + rank_ * u.shard);
    u.part_end = std::min(u.range.end, u.part_begin + u.shard);
    u.local = local_size_;
    local_size_ += u.part();
    if (u.part() > 0) pieces_.push_back({u.part_begin, u.part_end, u.local});
    if (u.layer >= 0) {
      layer_units_.at(std::size_t(u.layer)) = i;
      if (first_layer_ < 0 || u.layer < first_layer_) first_layer_ = u.layer;
      if (u.layer > last_layer_) last_layer_ = u.layer;
    }
  }
  // The units each end of the model reads; every run outside the layers is read by one (else
  // nothing would gather it).
  for (const model::ModelEnd end : {model::ModelEnd::embedding, model::ModelEnd::head}) {
    for (const std::size_t run : model.end_runs(end)) {
      end_units_[std::size_t(end)].push_back(run);
      (end == model::ModelEnd::embedding ? units_[run].embedding : units_[run].head) = true;
    }
  }
  std::vector<Zero3Unit> shapes;
  for (const Unit& u : units_) {
    if (u.layer < 0 && !u.embedding && !u.head) {
      throw RuntimeError("ZeRO 3: parameter run " + std::to_string(u.index) + " lies outside the layers and both ends");
    }
    shapes.push_back({u.shard, u.layer >= 0, u.embedding, u.head});
  }
  master_ = ops::Buffer(device_, std::size_t(std::max<std::int64_t>(local_size_, 1)) * sizeof(float));
  grads_ = ops::Buffer(device_, std::size_t(std::max<std::int64_t>(local_size_, 1)) * sizeof(float));
  if (local_size_ > 0) {
    ops::zero(master());
    ops::zero(grads());
  }
  // The weight and gradient slots (parallel/zero3_slots.h), from the units' shards.
  const Zero3SlotLayout layout = zero3_slot_layout(shapes, W_, reshard_after_forward_);
  for (std::size_t i = 0; i < units_.size(); ++i) {
    if (!layout.weight_home.empty()) units_[i].weight_home = layout.weight_home[i];
    if (!layout.grad_home.empty()) units_[i].grad_home = layout.grad_home[i];
  }
  for (const Zero3Slot& shape : layout.weights) {
    WeightSlot& slot = weight_slots_.emplace_back();
    slot.shape = shape;
    slot.buffer = ops::Buffer(device_, std::size_t(std::max<std::int64_t>(shape.capacity, 1)) * dtype_size(compute_));
  }
  grad_slots_.resize(layout.grads.size());
  for (std::size_t i = 0; i < layout.grads.size(); ++i) {
    GradSlot& g = grad_slots_[i];
    g.shape = layout.grads[i];
    g.sums = ops::Buffer(device_, std::size_t(std::max<std::int64_t>(g.shape.capacity, 1)) * sizeof(float));
    // One rank reduces nothing: its part is the slot itself.
    if (W_ > 1) g.summed = ops::Buffer(device_, std::size_t(std::max<std::int64_t>(g.shape.capacity / W_, 1)) * sizeof(float));
  }
  for (const Unit& u : units_) bind(u);
  model_.set_observer(this);
}

Zero3::~Zero3() {
  // Nothing may be left in flight on buffers about to be freed (an exception mid-step).
  try {
    for (Unit& u : units_) {
      if (u.gathering) u.gathering->wait();
    }
    for (GradSlot& g : grad_slots_) {
      if (g.reducing) g.reducing->wait();
    }
  } catch (...) {
  }
  model_.set_observer(nullptr);
}

Tensor Zero3::master() const { return flat(master_.data(), DType::f32, device_, local_size_); }
Tensor Zero3::grads() const { return flat(grads_.data(), DType::f32, device_, local_size_); }

std::size_t Zero3::state_bytes() const {
  std::size_t bytes = master_.bytes() + grads_.bytes();
  for (const WeightSlot& slot : weight_slots_) bytes += slot.buffer.bytes();
  for (const GradSlot& g : grad_slots_) bytes += g.sums.bytes() + g.summed.bytes();
  return bytes;
}

void Zero3::load(const float* flat_weights) {
  for (const Unit& u : units_) {
    if (u.part() == 0) continue;
    ops::copy(flat(at(master_.data(), u.local, DType::f32), DType::f32, device_, u.part()),
              flat(const_cast<float*>(flat_weights) + u.part_begin, DType::f32, Device::cpu, u.part()));
  }
  weights_changed();
}

void* Zero3::weights_of(const Unit& u) const {
  return u.slot >= 0 ? weight_slots_[std::size_t(u.slot)].buffer.data() : nullptr;
}

void Zero3::bind(const Unit& u) { model_.set_run_storage(u.index, weights_of(u), u.grads); }

Zero3::Unit& Zero3::layer_unit(int layer) { return units_[layer_units_.at(std::size_t(layer))]; }

std::vector<Zero3::Unit*> Zero3::end_units(model::ModelEnd end) {
  std::vector<Unit*> out;
  for (const std::size_t i : end_units_[std::size_t(end)]) out.push_back(&units_[i]);
  return out;
}

// Whether u may use a slot of this shape: of its kind (layer or end) and large enough.
bool Zero3::fits(const Unit& u, const Zero3Slot& shape) const {
  return (u.layer >= 0 ? shape.layers : shape.ends) && shape.capacity >= u.shard * W_;
}

// A free weight slot u fits in (the smallest such), or -1.
int Zero3::free_slot(const Unit& u) const {
  int best = -1;
  for (std::size_t s = 0; s < weight_slots_.size(); ++s) {
    const WeightSlot& slot = weight_slots_[s];
    if (slot.unit >= 0 || !fits(u, slot.shape)) continue;
    if (best < 0 || slot.shape.capacity < weight_slots_[std::size_t(best)].shape.capacity) best = int(s);
  }
  return best;
}

// Starts gathering u's weights into a free slot: this rank's part of the master weights,
// converted to the compute dtype, goes to its place in the slot; the all-gather brings the others'.
void Zero3::gather(Unit& u) {
  if (u.slot < 0 && u.weight_home >= 0) {  // its own slot, which nothing else takes
    u.slot = u.weight_home;
    weight_slots_[std::size_t(u.slot)].unit = int(u.index);
  }
  if (u.slot < 0) {
    int free = free_slot(u);
    if (free < 0 && kept_layer_ >= 0 && fits(u, weight_slots_[std::size_t(layer_unit(kept_layer_).slot)].shape)) {
      // the first layer kept for the next forward yields its slot
      release_weights(layer_unit(kept_layer_));
      free = free_slot(u);
    }
    if (free < 0) throw RuntimeError("ZeRO 3: no free weight slot (a unit was not released)");
    u.slot = free;
    weight_slots_[std::size_t(free)].unit = int(u.index);
  }
  void* weights = weights_of(u);
  void* mine = at(weights, rank_ * u.shard, compute_);
  if (u.part() > 0) {
    const Tensor part = flat(at(master_.data(), u.local, DType::f32), DType::f32, device_, u.part());
    const Tensor out = flat(mine, compute_, device_, u.part());
    if (compute_ == DType::f32) {
      ops::copy(out, part);
    } else {
      ops::convert(out, part);
    }
  }
  if (W_ > 1) u.gathering = comm_.start_all_gather(mine, weights, u.shard, compute_);
  u.current = true;
  bind(u);
}

void Zero3::wait_gathered(Unit& u) {
  if (!u.current) gather(u);
  if (u.gathering) {
    u.gathering->wait();
    u.gathering.reset();
  }
}

void Zero3::release_weights(Unit& u) {
  if (u.slot < 0) return;
  if (u.layer >= 0 && u.layer == kept_layer_) kept_layer_ = -1;
  if (u.gathering) {  // a prefetch nobody used
    u.gathering->wait();
    u.gathering.reset();
  }
  weight_slots_[std::size_t(u.slot)].unit = -1;
  u.slot = -1;
  u.current = false;
  bind(u);
}

// After a use of a unit outside the layers: its slot is given back, unless it is its own (then its
// weights stay gathered until they change).
void Zero3::release_end(Unit& u) {
  if (u.weight_home < 0) release_weights(u);
}

// Starts the gather of u when it is not gathered and a slot is free for it.
void Zero3::prefetch(Unit& u) {
  if (u.current || free_slot(u) < 0) return;
  gather(u);
}

// The next units forward reads after layer `layer`: the next layer's, or after the last one the head's.
void Zero3::prefetch_after(int layer) {
  if (layer < last_layer_) return prefetch(layer_unit(layer + 1));
  for (Unit* u : end_units(model::ModelEnd::head)) prefetch(*u);
}

// Gives the unit a zeroed gradient slot: a free one it fits in (the smallest), else the one whose
// reduction started first, finished now. Any reduction of this unit still in flight is finished
// first (a tied embedding is reduced after the head's backward and again after the embedding's).
void Zero3::begin_backward(Unit& u) {
  GradSlot* slot = nullptr;
  if (u.grad_home >= 0) {  // its own slot: zeroed at its first use of the micro-step, added to after
    slot = &grad_slots_[std::size_t(u.grad_home)];
    if (slot->unit == &u && !slot->reduced) return;
  } else {
    for (GradSlot& g : grad_slots_) {
      if (g.unit == &u) finish_reduction(g);
    }
    // The smallest slot it fits in (a small unit must not take the slot a larger one needs), a
    // free one before one to finish, the earliest reduction first.
    const auto order = [](const GradSlot& g) {
      return std::tuple<std::int64_t, bool, std::uint64_t>(g.shape.capacity, g.unit != nullptr, g.unit ? g.started : 0);
    };
    for (GradSlot& g : grad_slots_) {
      if (!fits(u, g.shape) || (g.unit && !g.reduced)) continue;
      if (!slot || order(g) < order(*slot)) slot = &g;
    }
    if (!slot) throw RuntimeError("ZeRO 3: no gradient slot for a unit (every one is being filled)");
  }
  finish_reduction(*slot);
  ops::zero(flat(slot->sums.data(), DType::f32, device_, u.shard * W_));
  slot->unit = &u;
  slot->reduced = false;
  u.grads = static_cast<float*>(slot->sums.data());
  bind(u);
}

// Starts summing the unit's gradients of this micro-step over the group into this rank's part.
void Zero3::reduce_gradients(Unit& u) {
  const auto slot = std::find_if(grad_slots_.begin(), grad_slots_.end(), [&](const GradSlot& g) { return g.unit == &u; });
  if (slot == grad_slots_.end()) throw RuntimeError("ZeRO 3: a unit's gradients were reduced without a slot");
  if (W_ > 1) {
    slot->reducing = comm_.start_reduce_scatter_sum(static_cast<float*>(slot->sums.data()),
                                                    static_cast<float*>(slot->summed.data()), u.shard);
  }
  slot->reduced = true;
  slot->started = ++reductions_started_;
}

void Zero3::finish_reduction(GradSlot& slot) {
  if (!slot.unit) return;
  if (slot.reducing) {
    slot.reducing->wait();
    slot.reducing.reset();
  }
  // One rank: its part is the whole unit, summed where backward left it.
  accumulate(*slot.unit, static_cast<const float*>(W_ > 1 ? slot.summed.data() : slot.sums.data()));
  slot.unit->grads = nullptr;
  bind(*slot.unit);
  slot.unit = nullptr;
  slot.reduced = false;
}

// gradient shard += this micro-step's summed part of unit u.
void Zero3::accumulate(const Unit& u, const float* summed_part) {
  if (u.part() == 0) return;
  const Tensor shard = flat(at(grads_.data(), u.local, DType::f32), DType::f32, device_, u.part());
  ops::residual_forward(shard, shard, flat(const_cast<float*>(summed_part), DType::f32, device_, u.part()));
}

void Zero3::on(model::PassEvent event, int layer) {
  using model::ModelEnd;
  using model::PassEvent;
  switch (event) {
    case PassEvent::forward_begins:
      // A forward without backward (validation) left the head's units gathered.
      for (Unit* u : end_units(ModelEnd::head)) release_end(*u);
      for (Unit* u : end_units(ModelEnd::embedding)) prefetch(*u);
      if (first_layer_ >= 0) prefetch(layer_unit(first_layer_));
      break;
    case PassEvent::before_embedding:
      for (Unit* u : end_units(ModelEnd::embedding)) wait_gathered(*u);
      break;
    case PassEvent::after_embedding:
      for (Unit* u : end_units(ModelEnd::embedding)) release_end(*u);
      if (first_layer_ >= 0) prefetch(layer_unit(first_layer_));
      break;
    case PassEvent::before_forward:
      if (layer == kept_layer_) kept_layer_ = -1;  // in use again: released as any layer
      wait_gathered(layer_unit(layer));
      prefetch_after(layer);
      break;
    case PassEvent::after_forward:
      if (reshard_after_forward_) release_weights(layer_unit(layer));
      break;
    case PassEvent::before_head:
      for (Unit* u : end_units(ModelEnd::head)) wait_gathered(*u);
      break;
    case PassEvent::before_head_backward:
      for (Unit* u : end_units(ModelEnd::head)) {
        wait_gathered(*u);
        begin_backward(*u);
      }
      if (last_layer_ >= 0) prefetch(layer_unit(last_layer_));
      break;
    case PassEvent::after_head_backward:
      for (Unit* u : end_units(ModelEnd::head)) {
        release_end(*u);
        // A tied table that keeps its gradient slot is reduced once, after the embedding's backward.
        if (!(u->embedding && u->grad_home >= 0)) reduce_gradients(*u);
      }
      if (last_layer_ >= 0) prefetch(layer_unit(last_layer_));
      break;
    case PassEvent::before_backward: {
      Unit& u = layer_unit(layer);
      wait_gathered(u);
      begin_backward(u);
      if (layer > first_layer_) prefetch(layer_unit(layer - 1));
      break;
    }
    case PassEvent::after_backward: {
      Unit& u = layer_unit(layer);
      if (layer == first_layer_) {
        kept_layer_ = layer;  // gathered already for the next micro-step's forward
      } else {
        release_weights(u);
      }
      reduce_gradients(u);
      break;
    }
    case PassEvent::before_embedding_backward:
      // Its backward adds into the gradients alone: the weights stay where they are (released).
      for (Unit* u : end_units(ModelEnd::embedding)) begin_backward(*u);
      break;
    case PassEvent::backward_ends:
      for (Unit* u : end_units(ModelEnd::embedding)) {
        if (u->grads) reduce_gradients(*u);
      }
      for (GradSlot& g : grad_slots_) finish_reduction(g);
      break;
  }
}

void Zero3::zero_grads() {
  if (local_size_ > 0) ops::zero(grads());
}

double Zero3::finish(double& loss_sum) {
  if (expert_.group && local_size_ > 0) {
    for (const optim::Piece& p : pieces_) {
      const Tensor part(grads().as<float>() + p.local, DType::f32, grads().device, {p.size()});
      sum_shared_grads(*expert_.group, part, p.begin, expert_.shared);
    }
  }
  double squares = 0.0;
  if (local_size_ > 0) squares = !norm_.scoped ? ops::sum_squares(grads()) : sum_squares_in(grads(), pieces_, norm_.counted);
  double sums[2] = {loss_sum, squares};
  host_comm_.all_reduce_sum(sums, 2);
  loss_sum = sums[0];
  norm_.sum(sums[1]);  // the other parts of the model
  return std::sqrt(sums[1]);
}

void Zero3::weights_changed() {
  for (Unit& u : units_) release_weights(u);
}

}  // namespace llmtrain::parallel
