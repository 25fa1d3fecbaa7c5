#include "train/plan.h"

#include <algorithm>

#include "model/arch.h"

namespace llmtrain::train {
namespace {

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

}  // namespace

std::int64_t parameter_count(const config::ModelConfig& m) { return model::arch_spec(m.arch).parameter_count(m); }

std::vector<ShardUnit> shard_units(const config::ModelConfig& m) {
  const std::int64_t C = m.d_model, F = m.ffn_hidden, V = m.vocab_size;
  std::int64_t before = 0, layer = 0, after = 0;
  if (m.arch == config::Arch::gpt2) {
    before = 2 * C;  // ln_f weight and bias
    // ln_1 and ln_2 (2 C each), c_attn (3C x C + 3C), attn.c_proj (C x C + C), c_fc (F x C + F),
    // mlp.c_proj (C x F + C).
    layer = 4 * C + (3 * C * C + 3 * C) + (C * C + C) + (F * C + F) + (C * F + C);
    after = m.context_length * C + V * C;  // wpe, wte (also the head)
  } else {
    const std::int64_t HS = C / m.n_head;
    before = (m.tie_embeddings ? 0 : V * C) + C;  // lm_head when untied, the final norm
    // Two norms, q/k/v ((NH + 2 NKV) HS x C), o (C x NH HS), gate, up and down (F x C each).
    layer = 2 * C + (m.n_head + 2 * m.n_kv_head) * HS * C + C * m.n_head * HS + 3 * F * C;
    after = V * C;  // the token embedding
  }
  std::vector<ShardUnit> units{{before, false}};
  for (std::int64_t l = 0; l < m.n_layer; ++l) units.push_back({layer, true});
  units.push_back({after, false});
  return units;
}

double flops_per_token(const config::ModelConfig& m) {
  const double head_size = double(m.d_model) / double(m.n_head);
  return 6.0 * double(parameter_count(m)) +
         12.0 * double(m.n_layer) * double(m.n_head) * head_size * double(m.context_length);
}

std::int64_t activation_bytes_per_sequence(const config::ModelConfig& m, bool bf16, config::Recompute recompute) {
  const DType compute = bf16 ? DType::bf16 : DType::f32;
  return std::int64_t(model::arch_spec(m.arch).activation_bytes(m, recompute, compute, 1, int(m.context_length)));
}

MemoryPlan plan_memory(const config::Config& config, int data_parallel_size, int zero_stage, bool bf16,
                       std::int64_t micro_batch) {
  const std::int64_t P = parameter_count(config.model), D = data_parallel_size;
  MemoryPlan plan;
  plan.activations = micro_batch * activation_bytes_per_sequence(config.model, bf16, config.train.recompute);
  if (zero_stage == 3) {
    // The buffers train/zero3.cpp allocates: every unit sharded with padding (a rank's shards of
    // the master weights and gradients); the root units gathered (padded) for the whole step with
    // f32 gradient buffers of the same length; weight slots of the padded layer size in the
    // compute dtype; two gradient slots, each the padded layer in f32 plus its reduce-scattered
    // part; a scratch part of the largest unit.
    std::int64_t shards = 0, root = 0, layer_shard = 0, largest_shard = 0, layers = 0;
    for (const auto& u : shard_units(config.model)) {
      const std::int64_t shard = ceil_div(u.params, D);
      shards += shard;
      largest_shard = std::max(largest_shard, shard);
      if (u.layer) {
        layer_shard = std::max(layer_shard, shard);
        ++layers;
      } else {
        root += D * shard;
      }
    }
    const std::int64_t compute = bf16 ? 2 : 4;
    const std::int64_t weight_slots = config.dist.reshard_after_forward ? std::min<std::int64_t>(2, layers) : layers;
    const std::int64_t gradient_slots = std::min<std::int64_t>(2, layers);
    plan.weights = 4 * shards;
    plan.gradients = 4 * shards;
    plan.optimizer = 8 * shards;
    plan.gathered = compute * (root + weight_slots * D * layer_shard) +
                    4 * (root + gradient_slots * (D + 1) * layer_shard + largest_shard);
    return plan;
  }
  const std::int64_t shard = ceil_div(P, D);
  // Every rank keeps the f32 master weights (and, in bf16, a 2-byte working copy) and f32
  // gradients; ZeRO 1 shards AdamW's m and v, ZeRO 2 the gradients too.
  plan.weights = (bf16 ? 4 + 2 : 4) * P;
  plan.gradients = 4 * (zero_stage >= 2 ? shard : P);
  plan.optimizer = 8 * (zero_stage >= 1 ? shard : P);
  return plan;
}

UpdateTraffic update_traffic(const config::Config& config, int data_parallel_size, int zero_stage, bool bf16,
                             std::int64_t micro_steps) {
  const std::int64_t D = data_parallel_size;
  UpdateTraffic t;
  if (D <= 1) return t;
  const std::int64_t P = parameter_count(config.model);
  // A ring all-gather or reduce-scatter of a buffer padded to D ceil(n / D) elements of `bytes`
  // each sends (D - 1) / D of it: (D - 1) ceil(n / D) elements.
  const auto gather_or_scatter = [D](std::int64_t n, std::int64_t bytes) { return (D - 1) * ceil_div(n, D) * bytes; };
  if (zero_stage == 0) {
    t.all_reduces = 1;
    t.bytes = 2.0 * double(D - 1) / double(D) * 4.0 * double(P);
    return t;
  }
  if (zero_stage <= 2) {
    t.reduce_scatters = 1;
    t.all_gathers = 1;
    t.bytes = double(2 * gather_or_scatter(P, 4));
    return t;
  }
  const std::int64_t compute = bf16 ? 2 : 4;
  const std::int64_t gathers_per_layer = config.dist.reshard_after_forward ? 2 : 1;
  std::int64_t per_micro_step = 0, per_update = 0;
  for (const auto& u : shard_units(config.model)) {
    if (u.layer) {
      t.all_gathers += gathers_per_layer * micro_steps;
      per_micro_step += gathers_per_layer * gather_or_scatter(u.params, compute);
    } else {
      ++t.all_gathers;
      per_update += gather_or_scatter(u.params, compute);
    }
    t.reduce_scatters += micro_steps;
    per_micro_step += gather_or_scatter(u.params, 4);
  }
  t.bytes = double(micro_steps * per_micro_step + per_update);
  return t;
}

std::vector<MeshOption> mesh_options(const config::Config& config, int gpus, int* skipped_batch) {
  const auto& m = config.model;
  const bool bf16 = config.train.precision == config::Precision::bf16;
  const std::int64_t B = config.train.micro_batch_size;
  // One micro-batch's activations at a layer boundary, in the compute dtype.
  const double boundary = double(B) * double(m.context_length) * double(m.d_model) * (bf16 ? 2.0 : 4.0);
  std::vector<MeshOption> options;
  if (skipped_batch) *skipped_batch = 0;
  for (int t = 1; t <= std::min(8, gpus); ++t) {
    if (gpus % t != 0 || m.n_head % t != 0 || m.n_kv_head % t != 0) continue;
    for (int p = 1; p <= gpus / t; ++p) {
      if ((gpus / t) % p != 0 || p > m.n_layer) continue;
      const int d = gpus / (t * p);
      if (config.train.global_batch_size % (B * d) != 0) {
        if (skipped_batch) ++*skipped_batch;
        continue;
      }
      const std::int64_t micro_steps = config.train.global_batch_size / (B * d);
      const std::int64_t stage_layers = ceil_div(m.n_layer, p);
      for (int zero = 0; zero <= 3; ++zero) {
        if (d == 1 && (zero == 1 || zero == 2)) continue;  // nothing to shard: the same as ZeRO 0
        const MemoryPlan plan = plan_memory(config, d, zero, bf16, B);
        MeshOption o;
        o.mesh = dist::Mesh{t, d, p};
        o.zero_stage = zero;
        o.micro_steps = micro_steps;
        o.estimate = t * p > 1;
        const std::int64_t parameters = plan.weights + plan.gradients + plan.optimizer + plan.gathered;
        const double activations = p == 1 ? double(plan.activations) / t
                                          : double(plan.activations) / t * double(stage_layers) / double(m.n_layer) *
                                                double(std::min<std::int64_t>(p, micro_steps));
        o.memory = parameters / (t * p) + std::int64_t(activations);
        o.sent = update_traffic(config, d, zero, bf16, micro_steps).bytes / double(t * p);
        if (t > 1) o.sent += 4.0 * 2.0 * double(t - 1) / double(t) * boundary * double(stage_layers) * double(micro_steps);
        if (p > 1) o.sent += (p > 2 ? 2.0 : 1.0) * boundary * double(micro_steps);
        options.push_back(o);
      }
    }
  }
  return options;
}

}  // namespace llmtrain::train
