// Choosing the next token from logits: temperature, top-k, top-p (nucleus), seeded.
#pragma once

#include <cstdint>

namespace llmtrain::model {

struct SamplingOptions {
  float temperature = 1.0f;  // 0: always the most likely token
  int top_k = 0;             // 0: no limit
  float top_p = 1.0f;        // keep the smallest set of tokens whose probability reaches top_p
};

/// A token drawn from softmax(logits / temperature) restricted by top-k and top-p; `rng_state`
/// (SplitMix64) advances by one draw, so a seed fixes the whole sequence.
std::int32_t sample_token(const float* logits, int V, const SamplingOptions& options, std::uint64_t& rng_state);

}  // namespace llmtrain::model
