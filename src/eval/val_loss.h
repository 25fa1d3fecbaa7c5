// The mean loss of a model over a data set, in order: the `eval` command's measure (the trainer's
// validation runs its own pipeline of stages, parallel/pipeline_executor.h).
#pragma once

#include <cstdint>

#include "config/config.h"
#include "data/dataset.h"
#include "dist/communicator.h"
#include "model/model.h"

namespace llmtrain::eval {

/// Mean loss over `batches` global batches of `data` in order (no shuffling), micro-batches of
/// the config's micro_batch_size; at most as many batches as the data holds. With `comm`, each
/// rank evaluates its part of every batch and all get the mean over all; under context
/// parallelism (model.sequence_parts() > 1) `comm` holds the context x data ranks, context index
/// fastest, and the ranks of a context group evaluate the same sequences, each its tokens.
double evaluate(model::Model& model, const data::TokenDataset& data, const config::Config& config,
                std::int64_t batches, dist::Communicator* comm = nullptr);

}  // namespace llmtrain::eval
