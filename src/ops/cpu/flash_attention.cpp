// Causal self-attention with the flash-attention interface: the forward keeps only the log-sum-exp
// of each row's scaled scores (B,NH,T) instead of the (B,NH,T,T) probabilities, and the backward
// recomputes the probabilities from it. This is the exact reference for kernels/flash_attention.cu:
// one query row at a time, all of its scores at once (no online softmax, no tiling).
// Layout and grouped-query head mapping as in attention.cpp.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "ops/cpu/reference.h"

namespace llmtrain::cpu {

void flash_attention_forward(float* out, float* lse, const float* qkv, int B, int T, int C, int NH, int NKV) {
  const int HS = C / NH, group = NH / NKV;
  const float scale = 1.0f / std::sqrt(float(HS));
  const std::int64_t C3 = std::int64_t(NH + 2 * NKV) * HS;  // qkv row width
  const std::int64_t k_at = C, v_at = C + std::int64_t(NKV) * HS;
#pragma omp parallel
  {
    std::vector<float> score(std::size_t(std::max(T, 1)));  // one row of scaled scores
#pragma omp for collapse(2)
    for (int b = 0; b < B; ++b) {
      for (int h = 0; h < NH; ++h) {
        const int kvh = h / group;
        for (int t = 0; t < T; ++t) {
          const float* q = qkv + (std::int64_t(b) * T + t) * C3 + std::int64_t(h) * HS;
          float max_score = -std::numeric_limits<float>::infinity();
          for (int t2 = 0; t2 <= t; ++t2) {
            const float* k = qkv + (std::int64_t(b) * T + t2) * C3 + k_at + std::int64_t(kvh) * HS;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int i = 0; i < HS; ++i) dot += q[i] * k[i];
            score[t2] = dot * scale;
            max_score = std::max(max_score, score[t2]);
          }
          float sum = 0.0f;
          for (int t2 = 0; t2 <= t; ++t2) sum += std::exp(score[t2] - max_score);
          const float row_lse = max_score + std::log(sum);
          lse[(std::int64_t(b) * NH + h) * T + t] = row_lse;

          float* o = out + (std::int64_t(b) * T + t) * C + std::int64_t(h) * HS;
          for (int i = 0; i < HS; ++i) o[i] = 0.0f;
          for (int t2 = 0; t2 <= t; ++t2) {
            const float* v = qkv + (std::int64_t(b) * T + t2) * C3 + v_at + std::int64_t(kvh) * HS;
            const float p = std::exp(score[t2] - row_lse);  // the probability backward recomputes
#pragma omp simd
            for (int i = 0; i < HS; ++i) o[i] += p * v[i];
          }
        }
      }
    }
  }
}

void flash_attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse,
                              int B, int T, int C, int NH, int NKV) {
  const int HS = C / NH, group = NH / NKV;
  const float scale = 1.0f / std::sqrt(float(HS));
  const std::int64_t C3 = std::int64_t(NH + 2 * NKV) * HS;
  const std::int64_t k_at = C, v_at = C + std::int64_t(NKV) * HS;
  // Parallel over (batch, kv head): every query head of a group adds into the same dk and dv, so
  // one thread does the whole group, heads and rows in a fixed order (no races, deterministic).
#pragma omp parallel for collapse(2)
  for (int b = 0; b < B; ++b) {
    for (int kvh = 0; kvh < NKV; ++kvh) {
      for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
        for (int t = 0; t < T; ++t) {
          const std::int64_t row = (std::int64_t(b) * T + t);
          const float* q = qkv + row * C3 + std::int64_t(h) * HS;
          float* dq = dqkv + row * C3 + std::int64_t(h) * HS;
          const float* dy = dout + row * C + std::int64_t(h) * HS;
          const float* y = out + row * C + std::int64_t(h) * HS;
          const float row_lse = lse[(std::int64_t(b) * NH + h) * T + t];
          // D = sum over keys of p * dp = dy . y, since y = sum over keys of p v.
          float D = 0.0f;
#pragma omp simd reduction(+ : D)
          for (int i = 0; i < HS; ++i) D += dy[i] * y[i];
          for (int t2 = 0; t2 <= t; ++t2) {
            const std::int64_t row2 = (std::int64_t(b) * T + t2);
            const float* k = qkv + row2 * C3 + k_at + std::int64_t(kvh) * HS;
            const float* v = qkv + row2 * C3 + v_at + std::int64_t(kvh) * HS;
            float* dk = dqkv + row2 * C3 + k_at + std::int64_t(kvh) * HS;
            float* dv = dqkv + row2 * C3 + v_at + std::int64_t(kvh) * HS;
            float qk = 0.0f, dp = 0.0f;
#pragma omp simd reduction(+ : qk, dp)
            for (int i = 0; i < HS; ++i) {
              qk += q[i] * k[i];
              dp += dy[i] * v[i];
            }
            const float p = std::exp(qk * scale - row_lse);
            // softmax backward (ds = p (dp - D)), then the scaled dot product
            const float ds = p * (dp - D) * scale;
#pragma omp simd
            for (int i = 0; i < HS; ++i) {
              dq[i] += ds * k[i];
              dk[i] += ds * q[i];
              dv[i] += p * dy[i];
            }
          }
        }
      }
    }
  }
}

}  // namespace llmtrain::cpu
