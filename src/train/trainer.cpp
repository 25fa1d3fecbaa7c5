#include "train/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <vector>

#include "core/error.h"
#include "core/files.h"
#include "data/shard.h"
#include "ops/buffer.h"
#include "ops/ops.h"
#include "ops/profile.h"
#include "train/checkpointer.h"
#include "train/reporter.h"
#include "train/run_lock.h"
#include "train/schedule.h"
#include "train/tensor_parallel.h"

namespace llmtrain::train {
namespace {

using Clock = std::chrono::steady_clock;

// cuDNN's answers agreed by every rank: "yes" only where all say yes. So all ranks choose the same
// kernels, and a "cudnn" refused on one rank is an InputError on every rank (rank 0 reports it;
// the others would otherwise wait for it in the first collective until dist.timeout_s).
// resolve_attention's calls depend only on the config and the agreed answers, so every rank makes
// the same calls.
class AgreedCudnnProbe final : public model::CudnnAttentionProbe {
 public:
  AgreedCudnnProbe(model::CudnnAttentionProbe& local, dist::Communicator& world) : local_(local), world_(world) {}
  bool available(std::string* why_not) override { return agree(local_.available(why_not), why_not); }
  bool accepts(const model::AttentionShape& shape, std::string* why_not) override {
    return agree(local_.accepts(shape, why_not), why_not);
  }
  std::string version() override { return local_.version(); }

 private:
  bool agree(bool here, std::string* why_not) {
    std::int64_t refused = here ? 0 : 1;
    world_.all_reduce_max(&refused, 1);
    if (here && refused != 0) *why_not = "another rank's cuDNN refuses it";
    return refused == 0;
  }
  model::CudnnAttentionProbe& local_;
  dist::Communicator& world_;
};

void add_traffic(dist::Traffic& into, const dist::Traffic& more) {
  for (int k = 0; k < dist::Traffic::kinds; ++k) {
    into.calls[k] += more.calls[k];
    into.bytes[k] += more.bytes[k];
  }
}

}  // namespace

double evaluate(model::Model& model, const data::TokenDataset& data, const config::Config& config,
                std::int64_t batches, dist::Communicator* comm) {
  const auto& t = config.train;
  const int T = int(config.model.context_length), B = int(t.micro_batch_size);
  const int W = comm ? comm->world_size() : 1, rank = comm ? comm->rank() : 0;
  const data::SamplerOptions in_order{data.num_samples(), t.global_batch_size, B, W, rank, false, 0};
  data::BatchLoader loader(data, in_order, {});
  batches = std::min(batches, data.num_samples() / t.global_batch_size);
  double sum = 0.0;
  std::int64_t count = 0;
  for (std::int64_t k = 0; k < batches; ++k) {
    for (std::int64_t m = 0; m < loader.micro_steps(); ++m) {
      const data::MicroBatch batch = loader.next();
      sum += model.forward(batch.inputs.data(), batch.targets.data(), B, T, 0.0f);
      count += std::int64_t(B) * T;
    }
  }
  double totals[2] = {sum, double(count)};
  if (comm) comm->all_reduce_sum(totals, 2);
  return totals[0] / totals[1];
}

Trainer::Trainer(const TrainOptions& options, const dist::Communicators& comms, const checkpoint::Found* resume)
    : config_(options.config),
      device_(options.device),
      world_(*comms.world),
      data_comm_(comms.data_host()),
      train_data_(data::expand_paths(config_.data.train, "data.train"), config_.model.context_length,
                  std::uint32_t(config_.model.vocab_size)),
      data_device_(comms.data()),
      tensor_comm_(*comms.tensor_group),
      tensor_device_(comms.tensor()),
      pipeline_comm_(*comms.pipeline_group),
      pipeline_link_(comms.pipeline()),
      stage_(comms.pipeline_group->rank()),
      stages_(comms.pipeline_group->world_size()) {
  const auto& tc = config_.train;
  const int T = int(config_.model.context_length), B = int(tc.micro_batch_size);
  if (!config_.data.val.empty()) {
    val_data_ = std::make_unique<data::TokenDataset>(data::expand_paths(config_.data.val, "data.val"), T,
                                                     std::uint32_t(config_.model.vocab_size));
    if (val_data_->num_samples() < tc.global_batch_size) {
      throw InputError("data.val: " + std::to_string(val_data_->num_samples()) +
                       " samples, fewer than one global batch (" + std::to_string(tc.global_batch_size) + ")");
    }
  }
  accum_ = config::grad_accum_steps(config_, data_comm_.world_size());
  if (stages_ > 1) {
    accum_ = pipeline_micro_batches(config_, data_comm_.world_size());  // at least one per stage
  }
  tokens_per_step_ = double(tc.global_batch_size) * T;
  if (resume) {
    const auto& state = resume->state;
    sampler_state_ = {state.at("sampler").at("epoch").get<std::int64_t>(),
                      state.at("sampler").at("next_sample").get<std::int64_t>()};
    first_step_ = state.at("step").get<std::int64_t>() + 1;
    tokens_seen_ = state.at("tokens_seen").get<std::int64_t>();
  }
  loader_ = std::make_unique<data::BatchLoader>(
      train_data_,
      data::SamplerOptions{train_data_.num_samples(), tc.global_batch_size, B, data_comm_.world_size(),
                           data_comm_.rank(), config_.data.shuffle, std::uint64_t(config_.data.seed)},
      sampler_state_);

  // Process-wide, as the kernels read it: train.deterministic false lets the bf16 flash attention
  // backward take its single pass (dQ by atomics).
  ops::set_deterministic(tc.deterministic);
  {
    const auto cudnn = model::make_cudnn_probe();
    AgreedCudnnProbe agreed(*cudnn, world_);
    attention_ = model::resolve_attention(config_, device_, agreed);
  }
  const bool sharded = config_.dist.zero_stage == 3;
  model::Layout layout{sharded, comms.tensor_group->rank(), comms.tensor_group->world_size(),
                       config_.dist.sequence_parallel};
  if (stages_ > 1) {  // this stage's layers (virtual stages stage, stage + P, ...), and its order of work
    const std::vector<StageRange> split = split_layers(config_);
    for (std::size_t v = std::size_t(stage_); v < split.size(); v += std::size_t(stages_)) {
      layout.chunks.push_back({int(split[v].first_layer), int(split[v].layers)});
    }
    layout.first_layer = layout.chunks.front().first;
    layout.layers = layout.chunks.front().count;
    if (layout.chunks.size() == 1) layout.chunks.clear();
    schedule_ = stage_schedule(config_.dist, stage_, int(accum_));
    transfer_groups_ = transfer_groups(schedule_, stages_, stage_, int(config_.dist.virtual_stages),
                                       warm_up_forwards(config_.dist, stage_, int(accum_)));
  }
  model_ = model::make_model(config_.model, device_, tc.recompute, model::precision_dtype(tc.precision),
                             attention_.kernels, layout);
  if (stages_ > 1) {
    // One activation slot per (micro-batch, chunk) forwarded and not yet backwarded: at most
    // stages - stage under 1F1B.
    model_->set_activation_slots(peak_live_activations(schedule_));
    // A tied embedding: the first and last stages hold it; every stage takes part in summing its
    // gradients (a middle stage with zeros).
    const std::string tied = model_->tied_embedding();
    if (!tied.empty()) {
      tied_numel_ = pipeline_tied_numel();
      if (model_->has_param(tied)) tied_ = &model_->param_info(tied);
    }
  }
  if (layout.tensor_size > 1) {
    tensor_group_ = std::make_unique<CommTensorGroup>(comms.tensor(), device_);
    model_->set_tensor_group(tensor_group_.get());
  }
  // Weights are initialised, read and written whole, on the CPU, in the one-rank layout: through
  // a whole model that lives only until this rank has taken its part (on a GPU, under ZeRO 3 or
  // tensor parallelism).
  std::unique_ptr<model::Model> whole;
  if (sharded || layout.tensor_size > 1 || stages_ > 1 || device_ != Device::cpu) {
    whole = model::make_model(config_.model, Device::cpu);
  }
  model::Model& init = whole ? *whole : *model_;
  if (resume) {
    checkpoint::load_weights(*resume, init);
  } else if (config_.model.init_from.empty()) {
    init.init_weights(std::uint64_t(tc.seed));
  } else {
    checkpoint::import_hf(config_.model.init_from, init);
  }
  world_.broadcast(init.params().as<float>(), init.num_params(), 0);  // identical weights on every rank
  // This rank's part of them (tensor parallelism), in its flat layout.
  const std::int64_t P = model_->num_params();
  std::vector<float> part;
  const float* mine = init.params().as<float>();
  if (layout.tensor_size > 1 || stages_ > 1) {
    part.resize(std::size_t(P));
    for (const model::Segment& s : model_->segments(false)) {
      std::copy_n(mine + s.logical, s.length, part.begin() + s.local);
    }
    mine = part.data();
  }

  NormScope norm;
  if (layout.tensor_size > 1 || stages_ > 1) norm.counted = norm_ranges(*model_);
  if (layout.tensor_size > 1) norm.groups.push_back(comms.tensor_group.get());
  if (stages_ > 1) norm.groups.push_back(comms.pipeline_group.get());
  std::vector<Piece> pieces;
  if (sharded) {
    zero3_ = std::make_unique<Zero3>(*model_, data_device_, data_comm_, config_.dist.reshard_after_forward);
    zero3_->set_norm_scope(norm);
    zero3_->load(mine);
    pieces = zero3_->pieces();
  } else {
    if (whole) ops::copy(model_->params(), Tensor(const_cast<float*>(mine), DType::f32, Device::cpu, {P}));
    sync_ = std::make_unique<GradientSync>(data_device_, data_comm_, model_->grads(), config_.dist.bucket_mb,
                                           int(config_.dist.zero_stage));
    sync_->set_norm_scope(norm);
    pieces = {{sync_->begin(), sync_->end(), 0}};
  }
  whole.reset();
  part = {};
  if (layout.tensor_size > 1 || stages_ > 1) {
    logical_ = model::make_model(config_.model, Device::cpu, model::Recompute::none, DType::f32,
                                 ops::AttentionKernels::flash, model::Layout{true});
  }
  optimizer_ = std::make_unique<AdamW>(pieces, device_);
  if (resume) {
    // The state of every element of this rank's local arrays, wherever it sits in the whole model.
    const std::int64_t n = optimizer_->size();
    std::vector<checkpoint::FlatRange> ranges;
    for (const Placed& p : place(pieces, model_->segments(false))) ranges.push_back(p.logical);
    std::vector<float> m(static_cast<std::size_t>(n)), v(static_cast<std::size_t>(n));
    checkpoint::load_optimizer(*resume, ranges, m.data(), v.data());
    ops::copy(optimizer_->m(), Tensor(m.data(), DType::f32, Device::cpu, {n}));
    ops::copy(optimizer_->v(), Tensor(v.data(), DType::f32, Device::cpu, {n}));
  }
}

const model::Model& Trainer::logical_model() const { return logical_ ? *logical_ : *model_; }

std::vector<Placed> Trainer::optimizer_placement() const {
  return place(optimizer_->pieces(), model_->segments(true));
}

bool Trainer::writes_optimizer() const {
  // Ranks of one data-parallel group hold the same state unless ZeRO shards it.
  return data_comm_.rank() == 0 || zero3_ || (sync_ && sync_->zero_stage() > 0);
}

std::size_t Trainer::state_bytes() const {
  std::size_t bytes = model_->state_bytes() + optimizer_->m().bytes() + optimizer_->v().bytes();
  if (sync_) bytes += sync_->state_bytes();
  if (zero3_) bytes += zero3_->state_bytes();
  return bytes;
}

void Trainer::gather_weights(float* flat) {
  const model::Layout& layout = model_->layout();
  const std::int64_t P = model_->num_params();
  const bool lead = world_.rank() == 0;
  if (layout.tensor_size == 1 && stages_ == 1) {
    if (zero3_) {
      zero3_->gather_weights(lead ? flat : nullptr);
    } else if (lead) {
      ops::copy(Tensor(flat, DType::f32, Device::cpu, {P}), model_->params());
    }
    return;
  }
  // Tensor and pipeline parallelism: this rank's part (from the shards under ZeRO 3), then, on the
  // ranks of data index 0, the parts placed in the whole model's flat buffer and summed over the
  // tensor group and the pipeline onto world rank 0.
  const bool first_replica = data_comm_.rank() == 0;
  std::vector<float> part(first_replica ? std::size_t(P) : 0);
  if (zero3_) {
    zero3_->gather_weights(first_replica ? part.data() : nullptr);
  } else if (first_replica) {
    ops::copy(Tensor(part.data(), DType::f32, Device::cpu, {P}), model_->params());
  }
  if (!first_replica) return;
  std::vector<float> logical(std::size_t(model_->logical_params()), 0.0f);
  for (const model::Segment& s : model_->segments(true)) std::copy_n(part.begin() + s.local, s.length, logical.begin() + s.logical);
  tensor_comm_.all_reduce_sum(logical.data(), std::int64_t(logical.size()));
  pipeline_comm_.all_reduce_sum(logical.data(), std::int64_t(logical.size()));
  if (lead) std::copy(logical.begin(), logical.end(), flat);
}

StepResult Trainer::step(std::int64_t step) {
  const auto start = Clock::now();
  const auto& tc = config_.train;
  const int T = int(config_.model.context_length), B = int(tc.micro_batch_size);
  const dist::Traffic sent_before = data_device_.traffic(), tensor_before = tensor_device_.traffic();
  // (On the CPU the host and device groups are one communicator: the norm's reduction counts there.)
  const dist::Traffic tensor_host_before = tensor_comm_.traffic(), pipeline_before = pipeline_comm_.traffic();
  const dist::Traffic link_before = pipeline_link_.traffic();
  if (zero3_) {
    zero3_->zero_grads();
  } else {
    model_->zero_grads();
  }
  double loss_sum = 0.0;
  double waited = 0.0;
  // The micro-steps' losses add up on the model's device and are read once, after the last
  // one: a micro-step never waits for the GPU to finish its forward pass.
  model_->defer_loss(true);
  if (stages_ > 1) {
    loss_sum = run_pipeline(waited);
  }
  for (std::int64_t m = 0; m < accum_ && stages_ == 1; ++m) {
    const data::MicroBatch batch = loader_->next();
    // d(mean loss over the whole update)/dlogits: each micro-step adds 1 / (G T) per position.
    loss_sum += model_->forward(batch.inputs.data(), batch.targets.data(), B, T, float(1.0 / tokens_per_step_));
    if (zero3_ || m + 1 < accum_) {
      model_->backward();  // ZeRO 0-2: no communication before the last micro-step; ZeRO 3: the hooks'
    } else {
      model_->backward([&](std::int64_t ready) { sync_->on_ready(ready); });
    }
    sampler_state_ = batch.after;
  }
  loss_sum += model_->take_loss_sum();
  model_->defer_loss(false);
  StepResult result;
  if (stages_ > 1) {
    pipeline_comm_.all_reduce_sum(&loss_sum, 1);  // the last stage's
    sum_tied_embedding();
    result.pipeline_wait_s = waited;
  }
  // loss_sum is then over all ranks
  result.grad_norm = zero3_ ? zero3_->finish(loss_sum) : sync_->finish(loss_sum);
  result.loss = loss_sum / tokens_per_step_;
  result.lr = learning_rate(config_.optim, tc.max_steps, step);
  tokens_seen_ += std::int64_t(tokens_per_step_);
  // NaN guard: a non-finite loss or gradient norm skips the update (the same on every rank,
  // since both are reduced over all ranks).
  if (!std::isfinite(result.loss) || !std::isfinite(result.grad_norm)) {
    result.skipped = true;
    result.bad_in_a_row = ++bad_in_a_row_;
    result.seconds = std::chrono::duration<double>(Clock::now() - start).count();
    return result;
  }
  bad_in_a_row_ = 0;
  if (before_update_) before_update_();
  if (zero3_) {
    optimizer_->update(model_->param_infos(), zero3_->master(), zero3_->grads(), result.grad_norm, config_.optim,
                       tc.grad_clip, result.lr, step);
    zero3_->weights_changed();
  } else {
    const Tensor mine(model_->params().as<float>() + sync_->begin(), DType::f32, device_,
                      {sync_->end() - sync_->begin()});
    // Mixed precision: when this rank updates every weight, the optimizer writes the bf16 working
    // copy in the same pass; a ZeRO 1/2 shard's update leaves the rest to the all-gather, and the
    // next forward converts all of it (once per update either way, not once per micro-step).
    const bool updates_all = sync_->begin() == 0 && sync_->end() == model_->num_params();
    const Tensor working = updates_all ? model_->working_weights() : Tensor();
    optimizer_->update(model_->param_infos(), mine, sync_->grads(), result.grad_norm, config_.optim, tc.grad_clip,
                       result.lr, step, working);
    sync_->gather_params(model_->params().as<float>());
    if (working.data) model_->working_weights_written();
    // Replicas of one part of the model (the ranks of a data-parallel group) can drift apart;
    // shards have nothing to compare.
    const auto every = config_.dist.replica_check_every;
    if (data_comm_.world_size() > 1 && every > 0 && step % every == 0) {
      check_replicas(data_comm_, host_weights().params().as<float>(), model_->num_params(), step);
    }
  }
  result.sent = data_device_.traffic().since(sent_before);
  result.sent_tensor = tensor_device_.traffic().since(tensor_before);
  result.sent_pipeline = pipeline_comm_.traffic().since(pipeline_before);
  if (&pipeline_link_ != &pipeline_comm_) add_traffic(result.sent_pipeline, pipeline_link_.traffic().since(link_before));
  if (&tensor_comm_ != &tensor_device_) add_traffic(result.sent_tensor, tensor_comm_.traffic().since(tensor_host_before));
  result.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return result;
}

std::optional<double> Trainer::validate() {
  if (!val_data_) return std::nullopt;
  if (stages_ == 1) return evaluate(*model_, *val_data_, config_, config_.train.eval_batches, &data_comm_);
  // A pipeline: each micro-batch through the stages in turn; the last stage's losses summed.
  const auto& t = config_.train;
  const int T = int(config_.model.context_length), B = int(t.micro_batch_size);
  const data::SamplerOptions in_order{val_data_->num_samples(), t.global_batch_size, B, data_comm_.world_size(),
                                      data_comm_.rank(), false, 0};
  data::BatchLoader loader(*val_data_, in_order, {});
  const std::int64_t batches = std::min(t.eval_batches, val_data_->num_samples() / t.global_batch_size);
  model_->prepare_activations(B, T);
  // Each micro-batch's forward through this stage's chunks in turn, each transfer on its own
  // (forwards only: no steady state to pair).
  std::vector<PipelineOp> ops;
  for (int k = 0; k < int(loader.micro_steps()); ++k) {
    for (int chunk = 0; chunk < model_->chunks(); ++chunk) ops.push_back({PipelineOp::forward, k, chunk});
  }
  const auto groups = transfer_groups(ops, stages_, stage_, model_->chunks(), int(ops.size()));
  double totals[2] = {0.0, 0.0}, waited = 0.0;
  for (std::int64_t b = 0; b < batches; ++b) {
    std::vector<data::MicroBatch> micro;
    for (std::int64_t k = 0; k < loader.micro_steps(); ++k) micro.push_back(loader.next());
    run_stage_ops(ops, groups, true, [&](const PipelineOp& op) {
      const data::MicroBatch& batch = micro[std::size_t(op.micro_batch)];
      const double loss = model_->forward(batch.inputs.data(), batch.targets.data(), B, T, 0.0f);
      totals[0] += model_->last_stage() ? loss : 0.0;
      totals[1] += model_->last_stage() ? double(B) * T : 0.0;
    }, waited);
  }
  pipeline_comm_.all_reduce_sum(totals, 2);
  data_comm_.all_reduce_sum(totals, 2);
  return totals[0] / totals[1];
}

double Trainer::run_pipeline(double& waited) {
  const auto& tc = config_.train;
  const int T = int(config_.model.context_length), B = int(tc.micro_batch_size);
  // Every stage reads the update's micro-batches (the first needs the tokens, the last the targets).
  std::vector<data::MicroBatch> batches;
  for (std::int64_t m = 0; m < accum_; ++m) {
    batches.push_back(loader_->next());
    sampler_state_ = batches.back().after;
  }
  model_->prepare_activations(B, T);
  double loss = 0.0;
  run_stage_ops(schedule_, transfer_groups_, false, [&](const PipelineOp& op) {
    if (op.kind == PipelineOp::backward) {
      model_->backward();  // the data-parallel reduction starts after the last micro-batch
      return;
    }
    const data::MicroBatch& batch = batches[std::size_t(op.micro_batch)];
    // d(mean loss over the whole update)/dlogits: each micro-step adds 1 / (G T) per position.
    loss += model_->forward(batch.inputs.data(), model_->last_stage() ? batch.targets.data() : nullptr, B, T,
                            float(1.0 / tokens_per_step_));
  }, waited);
  return loss;
}

void Trainer::run_stage_ops(const std::vector<PipelineOp>& ops, const std::vector<std::vector<StageTransfer>>& groups,
                            bool forward_only, const std::function<void(const PipelineOp&)>& compute, double& waited) {
  // Activation slots: each (micro-batch, chunk) takes a free one when its forward (or the receive
  // of its input) comes, and gives it back after its backward.
  std::vector<int> free_slots;
  for (int k = model_->activation_slots(); k-- > 0;) free_slots.push_back(k);
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
    model_->use_chunk(op.chunk);
    model_->use_activation_slot(found->second);
  };
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
        const model::Model::StageIO io = model_->stage_io();
        const Tensor& into = t.op.kind == PipelineOp::forward ? io.input : io.output_grad;
        transfers.push_back({dist::PeerTransfer::recv, into.data, into.numel(), into.dtype, t.peer});
      }
    }
    // An iteration's results go together in the group after it (none inside it).
    if (sent > 0 && sent != outgoing.size()) throw RuntimeError("pipeline: results left unsent before op " + std::to_string(k));
    if (!transfers.empty()) {
      const auto start = Clock::now();
      pipeline_link_.start_transfers(transfers)->wait();
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
    if (forward ? !model_->last_stage() : !model_->first_stage()) {
      const model::Model::StageIO io = model_->stage_io();
      const Tensor& result = forward ? io.output : io.input_grad;
      if (outbox_.size() <= outgoing.size()) outbox_.emplace_back();
      ops::Buffer& buffer = outbox_[outgoing.size()];
      if (buffer.bytes() < result.bytes()) buffer = ops::Buffer(result.device, result.bytes());
      Tensor copy = result;
      copy.data = buffer.data();
      ops::copy(copy, result);
      outgoing.push_back(copy);
    }
    if (!forward || forward_only) release(op);
  }
}

std::int64_t Trainer::pipeline_tied_numel() const {
  // This tensor rank's rows of the tied embedding (V rows without tensor parallelism) x d_model.
  const auto& c = config_.model;
  const int r = model_->layout().tensor_rank, n = model_->layout().tensor_size;
  return (c.vocab_size * (r + 1) / n - c.vocab_size * r / n) * c.d_model;
}

void Trainer::sum_tied_embedding() {
  // The first and last stages' gradients of a tied embedding are summed between them (every stage
  // takes part in the pipeline group's all-reduce, the middle ones with zeros).
  if (tied_numel_ == 0) return;
  std::vector<float> sum(std::size_t(tied_numel_), 0.0f);
  const Tensor host(sum.data(), DType::f32, Device::cpu, {tied_numel_});
  if (tied_) ops::copy(host, model_->grad(*tied_).reshape({tied_numel_}));
  pipeline_comm_.all_reduce_sum(sum.data(), tied_numel_);
  if (tied_) ops::copy(model_->grad(*tied_).reshape({tied_numel_}), host);
}

const model::Model& Trainer::host_weights() {
  if (model_->sharded()) throw RuntimeError("host_weights: the model is sharded (ZeRO 3): gather_weights");
  if (device_ == Device::cpu) return *model_;
  if (!host_) {
    host_ = model::make_model(config_.model, Device::cpu, model::Recompute::none, DType::f32,
                              ops::AttentionKernels::flash, model_->layout());
  }
  ops::copy(host_->params(), model_->params());
  return *host_;
}

void resolve_device(TrainOptions& options, dist::Communicator& world) {
  if (!options.device_auto) return;
  options.device_auto = false;
  std::string why_none;
  const int devices = ops::cuda_device_count(&why_none);
  // Every rank of a node needs a GPU of its own (NCCL refuses two ranks on one device), and all
  // ranks must agree: one rank short of a GPU puts the whole job on the CPU.
  std::int64_t short_of_gpu = devices > world.local_rank() ? 0 : 1;
  world.all_reduce_max(&short_of_gpu, 1);
  if (!short_of_gpu) {
    options.device = Device::cuda;
    options.device_note = "device auto: cuda (this build has CUDA and " + std::to_string(devices) +
                          " device(s) visible, one per rank of this node)";
  } else {
    options.device = Device::cpu;
    options.device_note = devices == 0 ? "device auto: cpu (no CUDA device: " + why_none + ")"
                          : devices <= world.local_rank()
                              ? "device auto: cpu (" + std::to_string(devices) + " CUDA device(s) for local rank " +
                                    std::to_string(world.local_rank()) + ": every rank of a node needs its own)"
                              : "device auto: cpu (another rank has no CUDA device of its own)";
  }
}

TrainSummary run_training(const TrainOptions& requested) {
  TrainOptions options = requested;  // --device auto is resolved with the ranks below
  const config::Config& config = options.config;
  const auto& tc = config.train;
  if (options.device == Device::cuda) {
    std::string why;
    if (!ops::cuda_available(&why)) throw InputError("--device cuda: no usable CUDA device: " + why);
  }
  if (config.data.train.empty()) throw InputError("data.train: no training data given");
  // Before any data is loaded or model built: the run's folders must be folders.
  require_output_folder(options.run_dir, "--run-dir");
  if (!config.checkpoint.dir.empty()) require_output_folder(config.checkpoint.dir, "checkpoint.dir");
  // Pipelines: on CPU ranks, with ZeRO 0-2 (what is not built yet is refused here).
  if (config.dist.pipeline_parallel > 1) {
    const std::string what = "dist.pipeline_parallel = " + std::to_string(config.dist.pipeline_parallel);
    if (config.dist.zero_stage == 3) throw InputError(what + ": not with dist.zero_stage 3 (use ZeRO 0, 1 or 2)");
  }
  const dist::Communicators comms = dist::make_communicators(
      [&options](dist::Communicator& world) {
        resolve_device(options, world);
        return options.device;
      },
      config.dist.timeout_s, int(config.dist.tensor_parallel), int(config.dist.pipeline_parallel));
  dist::Communicator& world = *comms.world;
  TrainSummary summary;
  summary.lead = world.rank() == 0;
  const std::unique_ptr<RunLock> run_lock = lock_run_folder(options.run_dir, world);  // one writer per run folder
  const std::optional<checkpoint::Found> resume = find_resume_point(options, summary.lead);
  Trainer trainer(options, comms, resume ? &*resume : nullptr);
  claim_run_folder(run_lock.get(), world);  // from here on the run writes into its folder
  Reporter reporter(options, world, trainer.first_step());
  reporter.run_started(comms, trainer, resume ? &*resume : nullptr);
  Checkpointer checkpointer(options, world, reporter, trainer);  // watches stop signals from here on

  ops::enable_profiling(options.profile_ops);
  reporter.start_clock();
  for (std::int64_t step = trainer.first_step(); step <= tc.max_steps; ++step) {
    reporter.step_started(step);
    const StepResult result = trainer.step(step);
    if (result.skipped) {
      reporter.skipped(step, result.bad_in_a_row);
      if (result.bad_in_a_row >= tc.max_bad_steps) {
        checkpointer.flush();  // every rank stops here alike: a save being written is completed
        throw RuntimeError(std::to_string(result.bad_in_a_row) + " updates in a row had a non-finite loss or gradient norm "
                           "(train.max_bad_steps); stopping at step " + std::to_string(step) +
                           ": lower optim.lr or check the data");
      }
      continue;
    }
    reporter.update(step, result);
    summary.final_loss = result.loss;
    const bool last = step == tc.max_steps;
    if ((tc.eval_every > 0 && step % tc.eval_every == 0) || last) {
      if (const std::optional<double> val_loss = trainer.validate()) {
        reporter.validation(step, *val_loss);
        summary.final_val_loss = *val_loss;
      }
    }
    // A stop signal on any rank: all agree at this update boundary, save and stop.
    const bool stop = checkpointer.stop_requested();
    if (checkpointer.due(step) || last || stop) summary.last_checkpoint = checkpointer.save(step, trainer);
    summary.steps = step;
    if (stop && !last) {
      checkpointer.flush();
      summary.preempted = true;
      reporter.info("train: stopped by a signal after step %lld; checkpoint written", static_cast<long long>(step));
      break;
    }
  }
  checkpointer.flush();
  summary.seconds = reporter.elapsed();
  if (options.profile_ops) {
    reporter.op_profile(summary.seconds);
    ops::enable_profiling(false);
  }
  return summary;
}

}  // namespace llmtrain::train
