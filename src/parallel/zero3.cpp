#include "parallel/zero3.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "ops/ops.h"
#include "parallel/tensor_parallel_comm.h"

namespace llmtrain::parallel {

// A range of the flat buffer gathered and reduced as one piece: one of the model's parameter runs
// (a layer's parameters, or a run outside the layers, which stays gathered for a whole update).
struct Zero3::Unit {
  model::FlatRange range;        // its flat elements
  int layer = -1;                // the layer its parameters belong to; -1: outside the layers
  std::size_t index = 0;         // its run in the model's param_runs()
  std::int64_t shard = 0;        // S: elements per rank (the unit padded to W S)
  std::int64_t part_begin = 0;   // this rank's flat elements [part_begin, part_end)
  std::int64_t part_end = 0;
  std::int64_t local = 0;        // where they start in the local arrays
  bool root = false;             // outside the layers: gathered from one update to the next
  ops::Buffer root_weights, root_grads;  // root units only: (W S) compute dtype, (W S) f32
  int slot = -1;                 // layer units: the weight slot holding the gathered weights
  bool current = false;          // the gathered weights are those of the master weights now
  std::unique_ptr<dist::Request> gathering;  // the gather in flight into them
  float* grads = nullptr;        // where backward adds this unit's gradients now

  std::int64_t part() const { return part_end - part_begin; }
  void* weights(const std::vector<ops::Buffer>& slots) const {
    return root ? root_weights.data() : slot >= 0 ? slots[std::size_t(slot)].data() : nullptr;
  }
};

struct Zero3::GradSlot {
  ops::Buffer sums;    // (W S_max) f32: what backward adds into
  ops::Buffer summed;  // (S_max,) f32: this rank's part summed over the group
  Unit* unit = nullptr;  // the unit whose reduction is in flight
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
  std::int64_t largest_layer = 0, largest = 0;
  for (std::size_t i = 0; i < runs.size(); ++i) {
    Unit& u = units_[i];
    u.range = runs[i];
    u.layer = runs[i].layer;
    u.index = i;
    u.root = u.layer < 0;
    u.shard = (u.range.size() + W_ - 1) / W_;
    u.part_begin = std::min(u.range.end, u.range.begin + rank_ * u.shard);
    u.part_end = std::min(u.range.end, u.part_begin + u.shard);
    u.local = local_size_;
    local_size_ += u.part();
    if (u.part() > 0) pieces_.push_back({u.part_begin, u.part_end, u.local});
    largest = std::max(largest, u.shard);
    if (u.root) {
      u.root_weights = ops::Buffer(device_, std::size_t(u.shard * W_) * dtype_size(compute_));
      u.root_grads = ops::Buffer(device_, std::size_t(u.shard * W_) * sizeof(float));
      ops::zero(flat(u.root_grads.data(), DType::f32, device_, u.shard * W_));
      u.grads = static_cast<float*>(u.root_grads.data());
    } else {
      layer_units_.at(std::size_t(u.layer)) = i;
      largest_layer = std::max(largest_layer, u.shard);
      if (first_layer_ < 0 || u.layer < first_layer_) first_layer_ = u.layer;
    }
  }
  master_ = ops::Buffer(device_, std::size_t(std::max<std::int64_t>(local_size_, 1)) * sizeof(float));
  grads_ = ops::Buffer(device_, std::size_t(std::max<std::int64_t>(local_size_, 1)) * sizeof(float));
  if (local_size_ > 0) {
    ops::zero(master());
    ops::zero(grads());
  }
  scratch_ = ops::Buffer(device_, std::size_t(std::max<std::int64_t>(largest, 1)) * sizeof(float));
  // Two weight slots (the layer at work and the next one, prefetched), or one per layer when
  // the layers stay gathered from forward to backward; two gradient slots (one reducing while
  // the next layer's backward fills the other).
  const std::int64_t layers = model.config().n_layer;
  const std::int64_t slots = reshard_after_forward_ ? std::min<std::int64_t>(2, layers) : layers;
  for (std::int64_t s = 0; s < slots; ++s) {
    weight_slots_.emplace_back(device_, std::size_t(largest_layer * W_) * dtype_size(compute_));
  }
  slot_unit_.assign(weight_slots_.size(), -1);
  grad_slots_.resize(std::size_t(std::min<std::int64_t>(2, layers)));
  for (GradSlot& g : grad_slots_) {
    g.sums = ops::Buffer(device_, std::size_t(largest_layer * W_) * sizeof(float));
    g.summed = ops::Buffer(device_, std::size_t(std::max<std::int64_t>(largest_layer, 1)) * sizeof(float));
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
  std::size_t bytes = master_.bytes() + grads_.bytes() + scratch_.bytes();
  for (const Unit& u : units_) bytes += u.root_weights.bytes() + u.root_grads.bytes();
  for (const ops::Buffer& slot : weight_slots_) bytes += slot.bytes();
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

void Zero3::bind(const Unit& u) { model_.set_run_storage(u.index, u.weights(weight_slots_), u.grads); }

Zero3::Unit& Zero3::layer_unit(int layer) { return units_[layer_units_.at(std::size_t(layer))]; }

// Starts gathering u's weights (into a free slot for a layer): this rank's part of the master
// weights, converted to the compute dtype, goes to its place in the slot; the all-gather brings
// the others'.
void Zero3::gather(Unit& u) {
  if (!u.root && u.slot < 0) {
    auto free = std::find(slot_unit_.begin(), slot_unit_.end(), -1);
    if (free == slot_unit_.end() && kept_layer_ >= 0) {  // the first layer kept for the next forward yields
      release_weights(layer_unit(kept_layer_));
      free = std::find(slot_unit_.begin(), slot_unit_.end(), -1);
    }
    if (free == slot_unit_.end()) throw RuntimeError("ZeRO 3: no free weight slot (a unit was not released)");
    u.slot = int(free - slot_unit_.begin());
    *free = int(u.index);
  }
  void* weights = u.weights(weight_slots_);
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
  if (u.root || u.slot < 0) return;
  if (u.layer == kept_layer_) kept_layer_ = -1;
  if (u.gathering) {  // a prefetch nobody used
    u.gathering->wait();
    u.gathering.reset();
  }
  slot_unit_[std::size_t(u.slot)] = -1;
  u.slot = -1;
  u.current = false;
  bind(u);
}

// Starts the gather of `layer` when it is not gathered and a slot is free.
void Zero3::prefetch(int layer) {
  if (layer < 0 || layer >= int(layer_units_.size())) return;
  Unit& u = layer_unit(layer);
  if (u.current) return;
  if (std::find(slot_unit_.begin(), slot_unit_.end(), -1) == slot_unit_.end()) return;
  gather(u);
}

// Gives the layer a zeroed gradient slot (finishing the reduction that last used it).
void Zero3::begin_backward(Unit& u) {
  GradSlot& slot = grad_slots_[next_grad_slot_];
  next_grad_slot_ = (next_grad_slot_ + 1) % grad_slots_.size();
  finish_reduction(slot);
  ops::zero(flat(slot.sums.data(), DType::f32, device_, u.shard * W_));
  slot.unit = &u;
  u.grads = static_cast<float*>(slot.sums.data());
  bind(u);
}

// Starts summing the unit's gradients of this micro-step over the group into this rank's part.
void Zero3::reduce_gradients(Unit& u, GradSlot& slot) {
  if (W_ > 1) {
    slot.reducing = comm_.start_reduce_scatter_sum(static_cast<float*>(slot.sums.data()),
                                                   static_cast<float*>(slot.summed.data()), u.shard);
  }
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
}

// gradient shard += this micro-step's summed part of unit u.
void Zero3::accumulate(const Unit& u, const float* summed_part) {
  if (u.part() == 0) return;
  const Tensor shard = flat(at(grads_.data(), u.local, DType::f32), DType::f32, device_, u.part());
  ops::residual_forward(shard, shard, flat(const_cast<float*>(summed_part), DType::f32, device_, u.part()));
}

void Zero3::on(model::PassEvent event, int layer) {
  using model::PassEvent;
  switch (event) {
    case PassEvent::forward_begins:
      for (Unit& u : units_) {
        if (u.root) wait_gathered(u);
      }
      break;
    case PassEvent::before_forward:
      if (layer == kept_layer_) kept_layer_ = -1;  // in use again: released as any layer
      wait_gathered(layer_unit(layer));
      prefetch(layer + 1);
      break;
    case PassEvent::after_forward:
      if (reshard_after_forward_) release_weights(layer_unit(layer));
      break;
    case PassEvent::before_backward: {
      Unit& u = layer_unit(layer);
      wait_gathered(u);
      begin_backward(u);
      prefetch(layer - 1);
      break;
    }
    case PassEvent::after_backward: {
      Unit& u = layer_unit(layer);
      if (layer == first_layer_) {
        kept_layer_ = layer;  // gathered already for the next micro-step's forward
      } else {
        release_weights(u);
      }
      const auto slot = std::find_if(grad_slots_.begin(), grad_slots_.end(), [&](const GradSlot& g) { return g.unit == &u; });
      reduce_gradients(u, *slot);
      break;
    }
    case PassEvent::backward_ends:
      for (Unit& u : units_) {
        if (!u.root) continue;
        float* sums = static_cast<float*>(u.root_grads.data());
        if (W_ > 1) comm_.reduce_scatter_sum(sums, static_cast<float*>(scratch_.data()), u.shard);
        accumulate(u, W_ > 1 ? static_cast<const float*>(scratch_.data()) : sums);
        ops::zero(flat(sums, DType::f32, device_, u.shard * W_));
      }
      for (GradSlot& g : grad_slots_) finish_reduction(g);
      break;
  }
}

void Zero3::zero_grads() {
  if (local_size_ > 0) ops::zero(grads());
}

double Zero3::finish(double& loss_sum) {
  double squares = 0.0;
  if (local_size_ > 0) squares = norm_.counted.empty() ? ops::sum_squares(grads()) : sum_squares_in(grads(), pieces_, norm_.counted);
  double sums[2] = {loss_sum, squares};
  host_comm_.all_reduce_sum(sums, 2);
  loss_sum = sums[0];
  norm_.sum(sums[1]);  // the other parts of the model
  return std::sqrt(sums[1]);
}

void Zero3::weights_changed() {
  for (Unit& u : units_) {
    if (u.root) {
      if (u.gathering) {
        u.gathering->wait();
        u.gathering.reset();
      }
      u.current = false;
    } else {
      release_weights(u);
    }
  }
}

}  // namespace llmtrain::parallel
