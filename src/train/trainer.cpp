#include "train/trainer.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <functional>
#include <filesystem>
#include <vector>

#include "core/error.h"
#include "core/files.h"
#include "data/shard.h"
#include "ops/buffer.h"
#include "ops/ops.h"
#include "ops/profile.h"
#include "train/attention_agreement.h"
#include "train/gradient_strategy.h"
#include "train/pipeline_schedule.h"
#include "train/pipeline_stages.h"
#include "train/schedule.h"
#include "train/tensor_parallel.h"

namespace llmtrain::train {
namespace {

using Clock = std::chrono::steady_clock;

void add_traffic(dist::Traffic& into, const dist::Traffic& more) {
  for (int k = 0; k < dist::Traffic::kinds; ++k) {
    into.calls[k] += more.calls[k];
    into.bytes[k] += more.bytes[k];
  }
}

// This rank's part of the model: its ZeRO 3 sharding, its tensor-parallel rank and, in a
// pipeline, its stage's layers (virtual stages stage, stage + P, ...).
model::Layout rank_layout(const config::Config& config, const dist::Communicators& comms) {
  model::Layout layout{config.dist.zero_stage == 3, comms.tensor_group->rank(), comms.tensor_group->world_size(),
                       config.dist.sequence_parallel};
  const int stage = comms.pipeline_group->rank(), stages = comms.pipeline_group->world_size();
  if (stages > 1) {
    const std::vector<StageRange> split = split_layers(config);
    for (std::size_t v = std::size_t(stage); v < split.size(); v += std::size_t(stages)) {
      layout.chunks.push_back({int(split[v].first_layer), int(split[v].layers)});
    }
    layout.first_layer = layout.chunks.front().first;
    layout.layers = layout.chunks.front().count;
    if (layout.chunks.size() == 1) layout.chunks.clear();
  }
  return layout;
}

// This rank's initial weights in its flat layout, (P,) f32 in host memory at `mine`, identical on
// every rank: from the checkpoint, model.init_from or train.seed. Weights are initialised, read
// and written whole, on the CPU, in the one-rank layout: through a whole model that lives only as
// long as this (with `through_whole`: on a GPU, under ZeRO 3, tensor or pipeline parallelism),
// else in `model` itself. With `part` (tensor or pipeline parallelism) this rank takes its part.
struct InitialWeights {
  std::unique_ptr<model::Model> whole;
  std::vector<float> part;  // this rank's part of the whole model's (tensor or pipeline parallelism)
  const float* mine = nullptr;
};

InitialWeights initial_weights(model::Model& model, const config::Config& config, bool through_whole, bool part,
                               const checkpoint::Found* resume, dist::Communicator& world) {
  InitialWeights weights;
  if (through_whole) weights.whole = model::make_model(config.model, Device::cpu);
  model::Model& init = weights.whole ? *weights.whole : model;
  if (resume) {
    checkpoint::load_weights(*resume, init);
  } else if (config.model.init_from.empty()) {
    init.init_weights(std::uint64_t(config.train.seed));
  } else {
    checkpoint::import_hf(config.model.init_from, init);
  }
  world.broadcast(init.params().as<float>(), init.num_params(), 0);  // identical weights on every rank
  weights.mine = init.params().as<float>();
  if (part) {  // this rank's part of them, in its flat layout
    weights.part.resize(std::size_t(model.num_params()));
    for (const model::Segment& s : model.segments(false)) {
      std::copy_n(weights.mine + s.logical, s.length, weights.part.begin() + s.local);
    }
    weights.mine = weights.part.data();
  }
  return weights;
}

// Which gradients the global norm counts on this rank and the groups it is summed over: under
// tensor or pipeline parallelism, the parts this rank owns, summed over those groups.
NormScope norm_scope(const model::Model& model, const dist::Communicators& comms) {
  NormScope norm;
  const bool tensor = comms.tensor_group->world_size() > 1, pipeline = comms.pipeline_group->world_size() > 1;
  if (tensor || pipeline) norm.counted = norm_ranges(model);
  if (tensor) norm.groups.push_back(comms.tensor_group.get());
  if (pipeline) norm.groups.push_back(comms.pipeline_group.get());
  return norm;
}

// The checkpoint's optimizer state of every element of this rank's local arrays, wherever it
// sits in the whole model.
void restore_optimizer(AdamW& optimizer, const model::Model& model, const checkpoint::Found& resume) {
  const std::int64_t n = optimizer.size();
  std::vector<model::FlatRange> ranges;
  for (const Placed& p : place(optimizer.pieces(), model.segments(false))) ranges.push_back(p.logical);
  std::vector<float> m(static_cast<std::size_t>(n)), v(static_cast<std::size_t>(n));
  checkpoint::load_optimizer(resume, ranges, m.data(), v.data());
  ops::copy(optimizer.m(), Tensor(m.data(), DType::f32, Device::cpu, {n}));
  ops::copy(optimizer.v(), Tensor(v.data(), DType::f32, Device::cpu, {n}));
}

// data.train's weighted sources as ranges of the dataset's samples (none for a single source,
// which keeps the epoch order of one list of shards).
std::vector<data::MixtureSource> mixture_sources(const config::TrainData& train, const data::TokenDataset& data) {
  std::vector<data::MixtureSource> sources;
  if (train.sources.size() < 2) return sources;
  std::size_t file = 0;
  for (std::size_t s = 0; s < train.sources.size(); ++s) {
    const std::size_t files =
        data::expand_paths(train.sources[s].paths, "data.train[" + std::to_string(s) + "].path").size();
    const std::int64_t first = data.samples_before(file);
    sources.push_back({first, data.samples_before(file + files) - first, train.sources[s].weight});
    file += files;
  }
  return sources;
}

}  // namespace

Trainer::Trainer(const TrainOptions& options, const dist::Communicators& comms, const checkpoint::Found* resume)
    : config_(options.config),
      device_(options.device),
      world_(*comms.world),
      data_comm_(comms.data_host()),
      train_data_(data::expand_paths(config_.data.train.paths(), "data.train"), config_.model.context_length,
                  std::uint32_t(config_.model.vocab_size)),
      data_device_(comms.data()),
      tensor_comm_(*comms.tensor_group),
      tensor_device_(comms.tensor()),
      pipeline_comm_(*comms.pipeline_group),
      pipeline_link_(comms.pipeline()),
      stages_(comms.pipeline_group->world_size()) {
  const auto& tc = config_.train;
  const int T = int(config_.model.context_length), B = int(tc.micro_batch_size);
  for (const config::ValSet& set : config_.data.val.sets) {
    const std::string key = set.name.empty() ? "data.val" : "data.val." + set.name;
    auto data = std::make_unique<data::TokenDataset>(data::expand_paths(set.paths, key), T,
                                                     std::uint32_t(config_.model.vocab_size));
    if (data->num_samples() < tc.global_batch_size) {
      throw InputError(key + ": " + std::to_string(data->num_samples()) + " samples, fewer than one global batch (" +
                       std::to_string(tc.global_batch_size) + ")");
    }
    val_sets_.push_back({set.name, std::move(data)});
  }
  if (!tc.eval_tasks.empty()) {  // benchmarks at every validation: their files and the run's tokenizer
    if (config_.dist.tensor_parallel > 1 || config_.dist.pipeline_parallel > 1 || config_.dist.zero_stage == 3) {
      throw InputError("train.eval_tasks: not with ZeRO 3, tensor or pipeline parallelism (yet); use llmtrain eval --task");
    }
    const auto shards = data::expand_paths(config_.data.train.paths(), "data.train");
    task_tokenizer_ = data::load_tokenizer(std::filesystem::path(shards.front()).parent_path().string());
    for (const config::EvalTask& task : tc.eval_tasks) {
      tasks_.emplace_back(task, read_choice_file(task.path, task.task, task.limit));
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
  const std::vector<data::MixtureSource> sources = mixture_sources(config_.data.train, train_data_);
  loader_ = std::make_unique<data::BatchLoader>(
      train_data_,
      data::SamplerOptions{train_data_.num_samples(), tc.global_batch_size, B, data_comm_.world_size(),
                           data_comm_.rank(), config_.data.shuffle, std::uint64_t(config_.data.seed)},
      sampler_state_, sources);
  if (sources.size() >= 2) {  // tokens per source, counted along (from the resumed position)
    std::vector<double> weights;
    for (const auto& source : sources) weights.push_back(source.weight);
    source_counts_.emplace(weights, sampler_state_.next_sample);
  }

  // Process-wide, as the kernels read it: train.deterministic false lets the bf16 flash attention
  // backward take its single pass (dQ by atomics).
  ops::set_deterministic(tc.deterministic);
  attention_ = resolve_attention_on_every_rank(config_, device_, world_);
  const model::Layout layout = rank_layout(config_, comms);
  model_ = model::make_model(config_.model, device_, tc.recompute, model::precision_dtype(tc.precision),
                             attention_.kernels, layout);
  pipeline_ = std::make_unique<PipelineExecutor>(*model_, config_, pipeline_comm_, pipeline_link_, int(accum_));
  if (layout.tensor_size > 1) {
    tensor_group_ = std::make_unique<CommTensorGroup>(comms.tensor(), device_);
    model_->set_tensor_group(tensor_group_.get());
  }
  const bool part = layout.tensor_size > 1 || stages_ > 1;  // this rank holds part of the model's tensors
  {
    const InitialWeights initial =
        initial_weights(*model_, config_, part || layout.sharded || device_ != Device::cpu, part, resume, world_);
    gradients_ = make_gradient_strategy(*model_, config_.dist, data_device_, data_comm_, norm_scope(*model_, comms));
    gradients_->load(initial.mine);
  }
  if (part) {
    logical_ = model::make_model(config_.model, Device::cpu, model::Recompute::none, DType::f32,
                                 ops::AttentionKernels::flash, model::Layout{true});
  }
  optimizer_ = std::make_unique<AdamW>(gradients_->pieces(), device_);
  if (resume) restore_optimizer(*optimizer_, *model_, *resume);
}

const model::Model& Trainer::logical_model() const { return logical_ ? *logical_ : *model_; }

std::vector<Placed> Trainer::optimizer_placement() const {
  return place(optimizer_->pieces(), model_->segments(true));
}

bool Trainer::writes_optimizer() const {
  // Ranks of one data-parallel group hold the same state unless ZeRO shards it.
  return data_comm_.rank() == 0 || gradients_->shards_optimizer();
}

std::size_t Trainer::state_bytes() const {
  return model_->state_bytes() + optimizer_->m().bytes() + optimizer_->v().bytes() + gradients_->state_bytes();
}

void Trainer::gather_weights(float* flat) {
  const model::Layout& layout = model_->layout();
  const std::int64_t P = model_->num_params();
  const bool lead = world_.rank() == 0;
  if (layout.tensor_size == 1 && stages_ == 1) {
    gradients_->gather_weights(lead ? flat : nullptr);
    return;
  }
  // Tensor and pipeline parallelism: this rank's part (from the shards under ZeRO 3), then, on the
  // ranks of data index 0, the parts placed in the whole model's flat buffer and summed over the
  // tensor group and the pipeline onto world rank 0.
  const bool first_replica = data_comm_.rank() == 0;
  std::vector<float> part(first_replica ? std::size_t(P) : 0);
  gradients_->gather_weights(first_replica ? part.data() : nullptr);
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
  const dist::Traffic sent_before = data_device_.traffic(), tensor_before = tensor_device_.traffic();
  // (On the CPU the host and device groups are one communicator: the norm's reduction counts there.)
  const dist::Traffic tensor_host_before = tensor_comm_.traffic(), pipeline_before = pipeline_comm_.traffic();
  const dist::Traffic link_before = pipeline_link_.traffic();
  gradients_->zero_grads();
  // Every stage reads the update's micro-batches, in order, as its schedule first needs them.
  std::vector<data::MicroBatch> micro;
  micro.reserve(std::size_t(accum_));
  const auto batch = [&](int k) -> const data::MicroBatch& {
    while (int(micro.size()) <= k) {
      micro.push_back(loader_->next());
      sampler_state_ = micro.back().after;
    }
    return micro[std::size_t(k)];
  };
  StepResult result;
  // The micro-steps' losses add up on the model's device and are read once, after the last
  // one: a micro-step never waits for the GPU to finish its forward pass.
  model_->defer_loss(true);
  // d(mean loss over the whole update)/dlogits: each micro-step adds 1 / (G T) per position.
  double loss_sum = pipeline_->forward_backward(batch, float(1.0 / tokens_per_step_), gradients_->grads_ready(),
                                                result.pipeline_wait_s);
  loss_sum += model_->take_loss_sum();
  model_->defer_loss(false);
  pipeline_->reduce_over_stages(loss_sum);  // the last stage's loss; a tied embedding's gradients
  // loss_sum is then over all ranks
  result.grad_norm = gradients_->finish(loss_sum);
  result.loss = loss_sum / tokens_per_step_;
  result.lr = learning_rate(config_.optim, tc.max_steps, step);
  tokens_seen_ += std::int64_t(tokens_per_step_);
  if (source_counts_) {
    while (source_counts_->position() < sampler_state_.next_sample) source_counts_->next();
    for (const std::int64_t samples : source_counts_->counts()) {
      result.source_tokens.push_back(samples * config_.model.context_length);
    }
  }
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
  optimizer_->update(model_->param_infos(), gradients_->master(), gradients_->grads(), result.grad_norm,
                     config_.optim, tc.grad_clip, result.lr, step, gradients_->working_weights());
  gradients_->weights_updated();
  // Replicas of one part of the model (the ranks of a data-parallel group) can drift apart;
  // shards have nothing to compare.
  const auto every = config_.dist.replica_check_every;
  if (gradients_->replicated() && data_comm_.world_size() > 1 && every > 0 && step % every == 0) {
    check_replicas(data_comm_, host_weights().params().as<float>(), model_->num_params(), step);
  }
  result.sent = data_device_.traffic().since(sent_before);
  result.sent_tensor = tensor_device_.traffic().since(tensor_before);
  result.sent_pipeline = pipeline_comm_.traffic().since(pipeline_before);
  if (&pipeline_link_ != &pipeline_comm_) add_traffic(result.sent_pipeline, pipeline_link_.traffic().since(link_before));
  if (&tensor_comm_ != &tensor_device_) add_traffic(result.sent_tensor, tensor_comm_.traffic().since(tensor_host_before));
  result.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return result;
}

std::optional<Validation> Trainer::validate() {
  if (val_sets_.empty() && tasks_.empty()) return std::nullopt;
  // Each validation set in order, each data-parallel rank its part of every batch, through the
  // stages in turn (the last stage's losses).
  const auto& t = config_.train;
  const int T = int(config_.model.context_length), B = int(t.micro_batch_size);
  Validation result;
  for (const auto& [name, data] : val_sets_) {
    const data::SamplerOptions in_order{data->num_samples(), t.global_batch_size, B, data_comm_.world_size(),
                                        data_comm_.rank(), false, 0};
    data::BatchLoader loader(*data, in_order, {});
    const std::int64_t batches = std::min(t.eval_batches, data->num_samples() / t.global_batch_size);
    std::array<double, 2> totals = pipeline_->forward_only(loader, batches, B, T);
    data_comm_.all_reduce_sum(totals.data(), 2);
    result.sets.emplace_back(name, totals[0] / totals[1]);
    result.val_loss += result.sets.back().second / double(val_sets_.size());
  }
  if (!config_.data.val.named) result.sets.clear();  // one unnamed set: val_loss alone
  result.has_loss = !val_sets_.empty();
  if (!tasks_.empty()) {  // the whole model on the CPU on every rank: the examples spread over them
    host_weights();
    model::Model& scorer = device_ == Device::cpu ? *model_ : *host_;
    for (const auto& [task, examples] : tasks_) {
      const ChoiceResult scores = score_choices(scorer, *task_tokenizer_, examples, task.task, T,
                                                config_.model.vocab_size, &world_);
      const std::string name = task.metric_name();
      result.scores.emplace_back(name + "/acc", scores.acc);
      result.scores.emplace_back(name + "/acc_norm", scores.acc_norm);
      result.scores.emplace_back(name + "/acc_norm_bytes", scores.acc_norm_bytes);
    }
  }
  return result;
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

}  // namespace llmtrain::train
