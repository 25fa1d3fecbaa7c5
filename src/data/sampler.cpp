#include "data/sampler.h"

#include <numeric>
#include <string>
#include <utility>

#include "core/error.h"
#include "core/rng.h"

namespace llmtrain::data {

std::vector<std::int64_t> DistributedSampler::epoch_order(std::int64_t num_samples, bool shuffle,
                                                          std::uint64_t seed, std::int64_t epoch) {
  std::vector<std::int64_t> order(static_cast<std::size_t>(num_samples));
  std::iota(order.begin(), order.end(), std::int64_t{0});
  if (!shuffle) return order;
  std::uint64_t state = (seed << 32) + static_cast<std::uint64_t>(epoch);
  for (std::int64_t i = num_samples - 1; i > 0; --i) {
    const auto j = static_cast<std::int64_t>(bounded(splitmix64(state), static_cast<std::uint64_t>(i + 1)));
    std::swap(order[i], order[j]);
  }
  return order;
}

DistributedSampler::DistributedSampler(const SamplerOptions& options, SamplerState start)
    : options_(options), state_(start) {
  const auto& o = options_;
  const std::int64_t per_micro_step = o.micro_batch * o.world_size;
  if (o.global_batch % per_micro_step != 0) {
    throw InputError("train.global_batch_size: must be a multiple of train.micro_batch_size x data-parallel size (" +
                     std::to_string(o.micro_batch) + " x " + std::to_string(o.world_size) + "), got " +
                     std::to_string(o.global_batch));
  }
  if (o.num_samples < o.global_batch) {
    throw InputError("the data has " + std::to_string(o.num_samples) + " samples, fewer than one global batch (" +
                     std::to_string(o.global_batch) + ")");
  }
  micro_steps_ = o.global_batch / per_micro_step;
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
  const std::int64_t first = state_.next_sample + (m * o.world_size + o.rank) * o.micro_batch;
  for (std::int64_t b = 0; b < o.micro_batch; ++b) out[b] = order_[first + b];
}

SamplerState DistributedSampler::state_after_update() const {
  const std::int64_t next = state_.next_sample + options_.global_batch;
  if (next / options_.global_batch >= updates_per_epoch()) return {state_.epoch + 1, 0};
  return {state_.epoch, next};
}

void DistributedSampler::advance() {
  const SamplerState next = state_after_update();
  if (next.epoch != state_.epoch) {
    order_ = epoch_order(options_.num_samples, options_.shuffle, options_.seed, next.epoch);
  }
  state_ = next;
}

}  // namespace llmtrain::data
