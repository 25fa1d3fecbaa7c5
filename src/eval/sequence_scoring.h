// Log-likelihoods of choice sequences (eval/choice_eval.h): the one path of `eval --task` and
// train.eval_tasks, on any mesh. The sequences go through the stages' forward passes (the
// validation's path: parallel/pipeline_executor.h) in micro-batches of B sequences, longest first,
// each micro-batch padded at its rows' ends only to its longest sequence (rounded up to a length
// every split of the mesh accepts), not to the context length: HellaSwag's endings are about a
// hundred tokens, so at a context of 8192 this runs about 1/60 of the positions padding to the
// context would. A causal model's positions never see the padding after them, so a sequence's
// log-likelihood (the summed per-position losses over its last `ending` tokens, negated) is the
// same in any micro-batch of any length.
#pragma once

#include <cstdint>
#include <vector>

#include "dist/communicator.h"
#include "eval/choice_eval.h"
#include "model/model.h"
#include "parallel/pipeline_executor.h"

namespace llmtrain::eval {

/// One micro-batch to score: sequences (indices into the list scored), each padded at its end to
/// T positions; rows past `sequences` are padding with nothing to score.
struct ScoringBatch {
  int T = 0;
  std::vector<std::int64_t> sequences;
};

/// The micro-batches of `sequences` (at most B each): longest first (ties in list order), each of
/// T = its longest sequence's positions (tokens - 1) rounded up to a multiple of `granule`, or
/// context_length where that is more.
std::vector<ScoringBatch> scoring_batches(const std::vector<ChoiceSequence>& sequences, int B,
                                          std::int64_t context_length, int granule);

/// The lengths a mesh accepts are the multiples of this: 64 (whole attention tiles), 2 x the
/// context-parallel size (each rank two equal chunks) and the tensor-parallel size (sequence
/// parallelism splits the B T rows).
int scoring_granule(int context_size, int tensor_size);

/// This rank's place in the scoring.
struct ScoringRank {
  std::int64_t readers = 1, reader = 0;  // the data-parallel ranks and this one's index
  int context_rank = 0, context_size = 1;
  int tensor_size = 1;
  bool counts = true;                  // whether this rank adds its losses (one per tensor group)
  std::int64_t micro_batches = 1;      // micro-batches per pass through the stages
  int granule = 0;                     // the lengths' multiple; 0: scoring_granule(context_size, tensor_size)
};

/// Positions run per scoring of `sequences` (B times each micro-batch's T), and what padding every
/// sequence to the context length would run.
struct ScoringCost {
  std::int64_t micro_batches = 0, positions = 0, positions_padded_to_context = 0;
};
ScoringCost scoring_cost(const std::vector<ChoiceSequence>& sequences, int B, std::int64_t context_length,
                         int granule);

/// Every sequence's log-likelihood, summed over `world` (every rank gets them all): data-parallel
/// rank r scores global micro-batches r, r + readers, ...; every data-parallel rank runs as many
/// passes (ZeRO 3 gathers the weights with all of them), padding with empty micro-batches.
std::vector<double> sequence_logliks(parallel::PipelineExecutor& pipeline, model::Model& model,
                                     const std::vector<ChoiceSequence>& sequences, int B, std::int64_t context_length,
                                     const ScoringRank& rank, dist::Communicator& world);

}  // namespace llmtrain::eval
