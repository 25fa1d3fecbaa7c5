// Which layers each pipeline stage holds: contiguous ranges, balanced by cost, or as
// dist.pipeline_layers lists them.
//
// The split is over the P V virtual stages (dist.pipeline_parallel x dist.virtual_stages; V = 1
// for 1F1B): range v goes to stage v % P as its chunk v / P (parallel/pipeline_schedule.h). The first
// virtual stage also holds the embedding, the last the final norm, the head and the loss.
//
// The cost model: training FLOPs per token (forward and backward), as flops_per_token counts them
// (plan/memory_plan.h).
//   a layer:     6 x its weights (the matmuls) + 12 x C x T (attention's scores and weighted sums)
//   the head:    6 x V x C (the logits matmul; the final norm and the loss's softmax, a few C and V,
//                are left out)
//   the embedding: 2 x C per table (gpt2: token and position; llama: token), the lookup's add
//                forward and the gradient's add backward: next to nothing (6e-5 of a layer for
//                GPT-2 small)
// GPT-2 small (C 768, T 1024, V 50257): a layer 51.9 MFLOP per token, the head 231.6 MFLOP = 4.46
// layers, so its last stage gets few layers. Every stage takes at least one layer; the others go one
// at a time to the stage that is cheapest with it (the latest such stage on a tie). That minimises
// the most expensive stage (all layers cost the same), and among equal splits gives earlier stages
// fewer layers: they keep more micro-batches' activations alive under 1F1B (P on stage 0, 1 on the
// last).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "config/config.h"
#include "model/flat_layout.h"

namespace llmtrain::parallel {

/// The layers of one virtual stage (a model chunk of its pipeline stage): first_layer ..
/// first_layer + layers - 1.
struct StageRange {
  std::int64_t first_layer = 0;
  std::int64_t layers = 0;
  bool operator==(const StageRange&) const = default;
};

/// A chunk's layers as the model takes them (model::Layout::layer_ranges).
model::LayerRange layer_range(const StageRange& chunk);
/// The chunks of pipeline stage `stage` of `stages` in `split` (virtual stages stage, stage +
/// stages, ...): the layer ranges that stage's model is built for, the index of each its chunk
/// index in the schedule (Model::use_layer_range).
std::vector<model::LayerRange> stage_layer_ranges(const std::vector<StageRange>& split, int stage, int stages);

/// Training FLOPs per token of the parts the split balances (the cost model above).
struct StageCostModel {
  double layer = 0;      // one transformer layer
  double embedding = 0;  // the first stage's extra
  double head = 0;       // the last stage's extra: final norm, head, loss
};

/// The cost model above for `model`.
StageCostModel stage_cost_model(const config::ModelConfig& model);

/// The cost of each range of `split` under `costs` (the embedding on the first, the head on the last).
std::vector<double> stage_costs(const StageCostModel& costs, const std::vector<StageRange>& split);

/// The ranges of `stages` virtual stages: `by_hand` (dist.pipeline_layers, layers per virtual
/// stage) when not empty, else balanced by the cost model. InputError naming the keys when there
/// are more stages than model.n_layer, or `by_hand` has the wrong length, a count below 1, or does
/// not add up to model.n_layer.
std::vector<StageRange> split_layers(const config::ModelConfig& model, int stages,
                                     const std::vector<std::int64_t>& by_hand);

/// The split of dist.pipeline_layers, or balanced, over dist.pipeline_parallel x dist.virtual_stages.
std::vector<StageRange> split_layers(const config::Config& config);

/// One line for the start-up log: "stage 0: layers 0-2 + embedding (3.00); stage 1: layers 3-6
/// (4.00); ...", each stage's chunks in order, with its cost in layers.
std::string describe_split(const config::ModelConfig& model, const std::vector<StageRange>& split,
                           int pipeline_parallel);

}  // namespace llmtrain::parallel
