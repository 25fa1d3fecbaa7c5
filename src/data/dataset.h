// Samples of T + 1 tokens over a list of shard files, and the background loader that feeds them.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "data/sampler.h"
#include "data/shard.h"

namespace llmtrain::data {

/// Sample i of a file is its tokens [i T, i T + T] (inputs: the first T, targets: the last T);
/// the samples of several files follow one another in file order.
class TokenDataset {
 public:
  TokenDataset(const std::vector<std::string>& paths, std::int64_t T, std::uint32_t vocab_size);

  std::int64_t num_samples() const { return offsets_.back(); }
  std::int64_t context_length() const { return T_; }
  std::int64_t num_tokens() const;
  /// The index of the first sample of file `file` (the total for file = the number of files).
  std::int64_t samples_before(std::size_t file) const { return offsets_.at(file); }

  /// inputs, targets: (T,) each. Checks every token against the vocabulary (InputError).
  void read_sample(std::int64_t index, std::int32_t* inputs, std::int32_t* targets) const;

 private:
  std::vector<ShardFile> files_;
  std::vector<std::int64_t> offsets_;  // first sample index of each file, and the total last
  std::int64_t T_;
  std::uint32_t vocab_size_;
};

/// One rank's part of one micro-step: B sequences of T tokens.
struct MicroBatch {
  std::int64_t micro_step = 0;
  std::vector<std::int32_t> inputs;   // (B, T)
  std::vector<std::int32_t> targets;  // (B, T)
  SamplerState after;                 // the sampler's state once this micro-step's update is done
};

/// Reads micro-batches on a background thread into a bounded queue, so that a training step
/// never waits on reading. Errors in the thread (a bad token, say) surface from next().
class BatchLoader {
 public:
  /// `sources`: a weighted mixture of ranges of the dataset's samples (DistributedSampler).
  BatchLoader(const TokenDataset& dataset, const SamplerOptions& options, SamplerState start,
              std::vector<MixtureSource> sources = {}, std::size_t queue_depth = 4);
  ~BatchLoader();
  BatchLoader(const BatchLoader&) = delete;
  BatchLoader& operator=(const BatchLoader&) = delete;

  /// The next micro-batch of this rank, in order (blocks until it is ready).
  MicroBatch next();
  std::int64_t micro_steps() const { return micro_steps_; }

 private:
  void produce(DistributedSampler sampler);

  const TokenDataset& dataset_;
  std::int64_t micro_batch_;
  std::int64_t micro_steps_;
  std::size_t queue_depth_;

  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<MicroBatch> queue_;
  std::exception_ptr error_;
  bool stopping_ = false;
  std::thread worker_;
};

}  // namespace llmtrain::data
