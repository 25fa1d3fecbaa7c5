// Memory planning: what one rank holds for a config on a mesh (tensor x data), precision and ZeRO
// stage, the bytes it sends per optimizer update, and the meshes that fit a number of devices.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "config/config.h"
#include "dist/mesh.h"
#include "model/flat_layout.h"
#include "parallel/pipeline_stages.h"

namespace llmtrain::plan {

struct MemoryPlan {
  std::int64_t weights = 0;      // f32 master weights a rank keeps (ZeRO 3: its shards); ZeRO 0-2 in bf16 also the 2-byte working copy
  std::int64_t gradients = 0;    // f32 gradients a rank keeps (ZeRO 3: its shard)
  std::int64_t optimizer = 0;    // the optimizer's state (AdamW: m and v; Muon: a momentum for its matrices, m and v for the rest)
  std::int64_t optimizer_arrays = 0;  // f32 arrays a checkpoint writes of that state per parameter element (optim::state_arrays)
  std::int64_t gathered = 0;     // ZeRO 1-2: the padded reduce-scatter / all-gather buffer and the summed shard; ZeRO 3: its working buffers
  std::int64_t activations = 0;  // for one micro-batch, with their gradients
  std::int64_t state() const { return weights + gradients + optimizer + gathered; }
  std::int64_t total() const { return state() + activations; }
};

/// Exact parameter count of the config's model (its ArchSpec: the model's own parameter list).
std::int64_t parameter_count(const config::ModelConfig& model);
/// The parameters one token runs through: all of them, less each MoE layer's E - k idle routed experts.
std::int64_t active_parameter_count(const config::ModelConfig& model);

/// One unit of ZeRO 3: a contiguous range of the flat parameter buffer that is sharded, gathered
/// and reduce-scattered as one.
struct ShardUnit {
  std::int64_t params = 0;
  bool layer = false;  // a transformer layer (gathered around its forward and backward); else a root unit
  std::int64_t begin = 0;  // where it starts in the flat buffer
  // A root unit: read by the embedding and/or by the final norm and head (a tied embedding by
  // both); parallel/zero3_slots.h says when it is gathered and reduced.
  bool embedding = false, head = false;
};

/// What one rank of a tensor-parallel group holds of the model: the parameter list of the model
/// built for that tensor rank (model::make_model, sharded: nothing allocated), so the split is the
/// models' own (slice_of in gpt2.cpp and llama.cpp). Ranks differ only where the vocabulary rows
/// do not divide evenly.
struct RankShare {
  int tensor_size = 1;
  int tensor_rank = 0;
  int expert_size = 1;           // expert parallelism: each rank holds 1 / expert_size of every MoE layer's experts
  std::int64_t params = 0;       // this rank's parameters (the whole model's at tensor size 1)
  std::vector<ShardUnit> units;  // ZeRO 3's units of its flat buffer, in buffer order
  // optim.name "muon": the matrices Muon orthogonalises (optim::muon_matrices), as flat ranges,
  // in its order (owner: index % data-parallel size). Without tensor parallelism only.
  std::vector<model::FlatRange> muon_matrices;
  std::vector<model::ParamInfo> infos;  // its parameters (the rank's model's param_infos)
};

/// The share of tensor rank `tensor_rank` of `tensor_size`, or (tensor_rank -1) of the rank that
/// holds the most parameters (the figures plan prints). InputError (the model's, naming
/// dist.tensor_parallel and the keys it must divide) when the model cannot be split that way.
/// `expert_size` > 1: the share of an expert rank (E / expert_size experts of each MoE layer;
/// every expert rank holds as many parameters).
RankShare rank_share(const config::ModelConfig& model, int tensor_size = 1, int tensor_rank = -1, int expert_size = 1);

/// ZeRO 3's units in flat-buffer order, without tensor parallelism: the root parameters before
/// the layers (gpt2: ln_f; llama: the untied lm_head and the final norm), one unit per layer (the
/// buffer holds the last layer first), then the root parameters after them (gpt2: wpe and wte;
/// llama: the token embedding). Their sizes add up to parameter_count. (rank_share(model).units)
std::vector<ShardUnit> shard_units(const config::ModelConfig& model);

/// Training FLOPs per token: 6 N + 12 L H Q T (N parameters, L layers, H heads of size Q, context
/// T): the matmuls forward and backward plus attention's scores and weighted sums.
double flops_per_token(const config::ModelConfig& model);

/// Activation bytes of a micro-batch of B sequences of context_length tokens: the buffer the model
/// allocates (its activations, for train.recompute `recompute`, and their gradients), measured by
/// the model's own layout code (ArchSpec::activation_bytes) with fp32 or bf16 activations, on a
/// rank of a tensor-parallel group of `tensor_size` (its heads, MLP columns and vocabulary rows;
/// with `sequence_parallel`, 1/tensor_size of the tokens of the residual stream and norms) and of
/// a context-parallel group of `context_size` (context_length / context_size tokens of each sequence).
std::int64_t activation_bytes(const config::ModelConfig& model, bool bf16, config::Recompute recompute,
                              std::int64_t micro_batch, int tensor_size = 1, bool sequence_parallel = false,
                              int context_size = 1, int expert_size = 1);
/// Context parallelism (config.dist.context_parallel CP > 1): the attention's own work buffer a
/// rank allocates next to its activations (parallel/context_attention.cpp), for a micro-batch of
/// `micro_batch` sequences on a tensor rank of `tensor_size`. Forward's buffers (with N = micro_batch
/// x T / CP tokens and K = 2 x its key/value heads x head size: 2 key/value blocks of N x K in the
/// compute dtype (ring; CP + 1, allgather), one block's f32 result and log-sum-exps, and the f32
/// running result in bf16) borrow the layer's backward scratch, and backward's (the blocks again,
/// their f32 gradients likewise, and the f32 query gradients in bf16) the scratch past the
/// attention's gradients, when they fit: 0 then, else the larger need of those that do not. 0
/// without context parallelism.
std::int64_t context_scratch_bytes(const config::Config& config, int tensor_size, bool bf16, std::int64_t micro_batch);
/// What each rank sends its context group per layer and micro-batch of `micro_batch` sequences
/// (ring or allgather alike): forward CP-1 key/value blocks of N K elements in the compute dtype,
/// backward as many again and CP-1 f32 blocks of their gradients. Bytes; 0 without context parallelism.
double context_layer_bytes(const config::Config& config, int tensor_size, bool bf16, bool backward);
/// The same for one sequence.
std::int64_t activation_bytes_per_sequence(const config::ModelConfig& model, bool bf16,
                                           config::Recompute recompute = config::Recompute::none,
                                           int tensor_size = 1);

/// Bytes per rank of a rank holding `share` in a data-parallel group of `data_parallel_size`,
/// counted as the trainer allocates them, so that state() is the trainer's state_bytes (the log's
/// "this rank holds", metrics.jsonl's state_bytes) of that rank. With P the share's parameters:
/// ZeRO 0 (and ZeRO 1-2 on one data rank, which the trainer runs as 0): f32 master weights (4 P;
/// bf16: and a 2-byte working copy, 6 P), f32 gradients 4 P, the optimizer's state (what optim.name's
/// optimizer says it needs per element of each parameter, optim::state_bytes_of: AdamW's m and v
/// 8 P; Muon's momentum 4 bytes per element of its matrices, m and v 8 for the rest). Where the
/// data ranks' shards hold different parameters, `optimizer` is the largest rank's. ZeRO 1 and 2
/// (the same in llmtrain: the gradient buffer stays whole): the optimizer state of a shard of S = ceil(P / D),
/// and `gathered` the padded buffer the gradients are reduce-scattered from and the weights
/// all-gathered into (4 D S) and the summed shard (4 S). ZeRO 3 shards each unit padded, ceil(n /
/// D) parameters of it per rank, master weights, gradients and optimizer state alike; `gathered`
/// counts the working buffers parallel/zero3.cpp allocates: the weight slots (compute dtype, 4 or
/// 2 bytes) and f32 gradient slots (each with its reduce-scattered part, 1/D of it) that
/// parallel::zero3_slot_layout lays out for the units (no reduced parts on one data rank). Activations:
/// activation_bytes at the share's tensor size and config.dist.sequence_parallel.
MemoryPlan plan_memory(const config::Config& config, const RankShare& share, int data_parallel_size, int zero_stage,
                       bool bf16, std::int64_t micro_batch);
/// Without tensor parallelism.
MemoryPlan plan_memory(const config::Config& config, int data_parallel_size, int zero_stage, bool bf16,
                       std::int64_t micro_batch);

/// The largest micro-batch whose activations fit next to `state` bytes in `memory` (0: none);
/// under sequence parallelism one whose micro-batch x context_length tensor_size divides.
std::int64_t max_micro_batch(const config::Config& config, bool bf16, int tensor_size, std::int64_t state,
                             std::int64_t memory);

/// The collectives one rank takes part in per optimizer update over one of its groups, and the
/// bytes it sends by the ring algorithms' volumes (dist::Traffic): for a buffer of S bytes on n
/// ranks, an all-reduce sends 2 (n-1)/n S, a reduce-scatter or all-gather (n-1)/n S.
struct UpdateTraffic {
  std::int64_t all_reduces = 0, reduce_scatters = 0, all_gathers = 0, all_to_alls = 0;
  std::int64_t sends = 0;  // point-to-point sends (optim.name "muon": its owners' gathers and scatters)
  double bytes = 0;        // sent per rank
};

/// Over the data-parallel group, for a rank holding `share`. ZeRO 0: one all-reduce of the f32
/// gradients per update. ZeRO 1 and 2: a reduce-scatter of the f32 gradients and an all-gather
/// of the f32 weights (both padded to D ceil(P / D)). ZeRO 3, each of the `micro_steps`: every
/// layer unit all-gathered in the compute dtype for forward and again for backward (once with
/// dist.reshard_after_forward false) and its f32 gradients reduce-scattered; each root unit
/// all-gathered and its gradients reduce-scattered once for each end that reads it (a tied
/// embedding twice), or, where the root units keep slots of their own (parallel/zero3_slots.h),
/// gathered once per update and reduced once per micro-step; the first layer is not gathered again for the forward of the micro-steps
/// after the first (it stays gathered from backward). The small all-reduce
/// of the loss and the gradient norm is not counted. Nothing at D = 1. optim.name "muon" under
/// ZeRO 1-3 (without tensor parallelism) adds its owners' transfers (muon_traffic) of the data
/// rank that sends most.
UpdateTraffic update_traffic(const config::Config& config, const RankShare& share, int data_parallel_size,
                             int zero_stage, bool bf16, std::int64_t micro_steps);
/// Without tensor parallelism.
UpdateTraffic update_traffic(const config::Config& config, int data_parallel_size, int zero_stage, bool bf16,
                             std::int64_t micro_steps);

/// Muon's point-to-point transfers per update of data rank `data_rank` of `data_parallel_size`
/// under ZeRO `zero_stage` >= 1 (optim/muon.h): matrix j is orthogonalised by rank j % D, which
/// receives every other rank's part of u (f32) and sends each its part of O back; a rank sends
/// its part of each matrix another rank owns and, for the matrices it owns, the other ranks'
/// parts. Parts as ZeRO lays the flat buffer out: ZeRO 1 and 2 ceil(P / D) elements a rank, ZeRO
/// 3 ceil(n / D) of each unit of n. Nothing for optim.name "adamw", at D = 1 or ZeRO 0.
UpdateTraffic muon_traffic(const config::Config& config, const RankShare& share, int data_parallel_size,
                           int zero_stage, int data_rank);

/// Over a tensor-parallel group of `tensor_size` (Megatron's split, as gpt2.cpp and llama.cpp
/// make it), every collective counted. Each micro-step, with N = micro-batch x context tokens, C =
/// d_model and L layers, without sequence parallelism: all-reduces of N C f32 values (activations
/// are summed in f32, also under bf16) for the embedding, 2 per layer in forward (after the
/// attention and MLP projections), 2 per layer in backward (the input gradients of the
/// column-parallel matmuls), 2 more per layer with train.recompute "full" (the layer's forward
/// again), and the head's input gradient. With config.dist.sequence_parallel: reduce-scatters of N
/// C f32 values where those all-reduces were (4 L + 2, 2 L more with "full"); all-gathers of N C
/// values in the compute dtype before the split matmuls, 2 per layer in forward and 4 in backward
/// (the output gradients and the norms' outputs again), one more per layer with "mlp" and 2 with
/// "full", and 2 for the head's input and the embedding's gradient; and all-reduces of the norms'
/// weight gradients (2 L + 1 norms, f32). Both: the vocabulary-parallel cross-entropy's row maxima
/// (N f32) and sums (2 N f32). A Mixture-of-Experts layer's experts run whole on every tensor
/// rank: 2 all-reduces fewer than a dense layer's, or 1 all-gather and 2 reduce-scatters fewer
/// (its input gathered once for forward and backward, no sums after its experts); with "full" 3
/// all-reduces or reduce-scatters fewer, with "mlp" 2 all-gathers fewer (its kept input serves
/// the recomputation). Llama with
/// replicated key/value heads (tensor_size above
/// n_kv_head) one all-reduce per layer of all their k and v gradients (n_kv_head x 2 head_size x C
/// f32). Once per update the gradient norm's (one double). Nothing at size 1.
UpdateTraffic tensor_traffic(const config::Config& config, int tensor_size, bool bf16, std::int64_t micro_steps);
/// Over the context group, per update: every layer's context_layer_bytes forward and backward (the
/// forward twice with train.recompute "full") for each of `micro_steps` micro-batches of `layers`
/// layers (-1: all), and the all-reduce of each of its `moe_layers` (-1: all the model's) MoE layers'
/// router statistics (2 E + 2 doubles). Nothing without context parallelism.
double context_traffic(const config::Config& config, int tensor_size, bool bf16, std::int64_t micro_steps,
                       std::int64_t layers = -1, std::int64_t moe_layers = -1);

/// Over the expert group of `share.expert_size` (dist.expert_parallel > 1), per update, for data
/// rank 0 of a data-parallel (expert-data) group of `data_parallel_size` under ZeRO `zero_stage`.
/// All-to-alls, each of `micro_steps` micro-batches of N = micro_batch x context tokens, per MoE
/// layer: the counts (E / EP i32 to each rank), in forward the slots' rows to their experts and
/// the experts' outputs back, in backward the same of their gradients (and, with train.recompute
/// "full", the forward's three again); M = N k rows each (with
/// capacity_factor, at most E x the capacity), of which an even routing sends (EP - 1) / EP to the
/// other ranks, d_model values in the compute dtype each. All-reduces (ring): the gradients every
/// expert rank holds alike (all but the experts'; those of its ZeRO shard, one call per run of
/// them), and once per update the loss, the gradient norm, the router statistics (4 doubles and
/// a max) and the expert loads (MoE layers x E doubles). Nothing at EP 1.
UpdateTraffic expert_traffic(const config::Config& config, const RankShare& share, int data_parallel_size,
                             int zero_stage, bool bf16, std::int64_t micro_steps);
/// The MoE layers whose experts a share holds (a pipeline stage's, or all of them).
std::int64_t moe_layers_held(const RankShare& share);
/// Expert parallelism's activations beyond the model's own layout: the rows an even routing brings
/// each of the `moe_layers` MoE layers' experts (N k, at most E x the capacity) in each of `slots`
/// micro-batches in flight (recompute "full": one store all layers share), and the scratch all
/// layers share; 0 at expert size 1.
std::int64_t expert_activation_bytes(const config::ModelConfig& model, bool bf16, config::Recompute recompute,
                                     std::int64_t micro_batch, int context_size, int expert_size,
                                     std::int64_t moe_layers, std::int64_t slots = 1);
/// The shares `plan --suggest` tries on `gpus` devices for a tensor group of `tensor_size`: expert
/// size 1, and for a MoE model each divisor of model.moe.experts that divides gpus.
std::vector<RankShare> expert_shares(const config::ModelConfig& model, int tensor_size, int gpus);

/// One pipeline stage as the trainer builds it (dist.pipeline_parallel P > 1, the 1F1B schedule):
/// its layers (split_layers), the model of those layers on the tensor rank that holds the
/// most vocabulary rows (model::make_model with Layout{first_layer, layers}, sharded: nothing
/// allocated), its activation slots and what it sends to its neighbours per optimizer update.
struct StagePlan {
  int stage = 0;
  std::int64_t first_layer = 0, layers = 0;  // the first chunk's first layer; the layers of all its chunks
  std::vector<parallel::StageRange> chunks;        // its model chunks (virtual stages stage, stage + P, ...): one under 1F1B
  bool embedding = false, head = false;  // the first stage holds the embedding; the last the final norm, head and loss
  RankShare share;                       // this stage's parameters on that tensor rank
  std::int64_t slots = 1;                // (micro-batch, chunk) pairs whose activations it keeps at once, as its
                                         // schedule runs: min(P - stage, m) under 1F1B
  std::int64_t activations = 0;          // slots x the stage model's activation_bytes of one micro-batch through its
                                         // largest chunk (from above: the model lays out one backward scratch for
                                         // all its slots)
  std::int64_t sends = 0;                // point-to-point sends per update: m forward per chunk before the last
                                         // virtual stage, m backward per chunk after the first
  double sent_p2p = 0;                   // their bytes: micro_batch x context x d_model (/ t with sequence parallelism) in the compute dtype each
  double sent_pipeline_collectives = 0;  // the pipeline group's all-reduces (ring): the tied embedding's gradient, the loss and the norm
  bool tied = false;                     // the tied embedding's gradients are summed between the first and last stages
  double sent_context = 0;               // over its context group per update: context_traffic for its layers
  double sent_tensor = 0;                // over its tensor group per update: tensor_traffic's collectives for its layers,
                                         // the embedding's on the first stage, the head's and the cross-entropy's on the last
};

/// Every stage of config.dist.pipeline_parallel (> 1) on a tensor group of `tensor_size`, with
/// `micro_batches` micro-batches per update, in fp32 or bf16, on tensor rank `tensor_rank` (-1:
/// the one with the most vocabulary rows, the figures plan prints). InputError (naming the keys)
/// for a split the model cannot take (split_layers) or a tensor size it cannot be split by.
std::vector<StagePlan> pipeline_stages(const config::Config& config, int tensor_size, bool bf16,
                                       std::int64_t micro_batches, int tensor_rank = -1);

/// One stage's memory per rank: plan_memory of its share for ZeRO 0-2 (ZeRO 3 with a pipeline is
/// refused by the trainer; std::invalid_argument), its activations those of its slots.
MemoryPlan stage_memory(const config::Config& config, const StagePlan& stage, int data_parallel_size, int zero_stage,
                        bool bf16);

/// Host memory of one rank in each phase of a run, as start-up, checkpoints and resume work: no
/// rank ever holds the whole model. A rank computes (or reads) only its own state, range by
/// range; a checkpoint is written sharded, each rank writing the logical ranges it owns from a
/// staging buffer of its own bytes; a resume reads, through a memory mapping, only the byte
/// ranges the rank owns, converting one range at a time. The tokenized data is memory-mapped: its
/// pages are the kernel's page cache, shared and reclaimable, and not counted here.
struct HostPlan {
  std::int64_t process = 0;      // per-process constant: libraries, MPI, and on a GPU the CUDA context
  std::int64_t state = 0;        // the rank's state in host memory: CPU backend MemoryPlan::state(); GPU 0
  std::int64_t activations = 0;  // CPU backend: one micro-batch's (MemoryPlan::activations); GPU 0
  std::int64_t staging = 0;      // checkpoint staging (pinned on a GPU), kept between saves: the bytes the
                                 // rank writes, f32 weights and optimizer state of the range it owns
  std::int64_t chunk = 0;        // one range in flight: a file read or write chunk, or init's per-range staging
  /// Start-up (initialisation, init_from): the rank's own state and one range being made or read.
  std::int64_t startup() const { return process + state + chunk; }
  /// Training: state, activations (CPU) and the staging buffer the background saves reuse.
  std::int64_t training() const { return process + state + activations + staging; }
  /// During a save: training's, and the writer's chunk.
  std::int64_t save() const { return training() + chunk; }
  /// During a resume (before the staging buffer exists): the rank's own state and one range.
  std::int64_t resume() const { return process + state + chunk; }
  std::int64_t peak() const { return std::max(std::max(startup(), training()), std::max(save(), resume())); }
};

/// Per-process host memory besides the model: a stated constant, not a measurement. A GPU rank:
/// CUDA context, cuBLAS/cuDNN/NCCL and MPI, 2 GiB; a CPU rank: MPI, OpenBLAS and OpenMP, 512 MiB.
inline constexpr std::int64_t gpu_process_bytes = std::int64_t(2) << 30;
inline constexpr std::int64_t cpu_process_bytes = std::int64_t(512) << 20;
/// One range in flight: the checkpoint files' read and write chunk (32 MiB).
std::int64_t host_chunk_bytes();

/// Parameters whose checkpoint bytes a rank writes, and whose ranges it reads on resume: ZeRO 3
/// its padded shards (sum of ceil(n / D) over its units); ZeRO 0-2 its part ceil(P / D) of its
/// share (its optimizer shard's range; at ZeRO 0 the data ranks split the writing alike).
std::int64_t owned_params(const RankShare& share, int data_parallel_size, int zero_stage);

/// Host bytes of a rank holding `share`, with `device` its plan_memory: on a GPU (`gpu`) only the
/// process constant, one chunk and the pinned staging of 4 bytes (the f32 weight) plus
/// 4 bytes per device.optimizer_arrays (AdamW: m, v) per owned parameter; on the CPU backend the device figures are host memory too.
HostPlan plan_host(const MemoryPlan& device, const RankShare& share, int data_parallel_size, int zero_stage, bool gpu);

/// One (mesh, ZeRO stage) choice for a number of devices, in the config's precision and micro-batch.
struct MeshOption {
  dist::Mesh mesh;
  int zero_stage = 0;
  std::int64_t micro_steps = 0;  // per update, on each data-parallel rank
  std::int64_t memory = 0;       // bytes per rank
  std::int64_t host = 0;         // host bytes per GPU rank, the most of any phase (HostPlan::peak)
  double sent = 0;               // bytes each rank sends per update, all groups
  double tensor_sent = 0;        // of it over the tensor group
  double context_sent = 0;       // of it over the context group
  bool sequence_parallel = false;
};

/// Every mesh of `gpus` ranks (tensor_parallel a divisor up to 8 that the model can split by:
/// dividing model.n_head and model.ffn_hidden, and for Llama dividing model.n_kv_head or a
/// multiple of it; pipeline_parallel a divisor of the rest up to model.n_layer; the global batch a
/// multiple of micro_batch_size x data) with ZeRO stages 0 to 3 (0 and 3 only at data size 1,
/// where the trainer runs ZeRO 1 and 2 as 0), and at tensor size above 1 with sequence parallelism
/// off and on (on where tensor_size divides micro_batch_size x context_length). Every row is
/// exact: pipeline 1 from plan_memory and update_traffic of the tensor rank that holds most, plus
/// tensor_traffic; a pipeline (1F1B or interleaved, the balanced split, ZeRO 0-2, at least p
/// micro-steps and for interleaved a multiple of p, as train requires) from pipeline_stages, the
/// stage that needs most memory deciding the fit and the one that sends most the traffic. For
/// sequences of 8,192 tokens or more also context-parallel sizes CP (dividing the ranks left,
/// 2 CP dividing model.context_length), the gradients' group being the context x data ranks.
/// A Mixture-of-Experts model: context size 1 and no sequence parallelism (as train requires), and
/// expert sizes EP (expert_shares) out of the data ranks, expert_traffic added.
/// `skipped_batch` counts the meshes left out because the global batch does not divide.
std::vector<MeshOption> mesh_options(const config::Config& config, int gpus, int* skipped_batch = nullptr);

/// One row of mesh_options: `mesh` with ZeRO `zero` and sequence parallelism or not, at the
/// config's micro-batch, for a rank holding `share` (rank_share at mesh.size(dist::Axis::tensor)); nullopt where
/// mesh_options leaves it out (the batch does not divide, train refuses it).
std::optional<MeshOption> mesh_option(const config::Config& config, const RankShare& share, const dist::Mesh& mesh,
                                      int zero, bool sequence_parallel);

/// The largest train.micro_batch_size at which `option`'s layout still fits `memory` bytes per
/// device (and, when host_per_rank > 0, that much host memory per rank): a divisor B of
/// global_batch_size / data, where mesh_option takes it (pipelines: at least p micro-steps); 0: none.
std::int64_t max_micro_batch(const config::Config& config, const MeshOption& option, std::int64_t memory,
                             std::int64_t host_per_rank = 0);

}  // namespace llmtrain::plan
