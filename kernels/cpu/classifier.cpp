#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "llmtrain/kernels/cpu.h"
#include "llmtrain/kernels/vec_math.h"

namespace llmtrain::cpu {

namespace {
// d loss / d logit = softmax - onehot: the row (V) becomes (exp(x - max_logit - log_sum) -
// onehot(target)) * dlogits_scale, the probabilities going straight into the gradient; its
// padding [V, ld) becomes 0.
void write_dlogits(float* row, int V, std::int64_t ld, float max_logit, double log_sum, std::int64_t target,
                   float dlogits_scale) {
  for (int v = 0; v < V; ++v) {
    const float p = float(std::exp(double(row[v] - max_logit) - log_sum));
    row[v] = (p - (v == target ? 1.0f : 0.0f)) * dlogits_scale;
  }
  std::fill(row + V, row + ld, 0.0f);
}
}  // namespace

double fused_classifier(float* logits, float* losses, const std::int32_t* targets, std::int64_t N, int V,
                        std::int64_t ld, float dlogits_scale, double* loss_sum) {
#pragma omp parallel for if (worth_threads(N * V * 20))
  for (std::int64_t i = 0; i < N; ++i) {
    float* row = logits + i * ld;
    float max_logit = row[0];
    for (int v = 1; v < V; ++v) max_logit = std::max(max_logit, row[v]);
    double sum = 0.0;
    for (int v = 0; v < V; ++v) sum += std::exp(double(row[v] - max_logit));
    const double log_sum = std::log(sum);
    const int target = targets[i];
    losses[i] = float(log_sum - double(row[target] - max_logit));
    if (dlogits_scale > 0.0f) write_dlogits(row, V, ld, max_logit, log_sum, target, dlogits_scale);
  }
  double total = 0.0;
  for (std::int64_t i = 0; i < N; ++i) total += losses[i];
  if (loss_sum) {
    *loss_sum += total;
    return 0.0;
  }
  return total;
}

// ---- the vocabulary-parallel cross-entropy: logits (N,V) are columns [vocab_begin, vocab_begin + V)
// of the full vocabulary. Each step works in the same precision as fused_classifier (sums and logs
// in double, the statistics stored as float), so that one rank's three steps give its losses and
// gradient to rounding.

void classifier_row_max(float* row_max, const float* logits, std::int64_t N, int V, std::int64_t ld) {
#pragma omp parallel for if (worth_threads(N * V))
  for (std::int64_t i = 0; i < N; ++i) {
    const float* row = logits + i * ld;
    float m = -INFINITY;
    for (int v = 0; v < V; ++v) m = std::max(m, row[v]);  // std::max(m, NaN) keeps m, as fmaxf does
    row_max[i] = m;
  }
}

void classifier_row_stats(float* sum_exp, float* target_logit, const float* logits, const float* row_max,
                          const std::int32_t* targets, std::int64_t N, int V, std::int64_t ld,
                          std::int64_t vocab_begin) {
#pragma omp parallel for if (worth_threads(N * V * 10))
  for (std::int64_t i = 0; i < N; ++i) {
    const float* row = logits + i * ld;
    const float m = row_max[i];
    double sum = 0.0;
    for (int v = 0; v < V; ++v) sum += std::exp(double(row[v] - m));
    sum_exp[i] = float(sum);
    const std::int64_t local = std::int64_t(targets[i]) - vocab_begin;
    // Another rank holds the target (it contributes 0 here); a negative target is no rank's, and
    // every rank makes it NaN so that the summed statistic, and the loss, are NaN.
    target_logit[i] = targets[i] < 0 ? NAN : local >= 0 && local < V ? row[local] : 0.0f;
  }
}

double classifier_parallel_finish(float* logits, float* losses, const float* row_max, const float* sum_exp,
                                  const float* target_logit, const std::int32_t* targets, std::int64_t N, int V,
                                  std::int64_t ld, std::int64_t vocab_begin, float dlogits_scale, double* loss_sum) {
  const bool gradient = dlogits_scale > 0.0f;
#pragma omp parallel for if (worth_threads(gradient ? N * V * 20 : N * 20))
  for (std::int64_t i = 0; i < N; ++i) {
    const double log_sum = std::log(double(sum_exp[i]));
    const float m = row_max[i];
    losses[i] = float(log_sum - double(target_logit[i] - m));
    if (gradient) {
      write_dlogits(logits + i * ld, V, ld, m, log_sum, std::int64_t(targets[i]) - vocab_begin, dlogits_scale);
    }
  }
  double total = 0.0;
  for (std::int64_t i = 0; i < N; ++i) total += losses[i];
  if (loss_sum) {
    *loss_sum += total;
    return 0.0;
  }
  return total;
}

}  // namespace llmtrain::cpu
