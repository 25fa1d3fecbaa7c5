// The Mixture-of-Experts router and token dispatch (docs/moe.md): router probabilities, top-k
// choice (ties to the lower expert index), the k weights, the load-balancing and z losses and their
// gradients back to the logits; the permutation of token slots into expert order (stable: by
// expert, then in token order, so capacity drops the latest slots) and back. Every backward is a
// gather over the plan (no scatter-add), so results do not depend on thread timing.
#include <algorithm>
#include <cmath>
#include <vector>

#include "llmtrain/kernels/cpu.h"
#include "llmtrain/kernels/vec_math.h"

namespace llmtrain::cpu {
namespace {

// Softmax of one row of E logits into p; returns its log-sum-exp.
float softmax_row(float* p, const float* logits, int E) {
  float mx = logits[0];
  for (int e = 1; e < E; ++e) mx = std::max(mx, logits[e]);
  double sum = 0.0;
  for (int e = 0; e < E; ++e) {
    p[e] = std::exp(logits[e] - mx);
    sum += p[e];
  }
  for (int e = 0; e < E; ++e) p[e] = float(p[e] / sum);
  return mx + float(std::log(sum));
}

}  // namespace

void moe_router_forward(float* probs, std::int32_t* experts, float* weights, float* counts, float* pbar_out,
                        float* losses, const float* logits, const float* bias, std::int64_t N, int E, int k, bool sigmoid,
                        bool normalize, float route_scale) {
  std::vector<double> pbar(std::size_t(E), 0.0), count(std::size_t(E), 0.0);
  double z = 0.0;
  std::vector<float> soft(static_cast<std::size_t>(E));
  std::vector<char> taken(static_cast<std::size_t>(E));
  for (std::int64_t t = 0; t < N; ++t) {
    const float* lt = logits + t * E;
    float* pt = probs + t * E;
    const float lse = softmax_row(soft.data(), lt, E);
    z += double(lse) * lse;
    double score_sum = 0.0;
    for (int e = 0; e < E; ++e) {
      pt[e] = sigmoid ? 1.0f / (1.0f + std::exp(-lt[e])) : soft[std::size_t(e)];
      score_sum += pt[e];
    }
    for (int e = 0; e < E; ++e) pbar[std::size_t(e)] += sigmoid ? pt[e] / score_sum : pt[e];
    std::fill(taken.begin(), taken.end(), 0);
    double chosen_sum = 0.0;
    for (int j = 0; j < k; ++j) {
      int best = -1;
      float best_score = 0.0f;
      for (int e = 0; e < E; ++e) {
        if (taken[std::size_t(e)]) continue;
        const float s = pt[e] + (bias ? bias[e] : 0.0f);
        if (best < 0 || s > best_score) {  // strictly greater: ties go to the lower index
          best = e;
          best_score = s;
        }
      }
      taken[std::size_t(best)] = 1;
      experts[t * k + j] = best;
      count[std::size_t(best)] += 1.0;
      chosen_sum += pt[best];
    }
    const bool renormalise = sigmoid || normalize;
    for (int j = 0; j < k; ++j) {
      const float p = pt[experts[t * k + j]];
      weights[t * k + j] = route_scale * (renormalise ? float(p / chosen_sum) : p);
    }
  }
  double aux = 0.0, most = 0.0;
  for (int e = 0; e < E; ++e) {
    counts[e] = float(count[std::size_t(e)]);
    pbar_out[e] = float(pbar[std::size_t(e)] / double(N));
    aux += count[std::size_t(e)] / double(N) * pbar[std::size_t(e)] / double(N);
    most = std::max(most, count[std::size_t(e)]);
  }
  losses[0] = float(double(E) / k * aux);
  losses[1] = float(z / double(N));
  losses[2] = float(most / (double(N) * k / E));  // the busiest expert's load over the mean load
}

void moe_router_backward(float* dlogits, const float* dweights, const float* logits, const float* probs,
                         const std::int32_t* experts, const float* counts, std::int64_t N, int E, int k,
                         bool sigmoid, bool normalize, float route_scale, float aux_scale, float z_scale) {
  const bool renormalise = sigmoid || normalize;
  // d aux / d Pbar_e = (E / k) c_e / N, and Pbar_e is a mean over the N tokens.
  const double aux_per_token = double(aux_scale) * double(E) / k / (double(N) * double(N));
#pragma omp parallel if (worth_threads(N * E * 8))
  {
    std::vector<double> dp(static_cast<std::size_t>(E));
    std::vector<float> soft(static_cast<std::size_t>(E));
#pragma omp for
    for (std::int64_t t = 0; t < N; ++t) {
      const float* pt = probs + t * E;
      const float* lt = logits + t * E;
      const std::int32_t* et = experts + t * k;
      std::fill(dp.begin(), dp.end(), 0.0);
      // The k weights: w_j = r p_j / S (renormalised, S the chosen p's sum) or r p_j.
      double S = 0.0, dot = 0.0;
      for (int j = 0; j < k; ++j) S += pt[et[j]];
      for (int j = 0; j < k; ++j) dot += double(dweights[t * k + j]) * pt[et[j]];
      for (int j = 0; j < k; ++j) {
        const double dw = dweights[t * k + j];
        dp[std::size_t(et[j])] += renormalise ? route_scale * (dw / S - dot / (S * S)) : route_scale * dw;
      }
      // The load-balancing loss through Pbar: softmax p itself; sigmoid the scores over their sum.
      if (!sigmoid) {
        for (int e = 0; e < E; ++e) dp[std::size_t(e)] += aux_per_token * counts[e];
      } else if (aux_scale != 0.0f) {
        double sum = 0.0, qdq = 0.0;
        for (int e = 0; e < E; ++e) sum += pt[e];
        for (int e = 0; e < E; ++e) qdq += aux_per_token * counts[e] * pt[e] / sum;
        for (int e = 0; e < E; ++e) dp[std::size_t(e)] += (aux_per_token * counts[e] - qdq) / sum;
      }
      float* dt = dlogits + t * E;
      if (sigmoid) {
        for (int e = 0; e < E; ++e) dt[e] = float(dp[std::size_t(e)] * pt[e] * (1.0 - pt[e]));
      } else {
        double pdp = 0.0;
        for (int e = 0; e < E; ++e) pdp += pt[e] * dp[std::size_t(e)];
        for (int e = 0; e < E; ++e) dt[e] = float(pt[e] * (dp[std::size_t(e)] - pdp));
      }
      if (z_scale != 0.0f) {  // z = mean_t lse_t^2: d/dlogit = 2 lse_t softmax / N
        const float lse = softmax_row(soft.data(), lt, E);
        const double g = 2.0 * double(z_scale) * lse / double(N);
        for (int e = 0; e < E; ++e) dt[e] += float(g * soft[std::size_t(e)]);
      }
    }
  }
}

void moe_dispatch(std::int32_t* offsets, std::int32_t* row_slot, std::int32_t* slot_row, float* dropped,
                  const std::int32_t* experts, std::int64_t N, int E, int k, std::int64_t capacity) {
  const std::int64_t slots = N * k;
  std::vector<std::int64_t> kept(std::size_t(E), 0);
  for (std::int64_t s = 0; s < slots; ++s) {
    const int e = experts[s];
    if (capacity > 0 && kept[std::size_t(e)] >= capacity) {
      slot_row[s] = -1;
      continue;
    }
    slot_row[s] = std::int32_t(kept[std::size_t(e)]++);  // the rank within its expert, for now
  }
  offsets[0] = 0;
  for (int e = 0; e < E; ++e) offsets[e + 1] = offsets[e] + std::int32_t(kept[std::size_t(e)]);
  for (std::int64_t s = 0; s < slots; ++s) {
    if (slot_row[s] < 0) continue;
    slot_row[s] += offsets[experts[s]];
    row_slot[slot_row[s]] = std::int32_t(s);
  }
  for (std::int64_t r = offsets[E]; r < slots; ++r) row_slot[r] = -1;
  dropped[0] = float(double(slots - offsets[E]) / double(slots));
}

void moe_permute_forward(float* xp, const float* x, const std::int32_t* row_slot, const std::int32_t* offsets,
                         std::int64_t N, int E, int k, int C) {
  const std::int64_t M = offsets[E];
  (void)N;
#pragma omp parallel for if (worth_threads(M * C))
  for (std::int64_t r = 0; r < M; ++r) {
    const float* src = x + std::int64_t(row_slot[r] / k) * C;
    std::copy(src, src + C, xp + r * C);
  }
}

void moe_permute_backward(float* dx, const float* dxp, const std::int32_t* slot_row, std::int64_t N, int k, int C,
                          bool accumulate) {
#pragma omp parallel for if (worth_threads(N * k * C))
  for (std::int64_t t = 0; t < N; ++t) {
    float* d = dx + t * C;
    if (!accumulate) std::fill(d, d + C, 0.0f);
    for (int j = 0; j < k; ++j) {
      const std::int32_t r = slot_row[t * k + j];
      if (r < 0) continue;
      const float* g = dxp + std::int64_t(r) * C;
      for (int c = 0; c < C; ++c) d[c] += g[c];
    }
  }
}

void moe_unpermute_forward(float* out, const float* y, const float* weights, const std::int32_t* slot_row,
                           std::int64_t N, int k, int C) {
#pragma omp parallel for if (worth_threads(N * k * C))
  for (std::int64_t t = 0; t < N; ++t) {
    float* o = out + t * C;
    std::fill(o, o + C, 0.0f);
    for (int j = 0; j < k; ++j) {
      const std::int32_t r = slot_row[t * k + j];
      if (r < 0) continue;  // dropped: the token's residual stream carries it past the experts
      const float w = weights[t * k + j];
      const float* yr = y + std::int64_t(r) * C;
      for (int c = 0; c < C; ++c) o[c] += w * yr[c];
    }
  }
}

void moe_unpermute_backward(float* dy, float* dweights, const float* dout, const float* y, const float* weights,
                            const std::int32_t* row_slot, const std::int32_t* slot_row, const std::int32_t* offsets,
                            std::int64_t N, int E, int k, int C) {
  const std::int64_t M = offsets[E];
#pragma omp parallel for if (worth_threads(M * C))
  for (std::int64_t r = 0; r < M; ++r) {
    const std::int32_t s = row_slot[r];
    const float w = weights[s];
    const float* g = dout + std::int64_t(s / k) * C;
    for (int c = 0; c < C; ++c) dy[r * C + c] = w * g[c];
  }
#pragma omp parallel for if (worth_threads(N * k * C))
  for (std::int64_t s = 0; s < N * k; ++s) {
    const std::int32_t r = slot_row[s];
    double dot = 0.0;
    if (r >= 0) {
      const float* g = dout + (s / k) * C;
      const float* yr = y + std::int64_t(r) * C;
      for (int c = 0; c < C; ++c) dot += double(g[c]) * yr[c];
    }
    dweights[s] = float(dot);
  }
}

void moe_bias_update(float* bias, const float* loads, float mean_load, std::int64_t n, float rate) {
  for (std::int64_t e = 0; e < n; ++e) {
    const float gap = mean_load - loads[e];
    bias[e] += gap > 0 ? rate : gap < 0 ? -rate : 0.0f;
  }
}

}  // namespace llmtrain::cpu
