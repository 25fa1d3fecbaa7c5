#include <cmath>
#include <numeric>
#include <vector>

#include "ops/cpu/reference.h"
#include "ops/cpu/vec_math.h"

namespace llmtrain::cpu {

double fused_classifier(float* logits, float* losses, const std::int32_t* targets, std::int64_t N, int V,
                        float dlogits_scale) {
#pragma omp parallel for if (worth_threads(N * V * 20))
  for (std::int64_t i = 0; i < N; ++i) {
    float* row = logits + i * V;
    float max_logit = row[0];
    for (int v = 1; v < V; ++v) max_logit = std::max(max_logit, row[v]);
    double sum = 0.0;
    for (int v = 0; v < V; ++v) sum += std::exp(double(row[v] - max_logit));
    const double log_sum = std::log(sum);
    const int target = targets[i];
    losses[i] = float(log_sum - double(row[target] - max_logit));
    if (dlogits_scale > 0.0f) {
      // d loss / d logit = softmax - onehot; the probabilities go straight into the gradient.
      for (int v = 0; v < V; ++v) {
        const float p = float(std::exp(double(row[v] - max_logit) - log_sum));
        row[v] = (p - (v == target ? 1.0f : 0.0f)) * dlogits_scale;
      }
    }
  }
  double total = 0.0;
  for (std::int64_t i = 0; i < N; ++i) total += losses[i];
  return total;
}

}  // namespace llmtrain::cpu
