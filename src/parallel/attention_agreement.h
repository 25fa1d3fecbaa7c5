// model.attention resolved alike on every rank: cuDNN's answers agreed over all ranks.
#pragma once

#include "config/config.h"
#include "core/tensor.h"
#include "dist/communicator.h"
#include "parallel/attention_choice.h"

namespace llmtrain::parallel {

/// parallel::resolve_attention with cuDNN's answers agreed by every rank of `world` ("yes" only
/// where all say yes), so all ranks choose the same kernels, and a "cudnn" refused on one rank is
/// an InputError on every rank. A collective.
parallel::AttentionChoice resolve_attention_on_every_rank(const config::Config& config, Device device,
                                                       dist::Communicator& world);

}  // namespace llmtrain::parallel
