#include "data/dataset.h"

#include <algorithm>

#include "core/error.h"

namespace llmtrain::data {

TokenDataset::TokenDataset(const std::vector<std::string>& paths, std::int64_t T, std::uint32_t vocab_size)
    : T_(T), vocab_size_(vocab_size) {
  offsets_.push_back(0);
  for (const auto& path : paths) {
    files_.emplace_back(path);
    // A sample needs T + 1 tokens; consecutive samples share one token.
    const std::int64_t samples = std::max<std::int64_t>(0, (files_.back().num_tokens() - 1) / T);
    offsets_.push_back(offsets_.back() + samples);
  }
}

std::int64_t TokenDataset::num_tokens() const {
  std::int64_t n = 0;
  for (const auto& f : files_) n += f.num_tokens();
  return n;
}

void TokenDataset::read_sample(std::int64_t index, std::int32_t* inputs, std::int32_t* targets) const {
  if (index < 0 || index >= num_samples()) {
    throw RuntimeError("TokenDataset: sample " + std::to_string(index) + " out of range");
  }
  const auto file = std::upper_bound(offsets_.begin(), offsets_.end(), index) - offsets_.begin() - 1;
  const std::int64_t local = index - offsets_[file];
  files_[file].read_tokens(local * T_, T_, vocab_size_, inputs);
  files_[file].read_tokens(local * T_ + 1, T_, vocab_size_, targets);
}

BatchLoader::BatchLoader(const TokenDataset& dataset, const SamplerOptions& options, SamplerState start,
                         std::vector<MixtureSource> sources, std::size_t queue_depth)
    : dataset_(dataset), micro_batch_(options.micro_batch), queue_depth_(std::max<std::size_t>(1, queue_depth)) {
  DistributedSampler sampler(options, start, std::move(sources));  // validates before the thread starts
  micro_steps_ = sampler.micro_steps();
  worker_ = std::thread(&BatchLoader::produce, this, std::move(sampler));
}

BatchLoader::~BatchLoader() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  worker_.join();
}

void BatchLoader::produce(DistributedSampler sampler) {
  const std::int64_t T = dataset_.context_length();
  std::vector<std::int64_t> indices(static_cast<std::size_t>(micro_batch_));
  try {
    while (true) {
      const SamplerState after_update = sampler.state_after_update();
      for (std::int64_t m = 0; m < micro_steps_; ++m) {
        MicroBatch batch;
        batch.micro_step = m;
        batch.after = after_update;
        batch.inputs.resize(static_cast<std::size_t>(micro_batch_ * T));
        batch.targets.resize(batch.inputs.size());
        sampler.micro_batch(m, indices);
        for (std::int64_t b = 0; b < micro_batch_; ++b) {
          dataset_.read_sample(indices[b], batch.inputs.data() + b * T, batch.targets.data() + b * T);
        }
        std::unique_lock lock(mutex_);
        changed_.wait(lock, [&] { return stopping_ || queue_.size() < queue_depth_; });
        if (stopping_) return;
        queue_.push_back(std::move(batch));
        changed_.notify_all();
      }
      sampler.advance();
    }
  } catch (...) {
    std::lock_guard lock(mutex_);
    error_ = std::current_exception();
    changed_.notify_all();
  }
}

MicroBatch BatchLoader::next() {
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [&] { return !queue_.empty() || error_; });
  if (queue_.empty()) std::rethrow_exception(error_);
  MicroBatch batch = std::move(queue_.front());
  queue_.pop_front();
  changed_.notify_all();
  return batch;
}

}  // namespace llmtrain::data
