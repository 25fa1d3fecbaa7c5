#include "plan/memory_plan.h"

#include <algorithm>
#include <numeric>
#include <optional>

#include <stdexcept>

#include "checkpoint/safetensors.h"
#include "model/arch.h"
#include "model/model.h"
#include "optim/muon.h"
#include "optim/registry.h"
#include "parallel/context_attention.h"
#include "parallel/expert_parallel_comm.h"
#include "parallel/pipeline_schedule.h"
#include "parallel/pipeline_stages.h"
#include "parallel/tensor_parallel.h"
#include "parallel/zero3_slots.h"

namespace llmtrain::plan {
namespace {

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// ZeRO 3's slots for the share's units over D data ranks, as parallel/zero3.cpp lays them out.
parallel::Zero3SlotLayout zero3_slots(const config::Config& config, const RankShare& share, std::int64_t D) {
  std::vector<parallel::Zero3Unit> units;
  for (const auto& u : share.units) units.push_back({ceil_div(u.params, D), u.layer, u.embedding, u.head});
  return parallel::zero3_slot_layout(units, int(D), config.dist.reshard_after_forward);
}

// What `model` (built for tensor rank `tensor_rank` of `tensor_size`) holds: its parameters, ZeRO
// 3's units and, without tensor parallelism, Muon's matrices.
RankShare share_of_model(const model::Model& model, int tensor_size, int tensor_rank) {
  RankShare share;
  share.tensor_size = tensor_size;
  share.tensor_rank = tensor_rank;
  share.params = model.num_params();
  const auto embedding = model.end_runs(model::ModelEnd::embedding), head = model.end_runs(model::ModelEnd::head);
  const auto& runs = model.param_runs();
  for (std::size_t r = 0; r < runs.size(); ++r) {
    const auto reads = [r](const std::vector<std::size_t>& v) { return std::find(v.begin(), v.end(), r) != v.end(); };
    share.units.push_back({runs[r].size(), runs[r].layer >= 0, runs[r].begin, reads(embedding), reads(head)});
  }
  share.infos = model.param_infos();
  if (tensor_size == 1) {
    for (const optim::MuonMatrix& mat : optim::muon_matrices(model.param_infos())) {
      share.muon_matrices.push_back({mat.offset, mat.offset + mat.numel()});
    }
  }
  return share;
}

// The share of one tensor rank: the model's own parameter list, built with external storage (no
// buffers). ZeRO 3 shards each parameter run as one unit (parallel/zero3.h).
RankShare share_of(const config::ModelConfig& m, int tensor_size, int tensor_rank, int expert_size) {
  parallel::TensorParallel widths(tensor_rank, tensor_size, false, m, Device::cpu, DType::f32);
  parallel::ExpertParallel experts(0, expert_size);
  model::Layout layout{true, &widths};
  if (expert_size > 1) layout.experts = &experts;
  const auto model = model::make_model(m, Device::cpu, config::Recompute::none, DType::f32,
                                       ops::AttentionKernels::flash, layout);
  RankShare share = share_of_model(*model, tensor_size, tensor_rank);
  share.expert_size = expert_size;
  return share;
}

// The tensor rank with the most vocabulary rows ([V r / t, V (r + 1) / t)); the first of those.
int most_rows_rank(const config::ModelConfig& m, int tensor_size) {
  int most = 0;
  std::int64_t rows = -1;
  for (int r = 0; r < tensor_size; ++r) {
    const std::int64_t mine = m.vocab_size * (r + 1) / tensor_size - m.vocab_size * r / tensor_size;
    if (mine > rows) {
      rows = mine;
      most = r;
    }
  }
  return most;
}

// The tensor group's collectives per micro-step for a stage of `layers` layers (all of them
// without pipelines), `moe_layers` of them Mixture-of-Experts layers, with the embedding and/or the
// head; see tensor_traffic. A MoE layer's experts run whole on every tensor rank: its MLP has no
// row-parallel output to sum (with sequence parallelism its input is gathered once, kept for
// backward, and its output gradient gathered; each rank keeps its rows of the results).
UpdateTraffic tensor_micro_step(const config::Config& c, int tensor_size, bool bf16, std::int64_t layers,
                                std::int64_t moe_layers, bool embedding = true, bool head = true) {
  UpdateTraffic t;
  if (tensor_size <= 1) return t;
  const auto& m = c.model;
  const double N = double(c.train.micro_batch_size * m.context_length), C = double(m.d_model);
  const bool full = c.train.recompute == config::Recompute::full, mlp = c.train.recompute == config::Recompute::mlp;
  const double ring = 2.0 * double(tensor_size - 1) / double(tensor_size), share = double(tensor_size - 1) / tensor_size;
  const std::int64_t ends = (embedding ? 1 : 0) + (head ? 1 : 0);
  double all_reduced = head ? 3 * N : 0;  // f32 values: the cross-entropy's row maxima and sums
  t.all_reduces = head ? 2 : 0;
  if (!c.dist.sequence_parallel) {
    // the embedding, the layers, the head's input gradient
    const std::int64_t sums = ends + (full ? 6 : 4) * layers - (full ? 3 : 2) * moe_layers;
    t.all_reduces += sums;
    all_reduced += double(sums) * N * C;
  } else {
    // A MoE layer's recompute "mlp" reads its kept gathered input.
    t.all_gathers = (6 + (full ? 2 : mlp ? 1 : 0)) * layers - (mlp ? 2 : 1) * moe_layers + ends;
    t.reduce_scatters = (4 + (full ? 2 : 0)) * layers - (full ? 3 : 2) * moe_layers + ends;
    const std::int64_t norms = 2 * layers + (head ? 1 : 0);
    t.all_reduces += norms;
    // a norm's weight (and bias)
    all_reduced += double(norms) * (config::norm_params_per_channel(model::arch_spec(m.arch).traits()) * C);
    t.bytes += share * N * C * (double(t.all_gathers) * (bf16 ? 2.0 : 4.0) + double(t.reduce_scatters) * 4.0);
  }
  if (model::arch_spec(m.arch).traits().grouped_query_attention && m.n_kv_head % tensor_size != 0) {
    // Replicated key/value heads: each layer's k and v gradients, one slot per head.
    t.all_reduces += layers;
    all_reduced += double(layers) * double(m.n_kv_head) * 2.0 * double(m.d_model / m.n_head) * C;
  }
  t.bytes += ring * 4.0 * all_reduced;
  return t;
}

}  // namespace

std::int64_t parameter_count(const config::ModelConfig& m) { return model::arch_spec(m.arch).parameter_count(m); }

RankShare rank_share(const config::ModelConfig& m, int tensor_size, int tensor_rank, int expert_size) {
  if (tensor_rank >= 0) return share_of(m, tensor_size, tensor_rank, expert_size);
  // Only the vocabulary rows differ between ranks: the rank with the most of them holds the most.
  return share_of(m, tensor_size, most_rows_rank(m, tensor_size), expert_size);
}

std::vector<ShardUnit> shard_units(const config::ModelConfig& m) { return rank_share(m, 1, 0).units; }

std::int64_t active_parameter_count(const config::ModelConfig& m) {
  if (!m.moe.enabled) return parameter_count(m);
  // Each token runs k of the E routed experts of each MoE layer (three (I, C) matrices each).
  const std::int64_t idle = (m.n_layer - m.moe.first_dense_layers) * (m.moe.experts - m.moe.top_k) * 3 *
                            m.moe.ffn_hidden * m.d_model;
  return parameter_count(m) - idle;
}

double flops_per_token(const config::ModelConfig& m) {
  const double head_size = double(m.d_model) / double(m.n_head);
  return 6.0 * double(active_parameter_count(m)) +
         12.0 * double(m.n_layer) * double(m.n_head) * head_size * double(m.context_length);
}

std::int64_t activation_bytes(const config::ModelConfig& m, bool bf16, config::Recompute recompute,
                              std::int64_t micro_batch, int tensor_size, bool sequence_parallel, int context_size,
                              int expert_size) {
  const DType compute = bf16 ? DType::bf16 : DType::f32;
  model::ActsShape shape{tensor_size, sequence_parallel && tensor_size > 1};
  shape.expert_parts = expert_size;
  std::int64_t bytes = std::int64_t(model::arch_spec(m.arch).activation_bytes(
      m, recompute, compute, int(micro_batch), int(m.context_length / context_size), shape));
  // The rows each MoE layer's experts receive.
  return bytes + expert_activation_bytes(m, bf16, recompute, micro_batch, context_size, expert_size,
                                         m.moe.enabled ? m.n_layer - m.moe.first_dense_layers : 0);
}

namespace {
// What each layer's attention call has on a rank of a tensor group of `tensor_size`, as the model
// lays it out (its heads and the memory it lends a view that splits the sequences).
model::AttentionRoom attention_room(const config::Config& config, int tensor_size, DType compute,
                                    std::int64_t micro_batch) {
  const auto& m = config.model;
  return model::arch_spec(m.arch).attention_room(
      m, config.train.recompute, compute, int(micro_batch), int(m.context_length / config.dist.context_parallel),
      model::ActsShape{tensor_size, config.dist.sequence_parallel && tensor_size > 1});
}
}  // namespace

std::int64_t context_scratch_bytes(const config::Config& config, int tensor_size, bool bf16, std::int64_t micro_batch) {
  const std::int64_t cp = config.dist.context_parallel;
  if (cp <= 1) return 0;
  const DType compute = bf16 ? DType::bf16 : DType::f32;
  return std::int64_t(parallel::ContextAttention::own_work_bytes(
      attention_room(config, tensor_size, compute, micro_batch), int(cp),
      config.dist.context_parallel_mode == config::ContextParallelMode::ring, compute));
}

double context_layer_bytes(const config::Config& config, int tensor_size, bool bf16, bool backward) {
  const int cp = int(config.dist.context_parallel);
  if (cp <= 1) return 0;
  const DType compute = bf16 ? DType::bf16 : DType::f32;
  return parallel::ContextAttention::sent_bytes(attention_room(config, tensor_size, compute, config.train.micro_batch_size),
                                                cp, dtype_size(compute), backward);
}

double context_traffic(const config::Config& config, int tensor_size, bool bf16, std::int64_t micro_steps,
                       std::int64_t layers, std::int64_t moe_layers) {
  const auto& m = config.model;
  if (layers < 0) layers = m.n_layer;
  if (moe_layers < 0) moe_layers = m.moe.enabled ? m.n_layer - m.moe.first_dense_layers : 0;
  const double forward = context_layer_bytes(config, tensor_size, bf16, false);
  const double per_layer = forward * (config.train.recompute == config::Recompute::full ? 2.0 : 1.0) +
                           context_layer_bytes(config, tensor_size, bf16, true);
  // A MoE layer's router statistics, all-reduced in forward (again with recompute "full"): E counts,
  // E mean probabilities, the z-loss and the dropped fraction, doubles.
  const double cp = double(config.dist.context_parallel);
  const double router = cp > 1 ? (config.train.recompute == config::Recompute::full ? 2.0 : 1.0) * 2.0 *
                                     (cp - 1.0) / cp * 8.0 * double(2 * m.moe.experts + 2)
                               : 0.0;
  return double(micro_steps) * (double(layers) * per_layer + double(moe_layers) * router);
}

std::int64_t activation_bytes_per_sequence(const config::ModelConfig& m, bool bf16, config::Recompute recompute,
                                           int tensor_size) {
  return activation_bytes(m, bf16, recompute, 1, tensor_size);
}

namespace {

// The optimizer's state of the data rank that needs the most, as optim.name's optimizer counts it
// per element of each parameter (none is allocated). A rank holds, of the flat buffer: ZeRO 3,
// ceil(n / D) of each unit from r ceil(n / D) on (parallel/zero3.cpp); ZeRO 1-2, [r S, (r + 1) S)
// with S = ceil(P / D); ZeRO 0 (or one data rank), all of it.
std::int64_t optimizer_bytes(const config::OptimConfig& optim, const RankShare& share, std::int64_t D, int zero_stage) {
  std::vector<model::ParamInfo> infos = share.infos;
  std::sort(infos.begin(), infos.end(), [](const auto& a, const auto& b) { return a.offset < b.offset; });
  std::vector<std::int64_t> begins, each, before{0};  // before[i]: bytes of the parameters before infos[i]
  for (const model::ParamInfo& info : infos) {
    begins.push_back(info.offset);
    each.push_back(optim::state_bytes_of(optim, info));
    before.push_back(before.back() + info.numel * each.back());
  }
  const auto below = [&](std::int64_t x) {  // bytes of the flat elements before x
    const auto i = std::size_t(std::upper_bound(begins.begin(), begins.end(), x) - begins.begin());
    return i == 0 ? 0 : before[i - 1] + std::min(x - begins[i - 1], infos[i - 1].numel) * each[i - 1];
  };
  const std::int64_t ranks = zero_stage == 0 || D <= 1 ? 1 : D, shard = ceil_div(share.params, ranks);
  std::int64_t most = 0;
  for (std::int64_t r = 0; r < ranks; ++r) {
    std::int64_t bytes = below(std::min(share.params, (r + 1) * shard)) - below(std::min(share.params, r * shard));
    if (zero_stage == 3) {
      bytes = 0;
      for (const auto& u : share.units) {
        const std::int64_t part = ceil_div(u.params, D), end = u.begin + u.params, lo = std::min(end, u.begin + r * part);
        bytes += below(std::min(end, lo + part)) - below(lo);
      }
    }
    most = std::max(most, bytes);
  }
  return most;
}

}  // namespace

MemoryPlan plan_memory(const config::Config& config, const RankShare& share, int data_parallel_size, int zero_stage,
                       bool bf16, std::int64_t micro_batch) {
  const std::int64_t P = share.params, D = data_parallel_size;
  MemoryPlan plan;
  plan.optimizer_arrays = optim::state_arrays(config.optim);
  plan.activations = activation_bytes(config.model, bf16, config.train.recompute, micro_batch, share.tensor_size,
                                      config.dist.sequence_parallel, int(config.dist.context_parallel),
                                      share.expert_size) +
                     context_scratch_bytes(config, share.tensor_size, bf16, micro_batch);
  if (zero_stage == 3) {
    // The buffers parallel/zero3.cpp allocates: every unit sharded with padding (a rank's shards of
    // the master weights and gradients), and the slots of parallel/zero3_slots.h: weights in the
    // compute dtype, f32 gradients each with its reduce-scattered part.
    std::int64_t shards = 0;
    for (const auto& u : share.units) shards += ceil_div(u.params, D);
    const auto slots = zero3_slots(config, share, D);
    std::int64_t weight_slots = 0, grad_slots = 0;
    for (const auto& slot : slots.weights) weight_slots += slot.capacity;
    for (const auto& slot : slots.grads) grad_slots += slot.capacity + (D > 1 ? slot.capacity / D : 0);
    const std::int64_t compute = bf16 ? 2 : 4;
    plan.weights = 4 * shards;
    plan.gradients = 4 * shards;
    plan.optimizer = optimizer_bytes(config.optim, share, D, 3);
    plan.gathered = compute * weight_slots + 4 * grad_slots;
    return plan;
  }
  // The model's flat buffers: f32 master weights (and, in bf16, a 2-byte working copy) and f32
  // gradients, whole. ZeRO 1 and 2 over more than one rank (parallel/grad_sync.cpp): the optimizer
  // state of this rank's shard, a buffer of the padded gradients and the shard they sum into.
  const bool sharded = zero_stage >= 1 && D > 1;
  const std::int64_t shard = ceil_div(P, D);
  plan.weights = (bf16 ? 4 + 2 : 4) * P;
  plan.gradients = 4 * P;
  plan.optimizer = optimizer_bytes(config.optim, share, D, sharded ? zero_stage : 0);
  plan.gathered = sharded ? 4 * (D * shard + shard) : 0;
  return plan;
}

MemoryPlan plan_memory(const config::Config& config, int data_parallel_size, int zero_stage, bool bf16,
                       std::int64_t micro_batch) {
  return plan_memory(config, rank_share(config.model), data_parallel_size, zero_stage, bf16, micro_batch);
}

std::int64_t host_chunk_bytes() { return std::int64_t(checkpoint::default_write_chunk); }

std::int64_t owned_params(const RankShare& share, int data_parallel_size, int zero_stage) {
  const std::int64_t D = std::max(data_parallel_size, 1);
  if (zero_stage != 3) return ceil_div(share.params, D);
  std::int64_t shards = 0;
  for (const auto& u : share.units) shards += ceil_div(u.params, D);
  return shards;
}

HostPlan plan_host(const MemoryPlan& device, const RankShare& share, int data_parallel_size, int zero_stage, bool gpu) {
  HostPlan host;
  host.process = gpu ? gpu_process_bytes : cpu_process_bytes;
  host.chunk = host_chunk_bytes();
  // What it writes: f32 weights and the optimizer's state of the parameters it owns.
  host.staging = 4 * (1 + device.optimizer_arrays) * owned_params(share, data_parallel_size, zero_stage);
  if (!gpu) {  // the CPU backend's "device" is the host
    host.state = device.state();
    host.activations = device.activations;
  }
  return host;
}

std::int64_t max_micro_batch(const config::Config& config, bool bf16, int tensor_size, std::int64_t state,
                             std::int64_t memory) {
  const bool sequence_parallel = config.dist.sequence_parallel && tensor_size > 1;
  const auto fits = [&](std::int64_t B) {
    return state +
               activation_bytes(config.model, bf16, config.train.recompute, B, tensor_size, sequence_parallel,
                                int(config.dist.context_parallel), int(config.dist.expert_parallel)) +
               context_scratch_bytes(config, tensor_size, bf16, B) <=
           memory;
  };
  // Sequence parallelism: B context_length a multiple of the tensor size, B a multiple of `step`.
  const std::int64_t step = sequence_parallel ? tensor_size / std::gcd(config.model.context_length,
                                                                       std::int64_t(tensor_size))
                                              : 1;
  if (!fits(1)) return 0;
  // Double until it does not fit, then halve the gap (the activations grow with B).
  std::int64_t good = 1, bad = 2;
  constexpr std::int64_t most = std::int64_t(1) << 30;
  while (bad <= most && fits(bad)) {
    good = bad;
    bad *= 2;
  }
  while (bad <= most && bad - good > 1) {
    const std::int64_t mid = good + (bad - good) / 2;
    (fits(mid) ? good : bad) = mid;
  }
  return good / step * step;
}

UpdateTraffic muon_traffic(const config::Config& config, const RankShare& share, int data_parallel_size,
                           int zero_stage, int data_rank) {
  const std::int64_t D = data_parallel_size;
  UpdateTraffic t;
  if (config.optim.name != optim::Muon::name || D <= 1 || zero_stage < 1) return t;
  // Each rank's pieces of the flat buffer, as ZeRO lays them out (parallel/grad_sync.cpp, zero3.cpp).
  std::vector<std::vector<model::FlatRange>> pieces(static_cast<std::size_t>(D));
  for (std::int64_t r = 0; r < D; ++r) {
    const auto add = [&](std::int64_t begin, std::int64_t n) {
      const std::int64_t shard = ceil_div(n, D), lo = std::min(begin + n, begin + r * shard);
      const std::int64_t hi = std::min(begin + n, lo + shard);
      if (hi > lo) pieces[std::size_t(r)].push_back({lo, hi});
    };
    if (zero_stage == 3) {
      for (const auto& u : share.units) add(u.begin, u.params);
    } else {
      add(0, share.params);
    }
  }
  for (std::size_t j = 0; j < share.muon_matrices.size(); ++j) {
    const model::FlatRange& mat = share.muon_matrices[j];
    const std::int64_t owner = std::int64_t(j) % D;
    for (std::int64_t r = 0; r < D; ++r) {
      // A part of rank r's: to the owner (r == data_rank), or back from the owner (data_rank).
      if (r == owner || (data_rank != r && data_rank != owner)) continue;
      for (const model::FlatRange& piece : pieces[std::size_t(r)]) {
        const std::int64_t n = std::min(mat.end, piece.end) - std::max(mat.begin, piece.begin);
        if (n <= 0) continue;
        ++t.sends;
        t.bytes += 4.0 * double(n);
      }
    }
  }
  return t;
}

UpdateTraffic update_traffic(const config::Config& config, const RankShare& share, int data_parallel_size,
                             int zero_stage, bool bf16, std::int64_t micro_steps) {
  const std::int64_t D = data_parallel_size;
  UpdateTraffic t;
  if (D <= 1) return t;
  UpdateTraffic muon;  // the data rank that sends most
  for (int r = 0; r < D; ++r) {
    const UpdateTraffic mine = muon_traffic(config, share, int(D), zero_stage, r);
    if (mine.bytes > muon.bytes) muon = mine;
  }
  t.sends = muon.sends;
  const std::int64_t P = share.params;
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
    t.bytes = double(2 * gather_or_scatter(P, 4)) + muon.bytes;
    return t;
  }
  const std::int64_t compute = bf16 ? 2 : 4;
  const std::int64_t gathers_per_layer = config.dist.reshard_after_forward ? 2 : 1;
  // Whether the units outside the layers keep slots of their own (parallel/zero3_slots.h).
  const auto slots = zero3_slots(config, share, D);
  const bool ends_stay_gathered = !slots.weight_home.empty(), ends_keep_gradients = !slots.grad_home.empty();
  std::int64_t per_micro_step = 0, per_update = 0, first_layer = 0;
  for (const auto& u : share.units) {
    if (u.layer) {  // two gathers a micro-step when resharded after forward, one reduce-scatter
      first_layer = u.params;  // the buffer holds the layers last first
      t.all_gathers += gathers_per_layer * micro_steps;
      t.reduce_scatters += micro_steps;
      per_micro_step += gathers_per_layer * gather_or_scatter(u.params, compute) + gather_or_scatter(u.params, 4);
      continue;
    }
    // A unit outside the layers: gathered once per update when it keeps its slot, else once per
    // micro-step for each end that reads it; reduced once per micro-step when it keeps its
    // gradient slot, else once for each end.
    const std::int64_t uses = std::int64_t(u.embedding) + std::int64_t(u.head);
    if (ends_stay_gathered) {
      t.all_gathers += 1;
      per_update += gather_or_scatter(u.params, compute);
    } else {
      t.all_gathers += uses * micro_steps;
      per_micro_step += uses * gather_or_scatter(u.params, compute);
    }
    const std::int64_t reductions = ends_keep_gradients ? 1 : uses;
    t.reduce_scatters += reductions * micro_steps;
    per_micro_step += reductions * gather_or_scatter(u.params, 4);
  }
  // The first layer stays gathered from one micro-step's backward to the next one's forward.
  const std::int64_t kept = first_layer > 0 ? micro_steps - 1 : 0;
  t.all_gathers -= kept;
  t.bytes = double(micro_steps * per_micro_step + per_update - kept * gather_or_scatter(first_layer, compute)) +
            muon.bytes;
  return t;
}

UpdateTraffic update_traffic(const config::Config& config, int data_parallel_size, int zero_stage, bool bf16,
                             std::int64_t micro_steps) {
  return update_traffic(config, rank_share(config.model), data_parallel_size, zero_stage, bf16, micro_steps);
}

UpdateTraffic tensor_traffic(const config::Config& config, int tensor_size, bool bf16, std::int64_t micro_steps) {
  const auto& m = config.model;
  UpdateTraffic t =
      tensor_micro_step(config, tensor_size, bf16, m.n_layer, m.moe.enabled ? m.n_layer - m.moe.first_dense_layers : 0);
  if (tensor_size <= 1) return t;
  // micro_steps of them, and the gradient norm's double once.
  t.all_reduces = micro_steps * t.all_reduces + 1;
  t.all_gathers *= micro_steps;
  t.reduce_scatters *= micro_steps;
  t.bytes = double(micro_steps) * t.bytes + 2.0 * double(tensor_size - 1) / double(tensor_size) * 8.0;
  return t;
}

std::vector<StagePlan> pipeline_stages(const config::Config& config, int tensor_size, bool bf16,
                                       std::int64_t micro_batches, int tensor_rank) {
  const auto& m = config.model;
  const int P = int(config.dist.pipeline_parallel);
  const int r = tensor_rank >= 0 ? tensor_rank : most_rows_rank(m, tensor_size);
  const bool sp = config.dist.sequence_parallel && tensor_size > 1;
  const std::vector<parallel::StageRange> split = parallel::split_layers(config);
  const double compute = bf16 ? 2.0 : 4.0, ring = 2.0 * double(P - 1) / double(P);
  // One stage boundary's tensor of a micro-batch: (B T, C) in the compute dtype, this rank's
  // tokens under sequence parallelism.
  const double boundary = double(config.train.micro_batch_size * m.context_length) / (sp ? tensor_size : 1) /
                          double(config.dist.context_parallel) * double(m.d_model) * compute;
  std::vector<StagePlan> stages;
  for (int s = 0; s < P; ++s) {
    StagePlan st;
    st.stage = s;
    parallel::TensorParallel widths(r, tensor_size, sp, m, Device::cpu,
                                    bf16 ? DType::bf16 : DType::f32);
    const int expert_size = int(config.dist.expert_parallel);
    parallel::ExpertParallel experts(0, expert_size);
    model::Layout layout{true, &widths};
    if (expert_size > 1) layout.experts = &experts;
    for (std::size_t v = std::size_t(s); v < split.size(); v += std::size_t(P)) {
      st.chunks.push_back(split[v]);
      layout.layer_ranges.push_back(parallel::layer_range(split[v]));
      st.layers += split[v].layers;
      // Each chunk's micro-batches go on to the next virtual stage, and their gradients back.
      st.sends += (v + 1 < split.size() ? micro_batches : 0) + (v > 0 ? micro_batches : 0);
    }
    st.first_layer = st.chunks.front().first_layer;
    const auto model = model::make_model(m, Device::cpu, config.train.recompute, bf16 ? DType::bf16 : DType::f32,
                                         ops::AttentionKernels::flash, layout);
    // Each rank of a context group holds context_length / context_parallel tokens of a sequence.
    parallel::ContextAttention sequences(0, int(config.dist.context_parallel), true, Device::cpu, DType::f32);
    model->attach_sequences(&sequences);
    st.embedding = model->holds_model_begin();
    st.head = model->holds_model_end();
    st.share = share_of_model(*model, tensor_size, r);
    st.share.expert_size = expert_size;
    st.slots = parallel::peak_live_activations(parallel::stage_schedule(config.dist, s, int(micro_batches)));
    st.activations =
        st.slots * std::int64_t(model->activation_bytes(int(config.train.micro_batch_size), int(m.context_length))) +
        context_scratch_bytes(config, tensor_size, bf16, config.train.micro_batch_size) +
        expert_activation_bytes(m, bf16, config.train.recompute, config.train.micro_batch_size,
                                int(config.dist.context_parallel),
                                expert_size, moe_layers_held(st.share), st.slots);
    st.sent_p2p = double(st.sends) * boundary;
    // Every stage takes part in the pipeline group's all-reduces: the tied embedding's gradient
    // (this tensor rank's rows; the middle stages with zeros), the loss and the gradient norm.
    st.tied = !model->tied_embedding().empty();
    const double tied_rows = double(m.vocab_size * (r + 1) / tensor_size - m.vocab_size * r / tensor_size);
    st.sent_pipeline_collectives = ring * ((st.tied ? tied_rows * double(m.d_model) * 4.0 : 0.0) + 2 * 8.0);
    if (tensor_size > 1) {  // micro-batches of its collectives, and the gradient norm's double once
      const UpdateTraffic per_micro_batch = tensor_micro_step(config, tensor_size, bf16, st.layers, moe_layers_held(st.share),
                                                                   st.embedding, st.head);
      st.sent_tensor = double(micro_batches) * per_micro_batch.bytes + 2.0 * double(tensor_size - 1) / double(tensor_size) * 8.0;
    }
    st.sent_context = context_traffic(config, tensor_size, bf16, micro_batches, st.layers, moe_layers_held(st.share));
    stages.push_back(std::move(st));
  }
  return stages;
}

MemoryPlan stage_memory(const config::Config& config, const StagePlan& stage, int data_parallel_size, int zero_stage,
                        bool bf16) {
  if (zero_stage == 3) throw std::invalid_argument("stage_memory: ZeRO 3 with a pipeline is refused by the trainer");
  MemoryPlan plan = plan_memory(config, stage.share, data_parallel_size, zero_stage, bf16, 1);
  plan.activations = stage.activations;
  return plan;
}

}  // namespace llmtrain::plan
