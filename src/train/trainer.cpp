#include "train/trainer.h"

#include <algorithm>
#include <optional>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <filesystem>
#include <vector>

#include "core/error.h"
#include "core/files.h"
#include "data/shard.h"
#include "dist/file_work.h"
#include "eval/sequence_scoring.h"
#include "model/documents.h"
#include "ops/buffer.h"
#include "ops/moe_ops.h"
#include "ops/ops.h"
#include "ops/profile.h"
#include "optim/lr_schedule.h"
#include "optim/registry.h"
#include "parallel/attention_agreement.h"
#include "parallel/context_parallel_comm.h"
#include "parallel/expert_parallel_comm.h"
#include "parallel/gradient_strategy.h"
#include "parallel/pipeline_schedule.h"
#include "parallel/parallel_context.h"
#include "parallel/pipeline_stages.h"
#include "parallel/tensor_parallel_comm.h"

namespace llmtrain::train {

using dist::Axis;
namespace {

using Clock = std::chrono::steady_clock;

// The flat ranges of the whole model that this rank's local arrays `pieces` hold, in local order.
std::vector<model::FlatRange> logical_ranges(const std::vector<optim::Piece>& pieces, const model::Model& model) {
  std::vector<model::FlatRange> ranges;
  for (const parallel::Placed& p : parallel::place(pieces, model.segments(false))) ranges.push_back(p.logical);
  return ranges;
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
      comms_(comms),
      train_data_(data::expand_paths(config_.data.train.paths(), "data.train"), config_.model.context_length,
                  std::uint32_t(config_.model.vocab_size)),
      stages_(comms.mesh.size(Axis::pipeline)) {
  const auto& tc = config_.train;
  const int T = int(config_.model.context_length), B = int(tc.micro_batch_size);
  // The ranks of a context group read the same sequences: the sampler's ranks are the data index.
  context_ = comms.mesh.size(Axis::context);
  const int readers = comms_.readers(), reader = comms_.data_index();
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
    const auto shards = data::expand_paths(config_.data.train.paths(), "data.train");
    task_tokenizer_ = data::load_tokenizer(std::filesystem::path(shards.front()).parent_path().string());
    for (const config::EvalTask& task : tc.eval_tasks) {
      std::vector<eval::ChoiceExample> examples = eval::read_choice_file(task.path, task.task, task.limit);
      std::vector<eval::ChoiceSequence> sequences = eval::choice_sequences(*task_tokenizer_, examples, task.task, T);
      const eval::ScoringCost cost = eval::scoring_cost(
          sequences, B, T, eval::scoring_granule(context_, comms.mesh.size(Axis::tensor)));
      char note[256];
      std::snprintf(note, sizeof note,
                    "train.eval_tasks %s: %zu sequences in %lld micro-batches, %.3gM positions per validation "
                    "(padding each to the context: %.3gM)",
                    task.metric_name().c_str(), sequences.size(), static_cast<long long>(cost.micro_batches),
                    double(cost.positions) / 1e6, double(cost.positions_padded_to_context) / 1e6);
      task_notes_.push_back(note);
      tasks_.push_back({task, std::move(examples), std::move(sequences)});
    }
  }
  accum_ = config::grad_accum_steps(config_, readers);
  if (stages_ > 1) {
    accum_ = parallel::pipeline_micro_batches(config_, readers);  // at least one per stage
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
      data::SamplerOptions{train_data_.num_samples(), tc.global_batch_size, B, readers, reader, config_.data.shuffle, std::uint64_t(config_.data.seed)},
      sampler_state_, sources);
  if (sources.size() >= 2) {  // tokens per source, counted along (from the resumed position)
    std::vector<double> weights;
    for (const auto& source : sources) weights.push_back(source.weight);
    source_counts_.emplace(weights, sampler_state_.next_sample);
  }

  // Process-wide, as the kernels read it: train.deterministic false lets the bf16 flash attention
  // backward take its single pass (dQ by atomics).
  ops::set_deterministic(tc.deterministic);
  attention_ = parallel::resolve_attention_on_every_rank(config_, device_, *comms_.world);
  parallel_ = std::make_unique<parallel::ParallelContext>(config_, comms, device_);
  model_ = model::make_model(config_.model, device_, tc.recompute, model::precision_dtype(tc.precision),
                             attention_.kernels, parallel_->layout());
  model_->set_documents(model::documents_for(config_.data, config_.model,
                                             model::shard_folder(config_.data.train.paths(), "data.train"), device_));
  pipeline_ = std::make_unique<parallel::PipelineExecutor>(*model_, config_, comms_.host(Axis::pipeline), comms_.device(Axis::pipeline), int(accum_));
  parallel_->attach(*model_);
  gradients_ = parallel::make_gradient_strategy(*model_, config_.dist, comms_.device(Axis::data), comms_.host(Axis::data),
                                                parallel_->norm_scope(*model_), parallel_->expert_scope(*model_));
  // This rank's model is not the whole one.
  if (parallel_->partial_model()) {
    logical_ = model::make_model(config_.model, Device::cpu, model::Recompute::none, DType::f32,
                                 ops::AttentionKernels::flash, model::Layout{true});
  }
  optimizer_ = optim::make_optimizer(config_.optim, model_->param_infos(), gradients_->pieces(), device_);
  const std::vector<optim::StateTensor> optimizer_state = optimizer_->state();
  // Every rank reads or computes only the state it keeps, and all agree that each could: a damaged
  // checkpoint found by one rank stops every rank alike (a resume may then try an older one). The
  // file work runs on a thread of its own (host memory only) while this one keeps the rank heard,
  // and the agreement waits, under patience, for ranks that read longer (dist/file_work.h).
  std::string damaged;
  const Tensor held = gradients_->held_weights();
  std::vector<float> weights(held.device == Device::cpu ? 0 : std::size_t(held.numel()));
  // The optimizer's state tensors, read by their names into host arrays.
  std::vector<std::vector<float>> state(resume ? optimizer_state.size() : 0,
                                        std::vector<float>(std::size_t(optimizer_->size())));
  std::vector<std::string> state_names;
  std::vector<float*> state_arrays;
  for (std::size_t k = 0; k < state.size(); ++k) {
    state_names.push_back(optimizer_state[k].name);
    state_arrays.push_back(state[k].data());
  }
  std::size_t init_bytes = 0;
  dist::run_keeping_alive(*comms_.world, [&] {
    try {
      init_bytes = load_initial_weights(resume, held.device == Device::cpu ? held.as<float>() : weights.data());
      if (resume) {
        checkpoint::load_state(*resume, checkpoint::StateKind::optimizer,
                               logical_ranges(optimizer_->pieces(), *model_), state_arrays, state_names);
      }
    } catch (const checkpoint::DamagedCheckpoint& e) {
      damaged = e.what();
    }
  });
  std::int64_t failed = damaged.empty() ? -1 : comms_.world->rank();
  {
    const double bytes = 4.0 * double(1 + optimizer_state.size()) * double(num_params());
    const dist::Patience patience(*comms_.world, dist::file_work_limit_s(config_.dist.timeout_s, bytes));
    comms_.world->all_reduce_max(&failed, 1);
  }
  if (failed < 0) {
    const std::int64_t n = held.numel(), k = optimizer_->size();
    if (!weights.empty()) ops::copy(held, Tensor(weights.data(), DType::f32, Device::cpu, {n}));
    gradients_->weights_loaded();
    for (std::size_t i = 0; i < state.size(); ++i) {  // read laid out like the weights
      const optim::StateTensor& into = optimizer_state[i];
      if (into.layout == optim::StateLayout::like_params) {
        ops::copy(into.tensor, Tensor(state[i].data(), DType::f32, Device::cpu, {k}));
        continue;
      }
      std::int64_t at = 0;  // a tensor holding some runs only: those
      for (const model::FlatRange& run : into.held) {
        ops::copy(Tensor(into.tensor.as<float>() + at, DType::f32, into.tensor.device, {run.size()}),
                  Tensor(state[i].data() + run.begin, DType::f32, Device::cpu, {run.size()}));
        at += run.size();
      }
    }
  }
  if (!damaged.empty()) throw checkpoint::DamagedCheckpoint(damaged);
  if (!resume && !config_.model.init_from.empty()) {
    const double kept = 4.0 * double(held.numel()), mib = 1024.0 * 1024.0;
    char note[160];
    std::snprintf(note, sizeof note, "read %.1f MiB of tensor data for the %.1f MiB of weights it keeps (%.2fx)",
                  double(init_bytes) / mib, kept / mib, kept > 0 ? double(init_bytes) / kept : 0.0);
    init_note_ = note;
  }
  if (failed >= 0) {
    throw checkpoint::DamagedCheckpoint(resume->dir + ": rank " + std::to_string(failed) +
                                        " found part of the checkpoint damaged");
  }
}

std::size_t Trainer::load_initial_weights(const checkpoint::Found* resume, float* to) const {
  // The runs of the whole model this rank keeps, and where each goes in its held weights.
  const std::vector<parallel::Placed> placed = parallel::place(gradients_->held(), model_->segments(false));
  // Runs that follow each other in the held weights are read in one call.
  std::vector<std::pair<std::int64_t, std::vector<model::FlatRange>>> batches;  // (local start, runs)
  std::int64_t batch_end = -1;
  for (const parallel::Placed& p : placed) {
    if (p.local != batch_end) batches.push_back({p.local, {}});
    batches.back().second.push_back(p.logical);
    batch_end = p.local + p.logical.size();
  }
  const model::Model& whole = logical_model();
  std::size_t init_bytes = 0;
  // One reader for every batch: each file's header and ranges are read once, and only the files
  // that hold this rank's runs are opened.
  std::optional<checkpoint::StateReader> reader;
  if (resume) reader.emplace(*resume, checkpoint::StateKind::weights);
  for (const auto& [local, ranges] : batches) {
    if (resume) {
      reader->read(ranges, {to + local});
    } else if (!config_.model.init_from.empty()) {
      init_bytes += checkpoint::import_hf_ranges(config_.model.init_from, whole, ranges, to + local);
    } else {
      std::int64_t at = local;
      for (const model::FlatRange& r : ranges) {
        model_->init_range(std::uint64_t(config_.train.seed), r, to + at);
        at += r.size();
      }
    }
  }
  return init_bytes;
}

const model::Model& Trainer::logical_model() const { return logical_ ? *logical_ : *model_; }

std::vector<parallel::Placed> Trainer::optimizer_placement() const {
  return parallel::place(optimizer_->pieces(), model_->segments(true));
}

bool Trainer::writes_optimizer() const {
  // Ranks of one data-parallel group hold the same state unless ZeRO shards it.
  return comms_.host(Axis::data).rank() == 0 || gradients_->shards_optimizer();
}

std::size_t Trainer::state_bytes() const {
  return model_->state_bytes() + optimizer_->state_bytes() + gradients_->state_bytes();
}

void Trainer::take_moe_stats(StepResult& result) {
  const model::MoeStats s = model_->take_moe_stats();
  double sums[4] = {s.aux, s.z, s.dropped, double(s.forwards)};
  float most = float(s.imbalance);
  // Over every rank that reads its own batches (the data group's, then the expert group's) and
  // every pipeline stage (each adds its layers' share; the one holding the first MoE layer counts
  // the forwards). The tensor group's ranks compute the same.
  std::vector<dist::Communicator*> groups;
  for (const Axis a : {Axis::data, Axis::expert, Axis::pipeline}) {
    if (comms_.host(a).world_size() > 1) groups.push_back(&comms_.host(a));
  }
  for (dist::Communicator* group : groups) {
    group->all_reduce_sum(sums, 4);
    group->all_reduce_max(&most, 1);
  }
  const double forwards = std::max(sums[3], 1.0);
  result.moe = true;
  result.aux_loss = sums[0] / forwards;
  result.z_loss = sums[1] / forwards;
  result.dropped_frac = sums[2] / forwards;
  result.load_imbalance = most;
  moe_loads_ = s.loads;  // the global batch's: every rank the same
  moe_loads_.resize(std::size_t((config_.model.n_layer - config_.model.moe.first_dense_layers) * config_.model.moe.experts));
  if (!moe_loads_.empty()) {
    for (dist::Communicator* group : groups) group->all_reduce_sum(moe_loads_.data(), std::int64_t(moe_loads_.size()));
  }
}

void Trainer::update_expert_bias() {
  // Each MoE layer's bias (a parameter the optimizer leaves bit for bit: no gradient, no weight
  // decay) moves where its master copy lives: this rank's pieces, a ZeRO shard's part of it
  // included; ZeRO 1/2's all-gather and ZeRO 3's gathers then bring every rank's working copy.
  const config::MoeConfig& moe = config_.model.moe;
  const std::int64_t E = moe.experts;
  const Tensor master = gradients_->master();
  for (std::int64_t l = moe.first_dense_layers; l < config_.model.n_layer; ++l) {
    const std::string name = "model.layers." + std::to_string(l) + ".mlp.gate.e_score_correction_bias";
    if (!model_->has_param(name)) continue;
    const std::int64_t begin = model_->param_info(name).offset, end = begin + E;
    const double* loads = moe_loads_.data() + (l - moe.first_dense_layers) * E;
    double mean = 0.0;
    for (std::int64_t e = 0; e < E; ++e) mean += loads[e] / double(E);
    for (const optim::Piece& piece : gradients_->pieces()) {
      const std::int64_t lo = std::max(begin, piece.begin), hi = std::min(end, piece.end);
      if (lo >= hi) continue;
      std::vector<float> part(loads + (lo - begin), loads + (hi - begin));
      ops::Buffer on_device(master.device, part.size() * sizeof(float));
      const Tensor part_loads(on_device.data(), DType::f32, master.device, {hi - lo});
      ops::copy(part_loads, Tensor(part.data(), DType::f32, Device::cpu, {hi - lo}));
      const Tensor bias(master.as<float>() + piece.local + (lo - piece.begin), DType::f32, master.device, {hi - lo});
      ops::moe_bias_update(bias, part_loads, float(mean), float(moe.bias_update_rate));
    }
  }
}

StepResult Trainer::step(std::int64_t step) {
  const auto start = Clock::now();
  const auto& tc = config_.train;
  dist::PerAxis<dist::Traffic> sent_before;
  for (const dist::AxisRow& row : dist::mesh_axes) sent_before[row.axis] = comms_.traffic(row.axis);
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
  model_->take_moe_stats();  // the validations' forwards since the last update do not count
  // The micro-steps' losses add up on the model's device and are read once, after the last
  // one: a micro-step never waits for the GPU to finish its forward pass.
  model_->defer_loss(true);
  // d(mean loss over the whole update)/dlogits: each micro-step adds 1 / (G T) per position.
  double loss_sum = pipeline_->forward_backward(batch, float(1.0 / tokens_per_step_), gradients_.get(),
                                                result.pipeline_wait_s);
  comms_.device(Axis::tensor).wait_queued();  // the tensor group's collectives, ordered on the compute stream: checked here
  comms_.device(Axis::context).wait_queued();  // the context ring's exchanges, likewise
  loss_sum += model_->take_loss_sum();
  model_->defer_loss(false);
  pipeline_->reduce_over_stages(loss_sum);  // the last stage's loss; a tied embedding's gradients
  // loss_sum is then over all ranks
  result.grad_norm = gradients_->finish(loss_sum);
  if (comms_.mesh.size(Axis::expert) > 1) {  // the expert group's ranks read batches of their own
    comms_.host(Axis::expert).all_reduce_sum(&loss_sum, 1);
  }
  result.loss = loss_sum / tokens_per_step_;
  if (config_.model.moe.enabled) take_moe_stats(result);
  result.lr = optim::learning_rate(config_.optim, tc.max_steps, step);
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
  if (config_.model.moe.enabled && config_.model.moe.bias_update_rate > 0) update_expert_bias();
  optimizer_->update({model_->param_infos(), gradients_->master(), gradients_->grads(), result.grad_norm, tc.grad_clip,
                      result.lr, step, gradients_->working_weights(),
                      gradients_->shards_optimizer() ? &comms_.device(Axis::data) : nullptr,
                      comms_.host(Axis::tensor).world_size() > 1 ? &comms_.device(Axis::tensor) : nullptr});
  gradients_->weights_updated();
  // Replicas of one part of the model (the ranks of a data-parallel group) can drift apart;
  // shards have nothing to compare.
  const auto every = config_.dist.replica_check_every;
  if (gradients_->replicated() && comms_.host(Axis::data).world_size() > 1 && every > 0 && step % every == 0) {
    parallel::check_replicas(comms_.host(Axis::data), model_->params(), step);
  }
  for (const dist::AxisRow& row : dist::mesh_axes) {
    result.sent[row.axis] = comms_.traffic(row.axis).since(sent_before[row.axis]);
  }
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
    const data::SamplerOptions in_order{data->num_samples(), t.global_batch_size, B, comms_.readers(),
                                        comms_.data_index(), false, 0};
    data::BatchLoader loader(*data, in_order, {});
    const std::int64_t batches = std::min(t.eval_batches, data->num_samples() / t.global_batch_size);
    std::array<double, 2> totals = pipeline_->forward_only(loader, batches, B, T);
    comms_.host(Axis::data).all_reduce_sum(totals.data(), 2);
    if (comms_.mesh.size(Axis::expert) > 1) comms_.host(Axis::expert).all_reduce_sum(totals.data(), 2);
    // Each rank of a context group counted the whole sequences of which it holds 1 / context_.
    result.sets.emplace_back(name, totals[0] / (totals[1] / double(context_)));
    result.val_loss += result.sets.back().second / double(val_sets_.size());
  }
  if (!config_.data.val.named) result.sets.clear();  // one unnamed set: val_loss alone
  result.has_loss = !val_sets_.empty();
  for (const auto& [task, examples, sequences] : tasks_) {
    const eval::ChoiceResult scores = eval::choice_result(examples, sequences, sequence_logliks(sequences), task.task);
    const std::string name = task.metric_name();
    for (const auto& [metric, value] : scores.scores) result.scores.emplace_back(name + "/" + metric, value);
    result.tasks.emplace_back(name, scores);
  }
  return result;
}

std::vector<double> Trainer::sequence_logliks(const std::vector<eval::ChoiceSequence>& sequences) {
  // The validation's path through the stages, each data-parallel rank its share; the ranks of a
  // tensor group pass the same micro-batches and one of them counts the losses.
  eval::ScoringRank rank;
  rank.readers = comms_.readers();
  rank.reader = comms_.data_index();
  rank.context_rank = comms_.device(Axis::context).rank();
  rank.context_size = context_;
  rank.tensor_size = comms_.mesh.size(Axis::tensor);
  rank.counts = comms_.host(Axis::tensor).rank() == 0;
  rank.micro_batches = accum_;
  return eval::sequence_logliks(*pipeline_, *model_, sequences, int(config_.train.micro_batch_size),
                                config_.model.context_length, rank, *comms_.world);
}

}  // namespace llmtrain::train
