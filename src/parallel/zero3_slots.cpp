#include "parallel/zero3_slots.h"

#include <algorithm>
#include <functional>

namespace llmtrain::parallel {
namespace {

std::int64_t total(const std::vector<Zero3Slot>& slots) {
  std::int64_t sum = 0;
  for (const Zero3Slot& s : slots) sum += s.capacity;
  return sum;
}

// Each unit outside the layers in a slot of its own among the ends' slots of `slots` (the largest
// unit in the largest slot, and so on), or empty when they are fewer or too small.
std::vector<int> homes(const std::vector<Zero3Unit>& units, const std::vector<Zero3Slot>& slots, std::int64_t W) {
  std::vector<std::size_t> end_units, end_slots;
  for (std::size_t i = 0; i < units.size(); ++i) {
    if (!units[i].layer) end_units.push_back(i);
  }
  for (std::size_t i = 0; i < slots.size(); ++i) {
    if (slots[i].ends && !slots[i].layers) end_slots.push_back(i);
  }
  if (end_units.empty() || end_units.size() > end_slots.size()) return {};
  std::stable_sort(end_units.begin(), end_units.end(), [&](std::size_t a, std::size_t b) { return units[a].shard > units[b].shard; });
  std::stable_sort(end_slots.begin(), end_slots.end(), [&](std::size_t a, std::size_t b) { return slots[a].capacity > slots[b].capacity; });
  std::vector<int> home(units.size(), -1);
  for (std::size_t i = 0; i < end_units.size(); ++i) {
    if (slots[end_slots[i]].capacity < W * units[end_units[i]].shard) return {};
    home[end_units[i]] = int(end_slots[i]);
  }
  return home;
}

}  // namespace

Zero3SlotLayout zero3_slot_layout(const std::vector<Zero3Unit>& units, int world, bool reshard_after_forward) {
  const std::int64_t W = world;
  std::int64_t layers = 0, largest_layer = 0, largest_end = 0;
  std::vector<std::int64_t> head, embedding;  // the shards each end reads
  for (const Zero3Unit& u : units) {
    if (u.layer) {
      ++layers;
      largest_layer = std::max(largest_layer, u.shard);
      continue;
    }
    largest_end = std::max(largest_end, u.shard);
    if (u.head) head.push_back(u.shard);
    if (u.embedding) embedding.push_back(u.shard);
  }
  std::sort(head.begin(), head.end(), std::greater<>());
  std::sort(embedding.begin(), embedding.end(), std::greater<>());
  // The ends' own slots: the i-th largest of either end's units.
  std::vector<Zero3Slot> ends;
  for (std::size_t i = 0; i < std::max(head.size(), embedding.size()); ++i) {
    const std::int64_t h = i < head.size() ? head[i] : 0, e = i < embedding.size() ? embedding[i] : 0;
    ends.push_back({W * std::max(h, e), false, true});
  }
  const auto apart = [&](std::int64_t layer_slots) {
    std::vector<Zero3Slot> slots(std::size_t(layer_slots), Zero3Slot{W * largest_layer, true, false});
    slots.insert(slots.end(), ends.begin(), ends.end());
    return slots;
  };
  const auto shared = [&](std::int64_t count) {
    return std::vector<Zero3Slot>(std::size_t(count), Zero3Slot{W * std::max(largest_layer, largest_end), true, true});
  };
  const std::int64_t H = std::int64_t(head.size()), E = std::int64_t(embedding.size());
  Zero3SlotLayout layout;
  // Weights: resharded, the layer at work and the next one prefetched; at most the head's units
  // at once at the head, the embedding's beside the first layer (kept from backward) before it.
  if (reshard_after_forward) {
    layout.weights = apart(std::min<std::int64_t>(2, layers));
    const auto one_pool = shared(std::max({std::int64_t(2), H, E + 1}));
    if (total(one_pool) < total(layout.weights)) layout.weights = one_pool;
  } else {
    layout.weights = apart(layers);
  }
  // Gradients: a layer's filled while the one before it is reduced; at most the head's units at
  // once (a tied embedding with the final norm).
  layout.grads = apart(std::min<std::int64_t>(2, layers));
  const auto one_pool = shared(std::max({std::int64_t(2), H, E}));
  if (total(one_pool) < total(layout.grads)) layout.grads = one_pool;
  layout.weight_home = homes(units, layout.weights, W);
  layout.grad_home = homes(units, layout.grads, W);
  return layout;
}

}  // namespace llmtrain::parallel
