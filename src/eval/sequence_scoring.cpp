#include "eval/sequence_scoring.h"

#include <algorithm>
#include <numeric>

#include "core/error.h"
#include "parallel/context_attention.h"
#include "ops/ops.h"

namespace llmtrain::eval {
namespace {

std::int64_t positions_of(const ChoiceSequence& sequence) { return std::int64_t(sequence.tokens.size()) - 1; }

}  // namespace

int scoring_granule(int context_size, int tensor_size) {
  return int(std::lcm(std::lcm(std::int64_t(64), 2 * std::int64_t(context_size)), std::int64_t(tensor_size)));
}

std::vector<ScoringBatch> scoring_batches(const std::vector<ChoiceSequence>& sequences, int B,
                                          std::int64_t context_length, int granule) {
  std::vector<std::int64_t> order(sequences.size());
  std::iota(order.begin(), order.end(), std::int64_t{0});
  std::stable_sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) {
    return positions_of(sequences[std::size_t(a)]) > positions_of(sequences[std::size_t(b)]);
  });
  std::vector<ScoringBatch> batches;
  for (std::size_t at = 0; at < order.size(); at += std::size_t(B)) {
    ScoringBatch batch;
    batch.sequences.assign(order.begin() + std::ptrdiff_t(at),
                           order.begin() + std::ptrdiff_t(std::min(order.size(), at + std::size_t(B))));
    const std::int64_t longest = positions_of(sequences[std::size_t(batch.sequences.front())]);
    if (longest < 1 || longest > context_length) {
      throw RuntimeError("scoring: a sequence of " + std::to_string(longest) + " positions outside the context (" +
                         std::to_string(context_length) + ")");
    }
    batch.T = int(std::min(context_length, (longest + granule - 1) / granule * granule));
    batches.push_back(std::move(batch));
  }
  return batches;
}

ScoringCost scoring_cost(const std::vector<ChoiceSequence>& sequences, int B, std::int64_t context_length,
                         int granule) {
  ScoringCost cost;
  for (const ScoringBatch& batch : scoring_batches(sequences, B, context_length, granule)) {
    ++cost.micro_batches;
    cost.positions += std::int64_t(B) * batch.T;
  }
  cost.positions_padded_to_context = cost.micro_batches * B * context_length;
  return cost;
}

std::vector<double> sequence_logliks(parallel::PipelineExecutor& pipeline, model::Model& model,
                                     const std::vector<ChoiceSequence>& sequences, int B, std::int64_t context_length,
                                     const ScoringRank& rank, dist::Communicator& world) {
  const int granule = rank.granule > 0 ? rank.granule : scoring_granule(rank.context_size, rank.tensor_size);
  const std::vector<ScoringBatch> batches = scoring_batches(sequences, B, context_length, granule);
  const auto total = std::int64_t(batches.size());
  const std::int64_t mine = (total + rank.readers - 1) / rank.readers;  // global g = j readers + reader, j < mine
  // Context parallelism: this rank's positions of each sequence, as the model keeps them.
  const parallel::ContextAttention split(rank.context_rank, rank.context_size, true, Device::cpu, DType::f32);
  std::vector<double> logliks(sequences.size(), 0.0);
  std::vector<std::int32_t> ending, local_ending;  // (B, T): 1 where a position predicts an ending token
  std::vector<float> losses;
  for (std::int64_t j0 = 0; j0 < mine; j0 += rank.micro_batches) {
    const std::int64_t j1 = std::min(mine, j0 + rank.micro_batches);
    // One length for the pass: its longest micro-batch's (the first: longest first), or the
    // shortest there is for a pass of padding only.
    int T = granule > context_length ? int(context_length) : granule;
    for (std::int64_t j = j0; j < j1; ++j) {
      const std::int64_t g = j * rank.readers + rank.reader;
      if (g < total) T = std::max(T, batches[std::size_t(g)].T);
    }
    const int Tl = T / rank.context_size;
    std::vector<data::MicroBatch> micro;
    std::vector<std::vector<std::int32_t>> endings;
    for (std::int64_t j = j0; j < j1; ++j) {
      const std::int64_t g = j * rank.readers + rank.reader;
      data::MicroBatch batch;
      batch.inputs.assign(std::size_t(B) * T, 0);
      batch.targets.assign(std::size_t(B) * T, 0);
      ending.assign(std::size_t(B) * T, 0);
      if (g < total) {
        const std::vector<std::int64_t>& rows = batches[std::size_t(g)].sequences;
        for (std::size_t b = 0; b < rows.size(); ++b) {
          const ChoiceSequence& sequence = sequences[std::size_t(rows[b])];
          const std::int64_t L = positions_of(sequence);
          for (std::int64_t t = 0; t < L; ++t) {
            const std::size_t at = b * std::size_t(T) + std::size_t(t);
            batch.inputs[at] = std::int32_t(sequence.tokens[std::size_t(t)]);
            batch.targets[at] = std::int32_t(sequence.tokens[std::size_t(t + 1)]);
            ending[at] = t >= L - sequence.ending;
          }
        }
      }
      split.take_rows(ending.data(), B, T, local_ending);
      endings.push_back(local_ending);
      micro.push_back(std::move(batch));
    }
    losses.resize(std::size_t(B) * Tl);
    pipeline.forward_micro_batches(micro, B, T, [&](int k, double) {
      if (!rank.counts) return;
      const std::int64_t g = (j0 + k) * rank.readers + rank.reader;
      if (g >= total) return;
      ops::copy(Tensor(losses.data(), DType::f32, Device::cpu, {B, Tl}), model.losses());
      const std::vector<std::int64_t>& rows = batches[std::size_t(g)].sequences;
      for (std::size_t b = 0; b < rows.size(); ++b) {
        double sum = 0.0;
        for (std::size_t t = 0; t < std::size_t(Tl); ++t) {
          if (endings[std::size_t(k)][b * std::size_t(Tl) + t]) sum += double(losses[b * std::size_t(Tl) + t]);
        }
        logliks[std::size_t(rows[b])] -= sum;
      }
    });
  }
  world.all_reduce_sum(logliks.data(), std::int64_t(logliks.size()));
  return logliks;
}

}  // namespace llmtrain::eval
