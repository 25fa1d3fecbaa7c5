// plan's figures for expert parallelism (plan/memory_plan.h: expert_traffic).
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "model/moe_layer.h"
#include "parallel/expert_parallel_comm.h"
#include "plan/memory_plan.h"

namespace llmtrain::plan {
namespace {

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// The flat ranges whose gradients data rank 0 updates: the whole buffer (ZeRO 0, and 1-2 on one
// data rank), its shard (ZeRO 1-2), or its shard of each unit (ZeRO 3), as the trainer's pieces.
std::vector<model::FlatRange> rank0_pieces(const RankShare& share, std::int64_t D, int zero_stage) {
  if (zero_stage == 3) {
    std::vector<model::FlatRange> out;
    for (const ShardUnit& u : share.units) out.push_back({u.begin, u.begin + std::min(u.params, ceil_div(u.params, D))});
    return out;
  }
  if (zero_stage == 0 || D == 1) return {{0, share.params}};
  return {{0, std::min(share.params, ceil_div(share.params, D))}};
}

}  // namespace

std::int64_t moe_layers_held(const RankShare& share) {
  std::vector<int> layers;
  for (const model::ParamInfo& info : share.infos) {
    if (info.name.find(".mlp.experts.") == std::string::npos) continue;
    if (std::find(layers.begin(), layers.end(), info.layer) == layers.end()) layers.push_back(info.layer);
  }
  return std::int64_t(layers.size());
}

std::int64_t expert_activation_bytes(const config::ModelConfig& m, bool bf16, config::Recompute recompute,
                                     std::int64_t micro_batch, int context_size, int expert_size,
                                     std::int64_t moe_layers, std::int64_t slots) {
  if (expert_size <= 1 || !m.moe.enabled) return 0;
  const DType compute = bf16 ? DType::bf16 : DType::f32;
  const std::int64_t rows = model::moe_kept_slots(m.moe, micro_batch * (m.context_length / context_size));
  // Recompute "full" keeps no layer's rows: its layers share one store, which each runs again.
  const std::int64_t stores = recompute == config::Recompute::full ? std::min<std::int64_t>(moe_layers, 1) : moe_layers;
  return slots * stores * std::int64_t(model::expert_rows_bytes(m, rows, compute)) +
         std::int64_t(model::expert_scratch_bytes(m, rows, compute));
}

UpdateTraffic expert_traffic(const config::Config& config, const RankShare& share, int data_parallel_size,
                             int zero_stage, bool bf16, std::int64_t micro_steps) {
  UpdateTraffic t;
  const std::int64_t EP = share.expert_size;
  const auto& m = config.model;
  if (EP <= 1 || !m.moe.enabled) return t;
  const double others = double(EP - 1) / double(EP), ring = 2.0 * others;
  // This share's MoE layers exchange rows; every rank sums every layer's loads.
  const std::int64_t layers = moe_layers_held(share), all_layers = m.n_layer - m.moe.first_dense_layers;
  const std::int64_t E = m.moe.experts;
  // A rank's tokens: its part of each sequence under context parallelism.
  const std::int64_t N = config.train.micro_batch_size * (m.context_length / config.dist.context_parallel);
  const std::int64_t capacity = model::moe_capacity(m.moe, N);
  const std::int64_t M = capacity > 0 ? std::min(N * m.moe.top_k, E * capacity) : N * m.moe.top_k;
  const double row = double(m.d_model) * (bf16 ? 2.0 : 4.0);
  // Recompute "full" runs each layer's forward exchange again in backward (counts and rows both ways).
  const bool full = config.train.recompute == config::Recompute::full;
  t.all_to_alls = micro_steps * layers * (full ? 8 : 5);
  t.bytes += double(micro_steps * layers) * ((full ? 6.0 : 4.0) * double(M) * others * row +
                                             (full ? 2.0 : 1.0) * double((EP - 1) * (E / EP)) * 4.0);
  // The shared gradients, run by run as sum_shared_grads calls them, then the update's scalars.
  double shared = 0;
  for (const model::FlatRange& piece : rank0_pieces(share, data_parallel_size, zero_stage)) {
    for (const model::FlatRange& run : parallel::expert_shared_ranges(share.infos)) {
      const std::int64_t lo = std::max(run.begin, piece.begin), hi = std::min(run.end, piece.end);
      if (lo >= hi) continue;
      ++t.all_reduces;
      shared += double(hi - lo);
    }
  }
  t.all_reduces += 5;
  t.bytes += ring * (4.0 * shared + 8.0 + 8.0 + 4.0 * 8.0 + 4.0 + 8.0 * double(all_layers * E));
  return t;
}

std::vector<RankShare> expert_shares(const config::ModelConfig& model, int tensor_size, int gpus) {
  std::vector<RankShare> out{rank_share(model, tensor_size)};
  if (!model.moe.enabled) return out;
  for (int ep = 2; ep <= gpus && ep <= model.moe.experts; ++ep) {
    if (model.moe.experts % ep == 0 && gpus % ep == 0) out.push_back(rank_share(model, tensor_size, -1, ep));
  }
  return out;
}

}  // namespace llmtrain::plan
