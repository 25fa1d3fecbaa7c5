// Causal multi-head self-attention, one (batch, head, query row) at a time, with grouped-query
// attention: NKV key/value heads, query head h reading kv head h / (NH / NKV). A qkv row holds
// NH query heads, then NKV key heads, then NKV value heads (GPT-2: NKV = NH). The probabilities
// (B,NH,T,T) are kept for backward; entries above the diagonal are written as zero.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "llmtrain/kernels/cpu.h"
#include "llmtrain/kernels/vec_math.h"

namespace llmtrain::cpu {

void attention_forward(float* out, float* att, const float* qkv, int B, int T, int C, int NH, int NKV) {
  const int HS = C / NH, group = NH / NKV;
  const float scale = 1.0f / std::sqrt(float(HS));
  const std::int64_t C3 = std::int64_t(NH + 2 * NKV) * HS;  // qkv row width
  const std::int64_t k_at = C, v_at = C + std::int64_t(NKV) * HS;
#pragma omp parallel for collapse(3) if (worth_threads(std::int64_t(B) * NH * T * T * HS))
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < NH; ++h) {
      for (int t = 0; t < T; ++t) {
        const float* q = qkv + (std::int64_t(b) * T + t) * C3 + h * HS;
        float* row = att + ((std::int64_t(b) * NH + h) * T + t) * T;
        float max_score = -std::numeric_limits<float>::infinity();
        for (int t2 = 0; t2 <= t; ++t2) {
          const float* k = qkv + (std::int64_t(b) * T + t2) * C3 + k_at + (h / group) * HS;
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int i = 0; i < HS; ++i) dot += q[i] * k[i];
          row[t2] = dot * scale;
          if (row[t2] > max_score) max_score = row[t2];
        }
        float sum = 0.0f;
        for (int t2 = 0; t2 <= t; ++t2) {
          row[t2] = std::exp(row[t2] - max_score);
          sum += row[t2];
        }
        const float inv_sum = 1.0f / sum;
        for (int t2 = 0; t2 <= t; ++t2) row[t2] *= inv_sum;
        for (int t2 = t + 1; t2 < T; ++t2) row[t2] = 0.0f;

        float* o = out + (std::int64_t(b) * T + t) * C + h * HS;
        for (int i = 0; i < HS; ++i) o[i] = 0.0f;
        for (int t2 = 0; t2 <= t; ++t2) {
          const float* v = qkv + (std::int64_t(b) * T + t2) * C3 + v_at + (h / group) * HS;
          const float p = row[t2];
#pragma omp simd
          for (int i = 0; i < HS; ++i) o[i] += p * v[i];
        }
      }
    }
  }
}

void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* att, int B, int T, int C,
                        int NH, int NKV) {
  const int HS = C / NH, group = NH / NKV;
  const float scale = 1.0f / std::sqrt(float(HS));
  const std::int64_t C3 = std::int64_t(NH + 2 * NKV) * HS;
  const std::int64_t k_at = C, v_at = C + std::int64_t(NKV) * HS;
  // Parallel over (batch, kv head) only: every row of every query head of a group adds into the
  // same dk and dv, so one thread does a whole group, heads and rows in a fixed order.
#pragma omp parallel for collapse(2) if (worth_threads(std::int64_t(B) * NH * T * T * HS))
  for (int b = 0; b < B; ++b) {
    for (int kvh = 0; kvh < NKV; ++kvh) {
      std::vector<float> datt(T);
      for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
        for (int t = 0; t < T; ++t) {
          const float* row = att + ((std::int64_t(b) * NH + h) * T + t) * T;
          const float* dy = dout + (std::int64_t(b) * T + t) * C + h * HS;
          const float* q = qkv + (std::int64_t(b) * T + t) * C3 + h * HS;
          float* dq = dqkv + (std::int64_t(b) * T + t) * C3 + h * HS;
          // out = att v: datt = dy . v, dv += att dy
          float weighted = 0.0f;  // sum over keys of att * datt
          for (int t2 = 0; t2 <= t; ++t2) {
            const float* v = qkv + (std::int64_t(b) * T + t2) * C3 + v_at + kvh * HS;
            float* dv = dqkv + (std::int64_t(b) * T + t2) * C3 + v_at + kvh * HS;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int i = 0; i < HS; ++i) {
              dot += dy[i] * v[i];
              dv[i] += row[t2] * dy[i];
            }
            datt[t2] = dot;
            weighted += row[t2] * dot;
          }
          // softmax backward, then the scaled dot product: dq += ds k, dk += ds q
          for (int t2 = 0; t2 <= t; ++t2) {
            const float ds = row[t2] * (datt[t2] - weighted) * scale;
            const float* k = qkv + (std::int64_t(b) * T + t2) * C3 + k_at + kvh * HS;
            float* dk = dqkv + (std::int64_t(b) * T + t2) * C3 + k_at + kvh * HS;
#pragma omp simd
            for (int i = 0; i < HS; ++i) {
              dq[i] += ds * k[i];
              dk[i] += ds * q[i];
            }
          }
        }
      }
    }
  }
}

void attention_decode(float* out, const float* q, const float* k_cache, const float* v_cache, int pos, int C,
                      int NH, int NKV) {
  const int HS = C / NH, group = NH / NKV, KVC = NKV * HS;
  const float scale = 1.0f / std::sqrt(float(HS));
  std::vector<float> row(std::size_t(pos) + 1);
  for (int h = 0; h < NH; ++h) {
    float max_score = -std::numeric_limits<float>::infinity();
    for (int t2 = 0; t2 <= pos; ++t2) {
      const float* k = k_cache + std::int64_t(t2) * KVC + (h / group) * HS;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int i = 0; i < HS; ++i) dot += q[h * HS + i] * k[i];
      row[t2] = dot * scale;
      max_score = std::max(max_score, row[t2]);
    }
    float sum = 0.0f;
    for (int t2 = 0; t2 <= pos; ++t2) {
      row[t2] = std::exp(row[t2] - max_score);
      sum += row[t2];
    }
    float* o = out + h * HS;
    for (int i = 0; i < HS; ++i) o[i] = 0.0f;
    for (int t2 = 0; t2 <= pos; ++t2) {
      const float p = row[t2] / sum;
      const float* v = v_cache + std::int64_t(t2) * KVC + (h / group) * HS;
#pragma omp simd
      for (int i = 0; i < HS; ++i) o[i] += p * v[i];
    }
  }
}

}  // namespace llmtrain::cpu
