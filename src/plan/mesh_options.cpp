// plan --suggest's search (plan/memory_plan.h: mesh_option, mesh_options, max_micro_batch): every
// mesh of a number of devices, each costed as the trainer would build it.
#include <algorithm>
#include <optional>
#include <vector>

#include "model/arch.h"
#include "parallel/pipeline_schedule.h"
#include "plan/memory_plan.h"

namespace llmtrain::plan {

std::optional<MeshOption> mesh_option(const config::Config& config, const RankShare& share, const dist::Mesh& mesh,
                                      int zero, bool sequence_parallel) {
  const auto& m = config.model;
  const bool bf16 = config.train.precision == config::Precision::bf16;
  const std::int64_t B = config.train.micro_batch_size;
  const int t = mesh.size(dist::Axis::tensor), p = mesh.size(dist::Axis::pipeline), cp = mesh.size(dist::Axis::context);
  const int d = mesh.size(dist::Axis::data) * mesh.size(dist::Axis::expert);  // the ranks that read batches of their own
  const int D = mesh.size(dist::Axis::data) * cp;  // the ranks the gradients are summed over (ZeRO's group)
  if (config.train.global_batch_size % (B * d) != 0) return std::nullopt;
  const std::int64_t micro_steps = config.train.global_batch_size / (B * d);
  // Pipelines as train runs them, every stage as it builds it: it refuses fewer micro-batches
  // than stages (a multiple of them, interleaved), more virtual stages than layers, and ZeRO 3
  // with a pipeline.
  const bool interleaved = config.dist.pipeline_schedule == config::PipelineSchedule::interleaved;
  if (p > 1 && (micro_steps < p || (interleaved && (micro_steps % p != 0 || p * config.dist.virtual_stages > m.n_layer)))) {
    return std::nullopt;
  }
  if (sequence_parallel && (t == 1 || (B * m.context_length) % t != 0)) return std::nullopt;
  if (D == 1 && (zero == 1 || zero == 2)) return std::nullopt;  // the trainer runs them as ZeRO 0
  if (p > 1 && zero == 3) return std::nullopt;
  // Mixture-of-Experts layers: a capacity needs whole sequences (the trainer refuses it with context parallelism).
  if (m.moe.enabled && m.moe.capacity_factor > 0 && cp > 1) return std::nullopt;
  config::Config c = config;
  c.dist.sequence_parallel = sequence_parallel;
  c.dist.tensor_parallel = t;
  c.dist.pipeline_parallel = p;
  c.dist.context_parallel = cp;
  c.dist.expert_parallel = mesh.size(dist::Axis::expert);
  MeshOption o;
  o.mesh = mesh;
  o.zero_stage = zero;
  o.micro_steps = micro_steps;
  o.sequence_parallel = sequence_parallel;
  if (p > 1) {
    c.dist.pipeline_layers.clear();  // the balanced split
    // The stage that needs most memory decides the fit; the one that sends most the traffic.
    for (const StagePlan& st : pipeline_stages(c, t, bf16, micro_steps)) {
      const MemoryPlan mine = stage_memory(c, st, D, zero, bf16);
      o.memory = std::max(o.memory, mine.total());
      o.host = std::max(o.host, plan_host(mine, st.share, D, zero, true).peak());
      const double sent = update_traffic(c, st.share, D, zero, bf16, micro_steps).bytes + st.sent_tensor +
                          st.sent_p2p + st.sent_pipeline_collectives + st.sent_context +
                          expert_traffic(c, st.share, D, zero, bf16, micro_steps).bytes;
      if (sent > o.sent) {
        o.sent = sent;
        o.tensor_sent = st.sent_tensor;
        o.context_sent = st.sent_context;
      }
    }
  } else {
    const MemoryPlan mine = plan_memory(c, share, D, zero, bf16, B);
    o.memory = mine.total();
    o.host = plan_host(mine, share, D, zero, true).peak();
    o.tensor_sent = tensor_traffic(c, t, bf16, micro_steps).bytes;
    o.context_sent = context_traffic(c, t, bf16, micro_steps);
    o.sent = update_traffic(c, share, D, zero, bf16, micro_steps).bytes + o.tensor_sent + o.context_sent +
             expert_traffic(c, share, D, zero, bf16, micro_steps).bytes;
  }
  return o;
}

std::vector<MeshOption> mesh_options(const config::Config& config, int gpus, int* skipped_batch) {
  const auto& m = config.model;
  const std::int64_t B = config.train.micro_batch_size;
  std::vector<MeshOption> options;
  if (skipped_batch) *skipped_batch = 0;
  for (int t = 1; t <= std::min(8, gpus); ++t) {
    // The splits the models make: whole query heads and MLP columns; Llama's key/value heads
    // split too, or each replicated on t / n_kv_head ranks (GPT-2 has as many as query heads).
    const bool kv =
        m.n_kv_head % t == 0 || (model::arch_spec(m.arch).traits().grouped_query_attention && t % m.n_kv_head == 0);
    if (gpus % t != 0 || m.n_head % t != 0 || m.ffn_hidden % t != 0 || !kv) continue;
    const std::vector<RankShare> shares = expert_shares(m, t, gpus);
    // Context parallelism for long sequences only: 2 CP chunks of each.
    for (int cp = 1; cp <= gpus / t; ++cp) {
    if ((gpus / t) % cp != 0 || (cp > 1 && (m.context_length < 8192 || m.context_length % (2 * cp) != 0))) continue;
    for (int p = 1; p <= gpus / (t * cp); ++p) {
      if ((gpus / (t * cp)) % p != 0 || p > m.n_layer) continue;
      const int d = gpus / (t * cp * p);
      if (config.train.global_batch_size % (B * d) != 0) {
        if (skipped_batch) ++*skipped_batch;
        continue;
      }
      for (const RankShare& share : shares) {  // MoE without a pipeline: expert groups out of the data ranks
      const int ep = share.expert_size;
      if (d % ep != 0 || (ep > 1 && cp > 1)) continue;
      for (const bool sequence_parallel : {false, true}) {
        for (int zero = 0; zero <= 3; ++zero) {
          dist::Mesh mesh;
          mesh.sizes[dist::Axis::tensor] = t;
          mesh.sizes[dist::Axis::context] = cp;
          mesh.sizes[dist::Axis::expert] = ep;
          mesh.sizes[dist::Axis::data] = d / ep;
          mesh.sizes[dist::Axis::pipeline] = p;
          if (auto o = mesh_option(config, share, mesh, zero, sequence_parallel)) options.push_back(*o);
        }
      }
      }
    }
    }
  }
  return options;
}

std::int64_t max_micro_batch(const config::Config& config, const MeshOption& option, std::int64_t memory,
                             std::int64_t host_per_rank) {
  const RankShare share = rank_share(config.model, option.mesh.size(dist::Axis::tensor), -1,
                                     option.mesh.size(dist::Axis::expert));
  const std::int64_t per_rank =
      config.train.global_batch_size / (option.mesh.size(dist::Axis::data) * option.mesh.size(dist::Axis::expert));
  config::Config c = config;
  for (std::int64_t B = per_rank; B >= 1; --B) {
    if (per_rank % B != 0) continue;
    c.train.micro_batch_size = B;
    const auto o = mesh_option(c, share, option.mesh, option.zero_stage, option.sequence_parallel);
    if (o && o->memory <= memory && (host_per_rank <= 0 || o->host <= host_per_rank)) return B;
  }
  return 0;
}


}  // namespace llmtrain::plan
