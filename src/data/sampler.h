// The distributed sampler: which samples each rank reads for each micro-step of each update.
//
// Order. Epoch e visits the N samples in a permutation that depends only on (seed, e): a
// Fisher-Yates shuffle (i from N-1 down to 1 swaps i with j = bounded(splitmix64(s), i + 1)),
// with the SplitMix64 state s starting at seed * 2^32 + e. Without shuffling the order is 0..N-1.
//
// Updates. Update k of an epoch uses positions [k G, (k+1) G) of that order (G = global batch).
// Position p of an update goes to rank r = (p / B) % W at micro-step m = p / (B W), as element
// b = p % B of its micro-batch (B = micro batch, W = world size). So every world size splits the
// same G samples, only differently. The N % G samples left at the end of an epoch are skipped,
// and the next epoch is reshuffled.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace llmtrain::data {

/// Where the sampler stands: the epoch and the position in its order of the next update.
struct SamplerState {
  std::int64_t epoch = 0;
  std::int64_t next_sample = 0;
  bool operator==(const SamplerState&) const = default;
};

struct SamplerOptions {
  std::int64_t num_samples = 0;
  std::int64_t global_batch = 1;  // G
  std::int64_t micro_batch = 1;   // B
  int world_size = 1;             // W
  int rank = 0;
  bool shuffle = true;
  std::uint64_t seed = 0;
};

class DistributedSampler {
 public:
  /// Throws InputError when there are fewer samples than one global batch or G is not a multiple of B W.
  explicit DistributedSampler(const SamplerOptions& options, SamplerState start = {});

  std::int64_t micro_steps() const { return micro_steps_; }
  std::int64_t updates_per_epoch() const { return options_.num_samples / options_.global_batch; }
  SamplerState state() const { return state_; }

  /// This rank's B sample indices for micro-step `m` of the current update.
  void micro_batch(std::int64_t m, std::span<std::int64_t> out) const;

  /// The state advance() will move to.
  SamplerState state_after_update() const;

  /// Moves to the next update (and to the next epoch, reshuffled, at the end of this one).
  void advance();

  /// The visiting order of `epoch` (exposed for tests and documentation).
  static std::vector<std::int64_t> epoch_order(std::int64_t num_samples, bool shuffle, std::uint64_t seed,
                                               std::int64_t epoch);

 private:
  SamplerOptions options_;
  std::int64_t micro_steps_;
  SamplerState state_;
  std::vector<std::int64_t> order_;  // of state_.epoch
};

}  // namespace llmtrain::data
