// The working buffers of ZeRO 3 (parallel/zero3.h): the slots that gathered weights (compute
// dtype) and gradients (f32) live in while a unit is in use, chosen from the units' sizes alone so
// that the trainer (Zero3) and `plan` (plan/memory_plan.h) lay them out the same way.
//
// A unit is in use from its gather to the end of the part of the pass that reads it: a layer in
// its forward and in its backward (or from forward to backward without resharding), the ends of
// the model (parallel/zero3.h) while the embedding or the final norm and head run. Two layouts:
//   - shared: every slot takes any unit and is as large as the largest unit (FSDP's way: the ends
//     come and go through the layers' slots);
//   - apart: the layers' slots are as large as the largest layer, and the ends get slots of their
//     own, as large as the units one end reads at once (the i-th largest unit of the head's set
//     beside the i-th largest of the embedding's).
// Apart is never worse than keeping the ends gathered for the whole step, and is what a model
// whose embedding outweighs a layer needs (GPT-2 124M: 39.4M parameters against 7.1M); shared is
// smaller where the layers are the larger units (Llama-3-70B: 1.05B-parameter embedding and head,
// 0.86B-parameter layers). Each pool (weights, gradients) takes the smaller layout; without
// dist.reshard_after_forward every layer keeps its slot through the head, so the ends go apart.
// When the ends' slots are apart and every unit outside the layers has one of its own (a tied
// GPT-2: the table with the positions, and ln_f), those units stay in them: their weights are
// gathered once per update, and their gradients added over the micro-step's uses and reduced once
// (the old way of keeping them whole, now only where it costs no more memory than sharing).
#pragma once

#include <cstdint>
#include <vector>

namespace llmtrain::parallel {

/// One ZeRO 3 unit as the slots see it: `shard` elements a rank (the unit is W shard long
/// gathered); a layer, or read by the embedding and/or the head.
struct Zero3Unit {
  std::int64_t shard = 0;
  bool layer = false, embedding = false, head = false;
};

/// A slot of `capacity` elements (a whole gathered unit: W x its shard) for layers, ends or both.
struct Zero3Slot {
  std::int64_t capacity = 0;
  bool layers = false, ends = false;
};

/// Weight slots (compute dtype) and gradient slots (f32, each with a reduce-scattered part of
/// capacity / W elements beside it). `weight_home` and `grad_home`, per unit (in the order given):
/// the slot a unit outside the layers keeps for itself, or -1; both empty when the ends do not
/// each have one (their units then take slots as they are used and give them back after).
struct Zero3SlotLayout {
  std::vector<Zero3Slot> weights, grads;
  std::vector<int> weight_home, grad_home;
};

/// The slots for `units` over `world` data-parallel ranks.
Zero3SlotLayout zero3_slot_layout(const std::vector<Zero3Unit>& units, int world, bool reshard_after_forward);

}  // namespace llmtrain::parallel
