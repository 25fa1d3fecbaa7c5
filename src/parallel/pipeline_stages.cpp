#include "parallel/pipeline_stages.h"

#include <cstdio>

#include "core/error.h"
#include "model/arch.h"
#include "model/model.h"

namespace llmtrain::parallel {

StageCostModel stage_cost_model(const config::ModelConfig& m) {
  // A layer's weights, from the model's own parameter list (external storage: nothing allocated).
  const auto model = model::make_model(m, Device::cpu, config::Recompute::none, DType::f32,
                                       ops::AttentionKernels::flash, model::Layout{true});
  const double layer_weights = double(model->layer_params(0).size());
  const double C = double(m.d_model);
  // the token embedding, and a learned positions table where the architecture has one
  const double tables = model::arch_spec(m.arch).traits().positions == config::Positions::learned ? 2 : 1;
  StageCostModel costs;
  costs.layer = 6 * layer_weights + 12 * C * double(m.context_length);
  costs.embedding = 2 * C * tables;
  costs.head = 6 * double(m.vocab_size) * C;
  return costs;
}

model::LayerRange layer_range(const StageRange& chunk) {
  return {int(chunk.first_layer), int(chunk.first_layer + chunk.layers)};
}

std::vector<model::LayerRange> stage_layer_ranges(const std::vector<StageRange>& split, int stage, int stages) {
  std::vector<model::LayerRange> ranges;
  for (std::size_t v = std::size_t(stage); v < split.size(); v += std::size_t(stages)) ranges.push_back(layer_range(split[v]));
  return ranges;
}

std::vector<double> stage_costs(const StageCostModel& costs, const std::vector<StageRange>& split) {
  std::vector<double> out;
  for (const auto& range : split) out.push_back(double(range.layers) * costs.layer);
  if (!out.empty()) {
    out.front() += costs.embedding;
    out.back() += costs.head;
  }
  return out;
}

std::vector<StageRange> split_layers(const config::ModelConfig& model, int stages,
                                     const std::vector<std::int64_t>& by_hand) {
  const std::int64_t L = model.n_layer;
  const std::string stages_key = "dist.pipeline_parallel x dist.virtual_stages";
  if (stages < 1 || stages > L) {
    throw InputError(stages_key + ": " + std::to_string(stages) + " stage(s), but model.n_layer is " +
                     std::to_string(L) + " (every stage needs at least one layer)");
  }
  std::vector<std::int64_t> layers;
  if (!by_hand.empty()) {
    if (std::int64_t(by_hand.size()) != stages) {
      throw InputError("dist.pipeline_layers: lists " + std::to_string(by_hand.size()) + " stage(s), expected " +
                       std::to_string(stages) + " (" + stages_key + ")");
    }
    std::int64_t sum = 0;
    for (std::size_t i = 0; i < by_hand.size(); ++i) {
      if (by_hand[i] < 1) {
        throw InputError("dist.pipeline_layers: entry " + std::to_string(i) + " is " + std::to_string(by_hand[i]) +
                         "; every stage needs at least one layer");
      }
      sum += by_hand[i];
    }
    if (sum != L) {
      throw InputError("dist.pipeline_layers: adds up to " + std::to_string(sum) + " layers, expected model.n_layer (" +
                       std::to_string(L) + ")");
    }
    layers = by_hand;
  } else {
    // One layer each, then each of the rest to the stage cheapest with it (the latest on a tie).
    const StageCostModel costs = stage_cost_model(model);
    layers.assign(std::size_t(stages), 1);
    std::vector<double> cost(std::size_t(stages), costs.layer);
    cost.front() += costs.embedding;
    cost.back() += costs.head;
    for (std::int64_t left = L - stages; left > 0; --left) {
      std::size_t cheapest = 0;
      for (std::size_t s = 1; s < cost.size(); ++s) {
        if (cost[s] <= cost[cheapest]) cheapest = s;
      }
      ++layers[cheapest];
      cost[cheapest] += costs.layer;
    }
  }
  std::vector<StageRange> split;
  std::int64_t first = 0;
  for (const std::int64_t n : layers) {
    split.push_back({first, n});
    first += n;
  }
  return split;
}

std::vector<StageRange> split_layers(const config::Config& config) {
  return split_layers(config.model, int(config.dist.pipeline_parallel * config.dist.virtual_stages),
                      config.dist.pipeline_layers);
}

std::string describe_split(const config::ModelConfig& model, const std::vector<StageRange>& split,
                           int pipeline_parallel) {
  const StageCostModel costs = stage_cost_model(model);
  const std::vector<double> cost = stage_costs(costs, split);
  const int P = pipeline_parallel;
  std::string text;
  for (int s = 0; s < P; ++s) {
    double stage_cost = 0;
    text += (s ? "; stage " : "stage ") + std::to_string(s) + ":";
    // The chunks of stage s: virtual stages s, s + P, s + 2P, ...
    for (std::size_t v = std::size_t(s); v < split.size(); v += std::size_t(P)) {
      const StageRange& r = split[v];
      text += v == std::size_t(s) ? " " : ", ";
      text += r.layers == 1 ? "layer " + std::to_string(r.first_layer)
                            : "layers " + std::to_string(r.first_layer) + "-" +
                                  std::to_string(r.first_layer + r.layers - 1);
      if (v == 0) text += " + embedding";
      if (v + 1 == split.size()) text += " + head";
      stage_cost += cost[v];
    }
    char relative[32];
    std::snprintf(relative, sizeof relative, " (%.2f)", stage_cost / costs.layer);
    text += relative;
  }
  return text;
}

}  // namespace llmtrain::parallel
