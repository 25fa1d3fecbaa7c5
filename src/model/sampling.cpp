#include "model/sampling.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/rng.h"

namespace llmtrain::model {

std::int32_t sample_token(const float* logits, int V, const SamplingOptions& options, std::uint64_t& rng_state) {
  const double u = double(splitmix64(rng_state) >> 11) * 0x1.0p-53;  // drawn even when greedy
  if (options.temperature <= 0.0f) return std::int32_t(std::max_element(logits, logits + V) - logits);

  // Candidates by decreasing logit (ties by id, so the order is reproducible).
  std::vector<std::int32_t> order(static_cast<std::size_t>(V));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) { return logits[a] > logits[b]; });
  std::size_t keep = order.size();
  if (options.top_k > 0) keep = std::min(keep, std::size_t(options.top_k));

  std::vector<double> p(keep);
  const double max_logit = logits[order[0]];
  double sum = 0.0;
  for (std::size_t i = 0; i < keep; ++i) {
    p[i] = std::exp((double(logits[order[i]]) - max_logit) / options.temperature);
    sum += p[i];
  }
  if (options.top_p < 1.0f) {
    double mass = 0.0;
    std::size_t cut = 0;
    while (cut < keep && mass < options.top_p * sum) mass += p[cut++];
    keep = std::max<std::size_t>(cut, 1);
    sum = mass;
  }
  double target = u * sum;
  for (std::size_t i = 0; i < keep; ++i) {
    target -= p[i];
    if (target < 0.0) return order[i];
  }
  return order[keep - 1];
}

}  // namespace llmtrain::model
