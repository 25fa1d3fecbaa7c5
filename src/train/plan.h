// Memory planning: what one rank holds for a config at a world size, precision and ZeRO stage.
#pragma once

#include <cstdint>

#include "config/config.h"

namespace llmtrain::train {

struct MemoryPlan {
  std::int64_t weights = 0;      // f32 master weights (and the bf16 working copy) every rank holds
  std::int64_t gradients = 0;
  std::int64_t optimizer = 0;    // AdamW m and v
  std::int64_t activations = 0;  // for one micro-batch, with their gradients
  std::int64_t total() const { return weights + gradients + optimizer + activations; }
};

/// Exact parameter count of the config's model (its ArchSpec: the model's own parameter list).
std::int64_t parameter_count(const config::ModelConfig& model);

/// Training FLOPs per token: 6 N + 12 L H Q T (N parameters, L layers, H heads of size Q, context
/// T): the matmuls forward and backward plus attention's scores and weighted sums.
double flops_per_token(const config::ModelConfig& model);

/// Activation bytes per sequence of context_length tokens: the buffer the model allocates for a
/// micro-batch of one (its activations, for train.recompute `recompute`, and their gradients),
/// measured by the model's own layout code (ArchSpec::activation_bytes) with fp32 or bf16
/// activations.
std::int64_t activation_bytes_per_sequence(const config::ModelConfig& model, bool bf16,
                                           config::Recompute recompute = config::Recompute::none);

/// Bytes per rank. fp32: 4-byte weights, gradients, AdamW m and v. bf16 (mixed precision): the
/// same plus a 2-byte working copy of the weights, and 2-byte activations. ZeRO 1 shards m and v
/// over the `data_parallel_size` ranks of a data-parallel group, ZeRO 2 the gradients too (shards
/// padded to equal size).
MemoryPlan plan_memory(const config::Config& config, int data_parallel_size, int zero_stage, bool bf16,
                       std::int64_t micro_batch);

}  // namespace llmtrain::train
