#include "data/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <utility>

#include "core/error.h"
#include "core/rng.h"

namespace llmtrain::data {

Blender::Blender(const std::vector<double>& weights, std::int64_t position) {
  double sum = 0.0;
  for (const double w : weights) {
    if (!(w > 0.0) || !std::isfinite(w)) throw RuntimeError("Blender: weights must be finite and > 0");
    sum += w;
  }
  if (weights.empty()) throw RuntimeError("Blender: no sources");
  for (const double w : weights) {
    shares_.push_back(std::max<std::int64_t>(1, std::llround(w / sum * 1e15)));
    total_ += shares_.back();
  }
  deficit_.assign(weights.size(), 0);
  counts_.assign(weights.size(), 0);
  while (position_ < position) next();
}

int Blender::next() {
  int best = 0;
  for (std::size_t s = 0; s < shares_.size(); ++s) {
    deficit_[s] += shares_[s];
    if (deficit_[s] > deficit_[std::size_t(best)]) best = int(s);
  }
  deficit_[std::size_t(best)] -= total_;
  ++counts_[std::size_t(best)];
  ++position_;
  return best;
}

std::vector<std::int64_t> DistributedSampler::epoch_order(std::int64_t num_samples, bool shuffle,
                                                          std::uint64_t seed, std::int64_t epoch,
                                                          std::uint64_t stream) {
  std::vector<std::int64_t> order(static_cast<std::size_t>(num_samples));
  std::iota(order.begin(), order.end(), std::int64_t{0});
  if (!shuffle) return order;
  std::uint64_t state = (seed << 32) + static_cast<std::uint64_t>(epoch) + stream * 0x9E3779B97F4A7C15ull;
  for (std::int64_t i = num_samples - 1; i > 0; --i) {
    const auto j = static_cast<std::int64_t>(bounded(splitmix64(state), static_cast<std::uint64_t>(i + 1)));
    std::swap(order[i], order[j]);
  }
  return order;
}

DistributedSampler::DistributedSampler(const SamplerOptions& options, SamplerState start,
                                       std::vector<MixtureSource> sources)
    : options_(options), sources_(std::move(sources)), state_(start) {
  const auto& o = options_;
  const std::int64_t per_micro_step = o.micro_batch * o.world_size;
  if (o.global_batch % per_micro_step != 0) {
    throw InputError("train.global_batch_size: must be a multiple of train.micro_batch_size x data-parallel size (" +
                     std::to_string(o.micro_batch) + " x " + std::to_string(o.world_size) + "), got " +
                     std::to_string(o.global_batch));
  }
  micro_steps_ = o.global_batch / per_micro_step;
  if (mixture()) {
    std::vector<double> weights;
    for (std::size_t s = 0; s < sources_.size(); ++s) {
      if (sources_[s].num_samples < 1) {
        throw InputError("data.train[" + std::to_string(s) + "]: its shards hold no sample (" +
                         "model.context_length + 1 tokens)");
      }
      weights.push_back(sources_[s].weight);
    }
    if (state_.epoch != 0 || state_.next_sample < 0 || state_.next_sample % o.global_batch != 0) {
      throw InputError("sampler state (epoch " + std::to_string(state_.epoch) + ", next sample " +
                       std::to_string(state_.next_sample) + ") is not a position of a weighted mixture " +
                       "(epoch 0, a multiple of the global batch)");
    }
    blender_.emplace(weights, state_.next_sample);
    source_orders_.resize(sources_.size());
    source_epochs_.assign(sources_.size(), -1);
    fill_block();
    return;
  }
  if (o.num_samples < o.global_batch) {
    throw InputError("the data has " + std::to_string(o.num_samples) + " samples, fewer than one global batch (" +
                     std::to_string(o.global_batch) + ")");
  }
  if (state_.epoch < 0 || state_.next_sample < 0 || state_.next_sample % o.global_batch != 0 ||
      state_.next_sample / o.global_batch >= updates_per_epoch()) {
    throw InputError("sampler state (epoch " + std::to_string(state_.epoch) + ", next sample " +
                     std::to_string(state_.next_sample) + ") does not fit this data and global batch");
  }
  order_ = epoch_order(o.num_samples, o.shuffle, o.seed, state_.epoch);
}

void DistributedSampler::micro_batch(std::int64_t m, std::span<std::int64_t> out) const {
  const auto& o = options_;
  if (m < 0 || m >= micro_steps_ || std::int64_t(out.size()) != o.micro_batch) {
    throw RuntimeError("DistributedSampler::micro_batch: bad micro-step or output size");
  }
  const std::int64_t offset = (m * o.world_size + o.rank) * o.micro_batch;
  if (mixture()) {
    for (std::int64_t b = 0; b < o.micro_batch; ++b) out[b] = block_[std::size_t(offset + b)];
    return;
  }
  const std::int64_t first = state_.next_sample + offset;
  for (std::int64_t b = 0; b < o.micro_batch; ++b) out[b] = order_[first + b];
}

void DistributedSampler::fill_block() {
  const auto& o = options_;
  block_.resize(std::size_t(o.global_batch));
  for (auto& sample : block_) {
    const auto s = std::size_t(blender_->next());
    const MixtureSource& source = sources_[s];
    const std::int64_t k = blender_->counts()[s] - 1;  // the k-th sample taken from s
    const std::int64_t epoch = k / source.num_samples;
    if (epoch != source_epochs_[s]) {
      source_orders_[s] = epoch_order(source.num_samples, o.shuffle, o.seed, epoch, s);
      source_epochs_[s] = epoch;
    }
    sample = source.first_sample + source_orders_[s][std::size_t(k % source.num_samples)];
  }
}

SamplerState DistributedSampler::state_after_update() const {
  if (mixture()) return {0, state_.next_sample + options_.global_batch};
  const std::int64_t next = state_.next_sample + options_.global_batch;
  if (next / options_.global_batch >= updates_per_epoch()) return {state_.epoch + 1, 0};
  return {state_.epoch, next};
}

void DistributedSampler::advance() {
  const SamplerState next = state_after_update();
  if (mixture()) {
    state_ = next;
    fill_block();
    return;
  }
  if (next.epoch != state_.epoch) {
    order_ = epoch_order(options_.num_samples, options_.shuffle, options_.seed, next.epoch);
  }
  state_ = next;
}

}  // namespace llmtrain::data
