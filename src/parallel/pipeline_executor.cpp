#include "parallel/pipeline_executor.h"

#include <chrono>
#include <map>
#include <string>
#include <utility>

#include "core/error.h"
#include "ops/ops.h"
#include "parallel/gradient_strategy.h"

namespace llmtrain::parallel {
namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

PipelineExecutor::PipelineExecutor(model::Model& model, const config::Config& config, dist::Communicator& comm,
                                   dist::Communicator& link, int micro_batches)
    : model_(model),
      comm_(comm),
      link_(link),
      stage_(comm.rank()),
      stages_(comm.world_size()),
      B_(int(config.train.micro_batch_size)),
      T_(int(config.model.context_length)) {
  if (stages_ > 1) {
    schedule_ = stage_schedule(config.dist, stage_, micro_batches);
    transfer_groups_ = transfer_groups(schedule_, stages_, stage_, int(config.dist.virtual_stages),
                                       warm_up_forwards(config.dist, stage_, micro_batches));
  } else {
    schedule_ = one_f_one_b(1, 0, micro_batches);  // F0 B0 F1 B1 ...
    transfer_groups_ = transfer_groups(schedule_, 1, 0, 1, 0);  // all empty
  }
  // One activation slot per (micro-batch, chunk) forwarded and not yet backwarded (a split
  // schedule: not yet through its weight op): at most stages - stage under 1F1B and zb1p, one
  // without a pipeline. A split schedule's backwards leave the weight gradients to its weight ops.
  model_.set_activation_slots(peak_live_activations(schedule_));
  model_.set_weight_grads_deferred(splits_backward(schedule_));
  // A tied embedding in a pipeline: the first and last stages hold it (this tensor rank's rows of
  // it, V rows without tensor parallelism, x d_model) and sum its gradients between them.
  const std::string tied = model_.tied_embedding();
  if (stages_ > 1 && !tied.empty() && model_.has_param(tied)) {
    tied_ = &model_.param_info(tied);
    tied_numel_ = tied_->numel;
    tied_peer_ = ops::Buffer(model_.device(), std::size_t(tied_numel_) * sizeof(float));
  }
}

double PipelineExecutor::forward_backward(const std::function<const data::MicroBatch&(int)>& batch,
                                          float dloss_scale, GradientStrategy* gradients, double& waited) {
  model_.prepare_activations(B_, T_);
  double loss = 0.0;
  run(schedule_, transfer_groups_, false, [&](const PipelineOp& op) {
    if (op.kind == PipelineOp::weight) return model_.backward_weights();
    if (op.kind == PipelineOp::backward) {
      // The reduction starts inside the update's last backward where it may (overlaps_reduction);
      // else after the last micro-batch.
      if (gradients && overlaps_reduction() && op == schedule_.back()) gradients->reduce_during_next_backward();
      model_.backward();
      return;
    }
    const data::MicroBatch& b = batch(op.micro_batch);
    loss += model_.forward(b.inputs.data(), model_.ends_model() ? b.targets.data() : nullptr, B_, T_, dloss_scale);
  }, waited);
  return loss;
}

void PipelineExecutor::reduce_over_stages(double& loss_sum) {
  if (stages_ == 1) return;
  comm_.all_reduce_sum(&loss_sum, 1);  // the last stage's
  sum_tied_embedding();
}

std::array<double, 2> PipelineExecutor::forward_only(data::BatchLoader& loader, std::int64_t batches, int B, int T) {
  std::array<double, 2> totals{0.0, 0.0};
  for (std::int64_t b = 0; b < batches; ++b) {
    std::vector<data::MicroBatch> micro;
    for (std::int64_t k = 0; k < loader.micro_steps(); ++k) micro.push_back(loader.next());
    forward_micro_batches(micro, B, T, [&](int, double loss) {
      totals[0] += loss;
      totals[1] += double(B) * T;
    });
  }
  if (stages_ > 1) comm_.all_reduce_sum(totals.data(), 2);
  return totals;
}

void PipelineExecutor::forward_micro_batches(const std::vector<data::MicroBatch>& micro, int B, int T,
                                             const std::function<void(int, double)>& each) {
  model_.prepare_activations(B, T);
  // Each micro-batch's forward through this stage's chunks in turn, each transfer on its own
  // (forwards only: no steady state to pair).
  // (The model's layer ranges are this stage's chunks, in order.)
  const int chunks = int(model_.layer_ranges().size());
  std::vector<PipelineOp> ops;
  for (int k = 0; k < int(micro.size()); ++k) {
    for (int chunk = 0; chunk < chunks; ++chunk) ops.push_back({PipelineOp::forward, k, chunk});
  }
  const auto groups = transfer_groups(ops, stages_, stage_, chunks, int(ops.size()));
  double waited = 0.0;
  run(ops, groups, true, [&](const PipelineOp& op) {
    const data::MicroBatch& batch = micro[std::size_t(op.micro_batch)];
    const double loss = model_.forward(batch.inputs.data(), batch.targets.data(), B, T, 0.0f);
    if (model_.ends_model()) each(op.micro_batch, loss);
  }, waited);
}

void PipelineExecutor::run(const std::vector<PipelineOp>& ops, const std::vector<std::vector<StageTransfer>>& groups,
                           bool forward_only, const std::function<void(const PipelineOp&)>& compute, double& waited) {
  // Activation slots: each (micro-batch, chunk) takes a free one when its forward (or the receive
  // of its input) comes, and gives it back after its backward.
  std::vector<int> free_slots;
  for (int k = model_.activation_slots(); k-- > 0;) free_slots.push_back(k);
  std::map<std::pair<int, int>, int> slot_of;  // (micro-batch, chunk) -> its slot
  const auto select = [&](const PipelineOp& op) {
    const std::pair<int, int> key{op.micro_batch, op.chunk};
    auto found = slot_of.find(key);
    if (found == slot_of.end()) {
      if (op.kind != PipelineOp::forward) throw RuntimeError("pipeline: backward before forward (" + to_string(op) + ")");
      if (free_slots.empty()) throw RuntimeError("pipeline: more activations in flight than slots (" + to_string(op) + ")");
      found = slot_of.emplace(key, free_slots.back()).first;
      free_slots.pop_back();
    }
    model_.use_layer_range(op.chunk);
    model_.use_activation_slot(found->second);
  };
  // The op after which a micro-batch's slot is free: its weight op in a split schedule.
  const PipelineOp::Kind last = splits_backward(ops) ? PipelineOp::weight : PipelineOp::backward;
  const auto release = [&](const PipelineOp& op) {
    const auto found = slot_of.find({op.micro_batch, op.chunk});
    free_slots.push_back(found->second);
    slot_of.erase(found);
  };
  std::vector<Tensor> outgoing;  // copies of the results the next group with sends sends, in its order
  for (std::size_t k = 0; k < groups.size(); ++k) {
    std::vector<dist::PeerTransfer> transfers;
    std::size_t sent = 0;
    for (const StageTransfer& t : groups[k]) {
      if (t.direction == StageTransfer::send) {
        if (sent >= outgoing.size()) throw RuntimeError("pipeline: a send of " + to_string(t.op) + " with nothing to send");
        const Tensor& out = outgoing[sent++];
        transfers.push_back({dist::PeerTransfer::send, out.data, out.numel(), out.dtype, t.peer});
      } else {
        select(t.op);
        const model::Model::StreamEnds io = model_.stream_ends();
        const Tensor& into = t.op.kind == PipelineOp::forward ? io.input : io.output_grad;
        transfers.push_back({dist::PeerTransfer::recv, into.data, into.numel(), into.dtype, t.peer});
      }
    }
    // An iteration's results go together in the group after it (none inside it).
    if (sent > 0 && sent != outgoing.size()) throw RuntimeError("pipeline: results left unsent before op " + std::to_string(k));
    if (!transfers.empty()) {
      const auto start = Clock::now();
      link_.start_transfers(transfers)->wait();
      waited += std::chrono::duration<double>(Clock::now() - start).count();
    }
    if (sent > 0) outgoing.clear();
    if (k == ops.size()) {
      if (!outgoing.empty()) throw RuntimeError("pipeline: the last results were never sent");
      break;
    }
    const PipelineOp& op = ops[k];
    select(op);
    compute(op);
    // Its result for the next stage, if it has one: an activation on (every virtual stage but the
    // last), a gradient back (every one but the first).
    const bool forward = op.kind == PipelineOp::forward;
    if (op.kind != PipelineOp::weight && (forward ? !model_.ends_model() : !model_.begins_model())) {
      const model::Model::StreamEnds io = model_.stream_ends();
      const Tensor& result = forward ? io.output : io.input_grad;
      if (outbox_.size() <= outgoing.size()) outbox_.emplace_back();
      ops::Buffer& buffer = outbox_[outgoing.size()];
      if (buffer.bytes() < result.bytes()) buffer = ops::Buffer(result.device, result.bytes());
      Tensor copy = result;
      copy.data = buffer.data();
      ops::copy(copy, result);
      outgoing.push_back(copy);
    }
    if (op.kind == last || forward_only) release(op);
  }
}

void PipelineExecutor::sum_tied_embedding() {
  // The first and last stages exchange their gradients of a tied embedding over the stages'
  // device communicator (NCCL on GPUs, MPI on CPU ranks) and each adds the other's: a + b on one,
  // b + a on the other, the same bits. The middle stages take no part.
  if (tied_ == nullptr) return;
  const Tensor mine = model_.grad(*tied_).reshape({tied_numel_});
  const Tensor theirs(tied_peer_.data(), DType::f32, model_.device(), {tied_numel_});
  const int peer = stage_ == 0 ? stages_ - 1 : 0;
  link_.start_exchange(mine.data, theirs.data, tied_numel_, DType::f32, peer)->wait();
  ops::residual_forward(mine, mine, theirs);
}

}  // namespace llmtrain::parallel
