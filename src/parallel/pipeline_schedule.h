// The order of work on each pipeline stage: which micro-batch's forward or backward, of which
// model chunk, a stage runs next. Pure logic without communication: the trainer walks its
// stage's list and posts the sends and receives around each op; `llmtrain plan` and the tests
// run the lists of all stages together in a simulator.
//
// Stages and chunks. P stages (dist.pipeline_parallel), each holding V model chunks
// (dist.virtual_stages; 1 for 1F1B). Chunk c on stage s holds the layers of virtual stage
// v = c P + s, so a micro-batch passes stages 0, 1, ..., P-1 for chunk 0, then 0, ..., P-1 again
// for chunk 1, and so on; its backward runs the same path in reverse.
//
// 1F1B (PipeDream-flush; Megatron's non-interleaved schedule). Stage s first runs
// w = min(P - s - 1, m) forwards (warm-up), then, for each of the other m - w micro-batches, one
// forward followed by the backward of the oldest micro-batch in flight (steady state), then the w
// backwards left (cool-down). Micro-batches go in order 0, 1, ..., m-1, forwards and backwards
// alike. At most min(P - s, m) micro-batches' activations are alive on stage s: P on stage 0.
//
// Interleaved 1F1B (Megatron's interleaved schedule, Narayanan et al. 2021, with its default of P
// micro-batches per group). Each stage runs V m forwards and V m backwards, numbered k = 0 .. Vm-1.
// Forward k takes the k-th (micro-batch, chunk) of this order: micro-batches in groups of P, each
// group through chunk 0, then chunk 1, ..., then chunk V-1, before the next group starts:
//   group g = k / (P V), micro-batch g P + k % P, chunk (k % (P V)) / P.
// Backward k takes the same micro-batch with the chunks reversed (chunk V - 1 - (k % (P V)) / P).
// Warm-up: w = min(2 (P - s - 1) + (V - 1) P, V m) forwards; then forward k + w followed by
// backward k for each k < V m - w; then the remaining backwards. The groups of P need m to be a
// multiple of P. A stage keeps at most w + 1 (micro-batch, chunk) pairs' activations, each of
// one chunk (about 1/V of the stage's layers).
//
// ZB-H1 (zero-bubble's first schedule, Qi et al. 2023; dist.pipeline_schedule "zb1p"). Each
// backward is split in two: B, the input gradients (sent upstream at once), and W, the weight
// gradients, which only the stage itself waits for. The forwards and B's keep 1F1B's order (so the
// transfers are 1F1B's); each stage runs its next forward or B as soon as it can, a forward only
// while it holds fewer micro-batches than 1F1B would (a micro-batch's activations go after its
// W), and otherwise, rather than wait, its oldest pending W. W's leave the critical path and fill
// the waits; the memory is 1F1B's. The order is made once by simulating every stage with each of
// F, B and W costing one unit, and then run as a fixed list.
//
// The bubble. With a forward costing F and a backward B per chunk and free transfers, 1F1B
// leaves every stage idle (P - 1)(F + B) of a step of (m + P - 1)(F + B): a fraction
// (P - 1) / (m + P - 1). Interleaving divides the idle time by V: (P - 1) / (V m + P - 1)
// (Megatron's (P - 1) / (V m) of the compute time, as a fraction of the whole step).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "config/config.h"

namespace llmtrain::parallel {

/// One unit of a stage's work: the forward or the backward of one micro-batch through one of
/// the stage's model chunks; in a split schedule (zb1p) a backward is its input gradients alone
/// and `weight` its weight gradients.
struct PipelineOp {
  enum Kind { forward, backward, weight } kind;
  int micro_batch;
  int chunk;  // the model chunk on this stage (virtual stage chunk P + stage); 0 for 1F1B
  bool operator==(const PipelineOp&) const = default;
};

/// "F3" for the forward of micro-batch 3, "B3" its backward, "W3" its weight gradients; "F3.1"
/// with chunk 1.
std::string to_string(const PipelineOp& op);

/// The 1F1B order of stage `stage` of `stages` for `micro_batches` (>= 1) micro-batches.
/// std::invalid_argument for a stage out of range or no micro-batches.
std::vector<PipelineOp> one_f_one_b(int stages, int stage, int micro_batches);

/// Megatron's interleaved order of stage `stage` with `virtual_stages` chunks per stage.
/// std::invalid_argument unless micro_batches is a positive multiple of stages (checked as an
/// InputError naming the keys, before this is called, by pipeline_micro_batches).
std::vector<PipelineOp> interleaved(int stages, int stage, int micro_batches, int virtual_stages);

/// ZB-H1's order (see the top of this file) of every stage, [s] stage s's.
std::vector<std::vector<PipelineOp>> zb1p(int stages, int micro_batches);
/// Whether `schedule` splits its backwards (lists weight ops).
bool splits_backward(const std::vector<PipelineOp>& schedule);

/// The order dist.pipeline_schedule gives stage `stage` of dist.pipeline_parallel.
std::vector<PipelineOp> stage_schedule(const config::DistConfig& dist, int stage, int micro_batches);

/// The pipeline's micro-batches per update: the gradient-accumulation micro-steps,
/// global_batch_size / (micro_batch_size x data_parallel_size) (config::grad_accum_steps).
/// InputError naming train.global_batch_size, train.micro_batch_size and dist.pipeline_parallel
/// when they are fewer than the stages, or, for "interleaved", not a multiple of them.
std::int64_t pipeline_micro_batches(const config::Config& config, int data_parallel_size);

/// The most (micro-batch, chunk) pairs `schedule` has forwarded and not yet backwarded (a split
/// schedule: not yet through its weight op) at any point (at least 1): the activation slots its
/// stage needs.
int peak_live_activations(const std::vector<PipelineOp>& schedule);

/// (P - 1) / (m + P - 1): the idle fraction of every stage's step under 1F1B.
double bubble_fraction_1f1b(int stages, int micro_batches);

/// (P - 1) / (V m + P - 1): the same under the interleaved schedule with V chunks per stage.
double bubble_fraction_interleaved(int stages, int micro_batches, int virtual_stages);

/// What one op of one chunk costs, in any time unit; transfers are free. `backward` is a whole
/// backward; a split schedule's B costs backward - weight and its W `weight`.
struct PipelineCosts {
  double forward = 1;
  double backward = 2;
  double weight = 1;
};

/// The fraction above for dist.pipeline_schedule and dist.virtual_stages; zb1p's by simulation
/// (simulate_pipeline with `costs`): stage 0's idle fraction, the largest of any stage's.
double bubble_fraction(const config::DistConfig& dist, int micro_batches, PipelineCosts costs = {});

/// The timeline of a step: every stage starts at time 0 and runs its list in order, each op as
/// soon as its stage is free and its inputs are there.
struct PipelineSimulation {
  double makespan = 0;                  // the step: time 0 to the end of the last op on any stage
  std::vector<double> busy;             // per stage: time computing
  std::vector<double> idle;             // per stage: makespan - busy
  std::vector<int> peak_live;           // per stage: most (micro-batch, chunk) forwarded, not yet backwarded
  std::vector<std::vector<double>> start;  // per stage: the start time of each op of its list
  /// idle / makespan of `stage`.
  double bubble(int stage) const { return idle[std::size_t(stage)] / makespan; }
};

/// Runs `schedules` (stage s's list at [s]; P = its size) of `micro_batches` micro-batches
/// through `virtual_stages` chunks per stage. The forward of (micro-batch, virtual stage v) waits
/// for the forward of v - 1; its backward for its own forward and the backward of v + 1; its
/// weight op (a split list) for its backward.
/// std::logic_error naming the stage and op when a list lacks an op or has one twice or out of
/// range, or when the stages deadlock (each waits for an op that another will never run, as a
/// backward listed before its own forward does).
PipelineSimulation simulate_pipeline(const std::vector<std::vector<PipelineOp>>& schedules, int micro_batches,
                                     int virtual_stages, PipelineCosts costs = {});

/// One point-to-point transfer of a stage's update: op's output activation (forward) or input
/// gradient (backward) sent to a neighbouring stage, or op's input activation or output gradient
/// received from one. Activations and gradients share one communicator: between two stages the
/// groups below keep the messages of both kinds in one order on both sides.
struct StageTransfer {
  enum Direction { send, recv } direction;
  int peer;        // the other stage
  PipelineOp op;   // the op on this stage whose output is sent or whose input is received
  bool operator==(const StageTransfer&) const = default;
};

/// The forwards stage `stage` runs before its steady state (one forward, one backward):
/// min(P - s - 1, m) under 1F1B, min(2 (P - s - 1) + (V - 1) P, V m) interleaved.
int warm_up_forwards(const config::DistConfig& dist, int stage, int micro_batches);

/// Stage `stage`'s transfers in groups around its ops, as the trainer posts them, with
/// `warm_up` forwards before the steady state. An iteration is a warm-up forward, a steady
/// forward and the backward after it, or a cool-down backward; the group before it receives what
/// it needs, together with the sends of what the iteration before produced (as Megatron's
/// send_forward_recv_backward and the like do), so that a stage never waits to receive before
/// what it owes its neighbours is under way. groups[k] is posted before op k (empty inside an
/// iteration); groups.size() == schedule.size() + 1, the last holding the last iteration's sends.
/// Virtual stage v = chunk P + stage takes its input from v - 1 and sends its output to v + 1.
std::vector<std::vector<StageTransfer>> transfer_groups(const std::vector<PipelineOp>& schedule, int stages, int stage,
                                                        int virtual_stages, int warm_up);

/// Runs every stage's transfer groups (groups[s], P = its size) the way NCCL runs the calls of
/// one communicator: a stage's group starts only when its previous group has finished, a group
/// finishes when each of its transfers has met its counterpart in the peer's current group, and
/// the k-th send from A to B meets B's k-th receive from A. Returns "" when every group
/// finishes, else what deadlocked (each stuck stage and its group). std::logic_error when a send
/// meets a receive of another micro-batch, kind or virtual stage (the two sides' orders differ),
/// or a transfer is never matched.
std::string simulate_transfers(const std::vector<std::vector<std::vector<StageTransfer>>>& groups);

}  // namespace llmtrain::parallel
