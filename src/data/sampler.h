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
//
// Mixtures. With two or more weighted sources the order is one stream without epochs: position p
// takes the next sample of the source the Blender picks for p (below), and the k-th sample taken
// from source s is position k % N_s of that source's own order of epoch k / N_s (a Fisher-Yates
// shuffle as above, its state offset by s x the golden-ratio constant 0x9E3779B97F4A7C15, so
// that every source is reshuffled per epoch on its own). Update k uses positions [k G, (k+1) G)
// of the stream, split among ranks as above; no sample is skipped. The state is the position
// (SamplerState{0, k G}): resuming replays the Blender's counts up to it, a few nanoseconds per
// sample, and holds no buffer.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

namespace llmtrain::data {

/// Where the sampler stands: the epoch and the position in its order of the next update.
struct SamplerState {
  std::int64_t epoch = 0;
  std::int64_t next_sample = 0;
  bool operator==(const SamplerState&) const = default;
};

/// The blending rule of a mixture: position p goes to the source furthest below its share of the
/// positions 0..p, i.e. with the largest w_s (p + 1) - c_s (c_s: positions given to s before p;
/// the lowest index on a tie). The shares are held as integers, the normalised weights rounded
/// to multiples of 10^-15, so the order is the same on every machine and decimal weights (0.7,
/// 0.2, 0.1) or integer ones (7, 2, 1) tie exactly where their shares do. Every prefix of n
/// positions holds each source's w_s n samples to within half a sample for two sources, within
/// 0.6 for weights (0.7, 0.2, 0.1); many sources of very unequal weights stray further (up to
/// about 1.4 samples measured with ten).
class Blender {
 public:
  /// Weights > 0 (any scale); starts at `position`, replaying the rule from position 0.
  explicit Blender(const std::vector<double>& weights, std::int64_t position = 0);
  /// The source of position(), then moves to the next position.
  int next();
  std::int64_t position() const { return position_; }
  /// Positions given to each source so far (before position()).
  const std::vector<std::int64_t>& counts() const { return counts_; }

 private:
  std::vector<std::int64_t> shares_;   // q_s: the weights scaled to integers
  std::int64_t total_ = 0;             // Q: their sum
  std::vector<std::int64_t> deficit_;  // q_s position - c_s Q
  std::vector<std::int64_t> counts_;
  std::int64_t position_ = 0;
};

/// One source of a mixture: a contiguous range of the dataset's samples and its weight.
struct MixtureSource {
  std::int64_t first_sample = 0;
  std::int64_t num_samples = 0;
  double weight = 1.0;
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
  /// Throws InputError when there are fewer samples than one global batch (a mixture: a source
  /// without samples) or G is not a multiple of B W.
  /// With two or more `sources`, a weighted mixture of them (options.num_samples: their sum).
  explicit DistributedSampler(const SamplerOptions& options, SamplerState start = {},
                              std::vector<MixtureSource> sources = {});

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
  /// `stream` s > 0 gives a mixture's source s its own orders (0: a single source's).
  static std::vector<std::int64_t> epoch_order(std::int64_t num_samples, bool shuffle, std::uint64_t seed,
                                               std::int64_t epoch, std::uint64_t stream = 0);

  bool mixture() const { return sources_.size() >= 2; }

 private:
  void fill_block();  // a mixture: the current update's G sample indices

  SamplerOptions options_;
  std::vector<MixtureSource> sources_;
  std::int64_t micro_steps_;
  SamplerState state_;
  std::vector<std::int64_t> order_;  // of state_.epoch (a single source)
  // A mixture: the Blender at the end of the current update, each source's order of its
  // current epoch, and the current update's samples.
  std::optional<Blender> blender_;
  std::vector<std::vector<std::int64_t>> source_orders_;
  std::vector<std::int64_t> source_epochs_;
  std::vector<std::int64_t> block_;
};

}  // namespace llmtrain::data
