// Memory planning: what one rank holds for a config at a world size, precision and ZeRO stage,
// the bytes it sends per optimizer update, and the meshes that fit a number of devices.
#pragma once

#include <cstdint>
#include <vector>

#include "config/config.h"
#include "dist/mesh.h"

namespace llmtrain::train {

struct MemoryPlan {
  std::int64_t weights = 0;      // f32 master weights a rank keeps (ZeRO 3: its shards); ZeRO 0-2 in bf16 also the 2-byte working copy
  std::int64_t gradients = 0;    // f32 gradients a rank keeps (ZeRO 2 and 3: its shard)
  std::int64_t optimizer = 0;    // AdamW m and v
  std::int64_t gathered = 0;     // ZeRO 3's working buffers: gathered weights (compute dtype), f32 gradient slots, scratch
  std::int64_t activations = 0;  // for one micro-batch, with their gradients
  std::int64_t total() const { return weights + gradients + optimizer + gathered + activations; }
};

/// Exact parameter count of the config's model (its ArchSpec: the model's own parameter list).
std::int64_t parameter_count(const config::ModelConfig& model);

/// One unit of ZeRO 3: a contiguous range of the flat parameter buffer that is sharded, gathered
/// and reduce-scattered as one.
struct ShardUnit {
  std::int64_t params = 0;
  bool layer = false;  // a transformer layer (gathered around its forward and backward); else a root unit (gathered for the whole step)
};

/// ZeRO 3's units in flat-buffer order, from the architectures' formulas: the root parameters
/// before the layers (gpt2: ln_f; llama: the untied lm_head and the final norm), one unit per
/// layer (the buffer holds the last layer first), then the root parameters after them (gpt2: wpe
/// and wte; llama: the token embedding). Their sizes add up to parameter_count.
std::vector<ShardUnit> shard_units(const config::ModelConfig& model);

/// Training FLOPs per token: 6 N + 12 L H Q T (N parameters, L layers, H heads of size Q, context
/// T): the matmuls forward and backward plus attention's scores and weighted sums.
double flops_per_token(const config::ModelConfig& model);

/// Activation bytes per sequence of context_length tokens: the buffer the model allocates for a
/// micro-batch of one (its activations, for train.recompute `recompute`, and their gradients),
/// measured by the model's own layout code (ArchSpec::activation_bytes) with fp32 or bf16
/// activations.
std::int64_t activation_bytes_per_sequence(const config::ModelConfig& model, bool bf16,
                                           config::Recompute recompute = config::Recompute::none);

/// Bytes per rank. fp32: 4-byte weights, gradients, AdamW m and v. bf16 (mixed precision): the
/// same plus a 2-byte working copy of the weights, and 2-byte activations. ZeRO 1 shards m and v
/// over the `data_parallel_size` ranks of a data-parallel group, ZeRO 2 the gradients too (shards
/// padded to equal size). ZeRO 3 shards each unit (shard_units) padded, ceil(n / D) parameters of
/// it per rank, master weights, gradients, m and v alike; `gathered` counts the working buffers
/// train/zero3.cpp allocates: the root units gathered (D ceil(n / D) each) in the compute dtype (4
/// or 2 bytes) with f32 gradient buffers as long, two layer slots of D ceil(n / D) parameters in
/// the compute dtype (the current layer and the prefetched next; with dist.reshard_after_forward
/// false one per layer), two f32 gradient slots of a layer plus its reduce-scattered part, and an
/// f32 scratch part of the largest unit. weights + gradients + optimizer + gathered is what the
/// trainer's state_bytes reports on rank 0.
MemoryPlan plan_memory(const config::Config& config, int data_parallel_size, int zero_stage, bool bf16,
                       std::int64_t micro_batch);

/// The collectives one rank takes part in per optimizer update, over its data-parallel group,
/// and the bytes it sends by the ring algorithms' volumes (dist::Traffic): for a buffer of S bytes
/// on n ranks, an all-reduce sends 2 (n-1)/n S, a reduce-scatter or all-gather (n-1)/n S.
struct UpdateTraffic {
  std::int64_t all_reduces = 0, reduce_scatters = 0, all_gathers = 0;
  double bytes = 0;  // sent per rank
};

/// ZeRO 0: one all-reduce of the f32 gradients per update. ZeRO 1 and 2: a reduce-scatter of the
/// f32 gradients and an all-gather of the f32 weights (both padded to D ceil(P / D)). ZeRO 3, each
/// of the `micro_steps`: every layer unit all-gathered in the compute dtype for forward and again
/// for backward (once with dist.reshard_after_forward false) and its f32 gradients reduce-scattered,
/// the root units' gradients reduce-scattered; once per update the root units all-gathered. The
/// small all-reduces of the loss and the gradient norm are not counted. Nothing at D = 1.
UpdateTraffic update_traffic(const config::Config& config, int data_parallel_size, int zero_stage, bool bf16,
                             std::int64_t micro_steps);

/// One (mesh, ZeRO stage) choice for a number of devices, in the config's precision and micro-batch.
struct MeshOption {
  dist::Mesh mesh;
  int zero_stage = 0;
  std::int64_t micro_steps = 0;  // per update, on each data-parallel rank
  std::int64_t memory = 0;       // bytes per rank
  double sent = 0;               // bytes each rank sends per update
  bool estimate = false;         // tensor or pipeline > 1: splits not built yet, figures estimated
};

/// Every mesh of `gpus` ranks (tensor_parallel a divisor up to 8 that divides model.n_head and
/// model.n_kv_head, pipeline_parallel a divisor of the rest up to model.n_layer, the global batch a
/// multiple of micro_batch_size x data) with ZeRO stages 0 to 3 (0 and 3 only at data size 1,
/// where ZeRO 1 and 2 equal 0). Tensor x pipeline t p > 1 are
/// estimates: the parameter-related memory (weights, gradients, optimizer state, gathered) is the
/// data-parallel figure / (t p); activations / t, a stage holding n_layer / p layers' activations
/// of min(p, micro-steps) micro-batches; the data group sends its figure / (t p), a tensor group 4
/// all-reduces of each layer's B x T x d_model activations per micro-step (2 forward, 2 backward),
/// a pipeline stage its activations forward and their gradients back per micro-step.
/// `skipped_batch` counts the meshes left out because the global batch does not divide.
std::vector<MeshOption> mesh_options(const config::Config& config, int gpus, int* skipped_batch = nullptr);

}  // namespace llmtrain::train
