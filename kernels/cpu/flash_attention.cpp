// Causal self-attention with the flash-attention interface: the forward keeps only the log-sum-exp
// of each row's scaled scores (B,NH,T) instead of the (B,NH,T,T) probabilities, and the backward
// recomputes the probabilities from it. This is the CPU twin of kernels/flash_attention.cu.
// Layout and grouped-query head mapping as in attention.cpp.
//
// Blocks of query_block query rows at a time, each against all the keys it may see (0 .. last
// row of the block), with sgemm on the blocks: forward S = Q K^T, O = P V; backward dP = dO V^T,
// dQ += dS K, dK += dS^T Q, dV += P^T dO. Scratch is query_block x T floats per score matrix and
// thread: memory linear in T. The softmax between the products uses exp_vec (vectorised). On the
// benchmark shape (T=256, HS=64, 2 x86-64 cores) this took attention from scalar dot products at
// ~2 GFLOP/s to OpenBLAS's block speed (docs/benchmarks.md, CPU training).
//
// Document masks (packed sequences): with seg (B,T), row t sees keys s <= t with seg[s] = seg[t],
// the keys from its document's first row. A query block's scores start at the first key of its
// first row's document, so the keys of earlier documents are never multiplied: the work follows
// the sum of the documents' squared lengths (plus a block's rows against one document boundary).
//
// Threads: the forward runs one (batch, head, query block) per task; the backward one (batch, kv
// head) per task, since every query block and every query head of a group adds into the same dK,
// dV (one thread owns them: no races, a fixed order, the same bits at any thread count). BLAS calls
// inside a parallel region run on their thread (OpenBLAS's OpenMP build does not nest).
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "gemm.h"
#include "document_mask.h"
#include "llmtrain/kernels/cpu.h"
#include "llmtrain/kernels/vec_math.h"

namespace llmtrain::cpu {

namespace {

constexpr int query_block = 64;

}  // namespace

void flash_attention_forward(float* out, float* lse, const float* qkv, int B, int T, int C, int NH, int NKV,
                             const std::int32_t* seg) {
  const int HS = C / NH, group = NH / NKV;
  const float scale = 1.0f / std::sqrt(float(HS));
  const std::int64_t C3 = std::int64_t(NH + 2 * NKV) * HS;  // qkv row width
  const std::int64_t k_at = C, v_at = C + std::int64_t(NKV) * HS;
  const int blocks = (T + query_block - 1) / query_block;
  const std::vector<int> starts = document_starts(seg, B, T);
  // about T^2 HS multiply-adds per (batch, head), half of them masked
  const bool threads = worth_threads(std::int64_t(B) * NH * T * T * HS);
#pragma omp parallel if (threads)
  {
    std::vector<float> score(std::size_t(query_block) * std::size_t(std::max(T, 1)));  // (rows, keys)
#pragma omp for collapse(3) schedule(dynamic)
    for (int b = 0; b < B; ++b) {
      for (int h = 0; h < NH; ++h) {
        for (int blk = 0; blk < blocks; ++blk) {
          const int t0 = blk * query_block, rows = std::min(query_block, T - t0);
          const int* start = starts.data() + std::int64_t(b) * T;
          const int lo = start[t0], keys = t0 + rows - lo;  // keys lo .. t0 + rows - 1
          const float* q = qkv + (std::int64_t(b) * T + t0) * C3 + std::int64_t(h) * HS;  // (rows, HS), ld C3
          const float* k = qkv + (std::int64_t(b) * T + lo) * C3 + k_at + std::int64_t(h / group) * HS;  // (keys, HS)
          const float* v = qkv + (std::int64_t(b) * T + lo) * C3 + v_at + std::int64_t(h / group) * HS;  // (keys, HS)
          // S (rows, keys) = scale Q K^T
          gemm(false, true, rows, keys, HS, scale, q, C3, k, C3, 0.0f, score.data(), keys);
          for (int r = 0; r < rows; ++r) {
            float* s = score.data() + std::int64_t(r) * keys;
            // causal within the document: keys start[t] .. t, columns first .. seen - 1
            const int first = start[t0 + r] - lo, seen = t0 + r + 1 - lo;
            float max_score = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : max_score)
            for (int j = first; j < seen; ++j) max_score = std::max(max_score, s[j]);
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int j = first; j < seen; ++j) sum += exp_vec(s[j] - max_score);
            const float row_lse = max_score + std::log(sum);
            lse[(std::int64_t(b) * NH + h) * T + t0 + r] = row_lse;
            // P, the probabilities backward recomputes from lse; zero outside the row's keys
            std::fill(s, s + first, 0.0f);
#pragma omp simd
            for (int j = first; j < seen; ++j) s[j] = exp_vec(s[j] - row_lse);
            std::fill(s + seen, s + keys, 0.0f);
          }
          // O (rows, HS) = P V
          gemm(false, false, rows, HS, keys, 1.0f, score.data(), keys, v, C3, 0.0f,
                     out + (std::int64_t(b) * T + t0) * C + std::int64_t(h) * HS, C);
        }
      }
    }
  }
}

void flash_attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse,
                              int B, int T, int C, int NH, int NKV, bool accumulate, const std::int32_t* seg) {
  const int HS = C / NH, group = NH / NKV;
  const float scale = 1.0f / std::sqrt(float(HS));
  const std::int64_t C3 = std::int64_t(NH + 2 * NKV) * HS;
  if (!accumulate) std::fill(dqkv, dqkv + std::int64_t(B) * T * C3, 0.0f);  // its first writer
  const std::int64_t k_at = C, v_at = C + std::int64_t(NKV) * HS;
  const int blocks = (T + query_block - 1) / query_block;
  const std::vector<int> starts = document_starts(seg, B, T);
  const bool threads = worth_threads(std::int64_t(B) * NH * T * T * HS);
#pragma omp parallel if (threads)
  {
    const std::size_t scratch = std::size_t(query_block) * std::size_t(std::max(T, 1));
    std::vector<float> prob(scratch), dscore(scratch);  // P and dP, then dS, (rows, keys)
#pragma omp for collapse(2) schedule(dynamic)
    for (int b = 0; b < B; ++b) {
      for (int kvh = 0; kvh < NKV; ++kvh) {
        const std::int64_t base = std::int64_t(b) * T * C3;
        const float* k = qkv + base + k_at + std::int64_t(kvh) * HS;  // (T, HS), ld C3
        const float* v = qkv + base + v_at + std::int64_t(kvh) * HS;
        float* dk = dqkv + base + k_at + std::int64_t(kvh) * HS;
        float* dv = dqkv + base + v_at + std::int64_t(kvh) * HS;
        for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
          for (int blk = 0; blk < blocks; ++blk) {
            const int t0 = blk * query_block, rows = std::min(query_block, T - t0);
            const int* start = starts.data() + std::int64_t(b) * T;
            const int lo = start[t0], keys = t0 + rows - lo;  // keys lo .. t0 + rows - 1
            const std::int64_t row0 = std::int64_t(b) * T + t0, key0 = std::int64_t(lo) * C3;
            const float* q = qkv + row0 * C3 + std::int64_t(h) * HS;  // (rows, HS), ld C3
            float* dq = dqkv + row0 * C3 + std::int64_t(h) * HS;
            const float* dy = dout + row0 * C + std::int64_t(h) * HS;  // (rows, HS), ld C
            const float* y = out + row0 * C + std::int64_t(h) * HS;
            // S = scale Q K^T into prob, dP = dO V^T into dscore
            gemm(false, true, rows, keys, HS, scale, q, C3, k + key0, C3, 0.0f, prob.data(), keys);
            gemm(false, true, rows, keys, HS, 1.0f, dy, C, v + key0, C3, 0.0f, dscore.data(), keys);
            for (int r = 0; r < rows; ++r) {
              float* p = prob.data() + std::int64_t(r) * keys;
              float* ds = dscore.data() + std::int64_t(r) * keys;
              const int first = start[t0 + r] - lo, seen = t0 + r + 1 - lo;
              const float row_lse = lse[(std::int64_t(b) * NH + h) * T + t0 + r];
              // D = sum over keys of p dp = dy . y, since y = sum over keys of p v.
              float D = 0.0f;
#pragma omp simd reduction(+ : D)
              for (int i = 0; i < HS; ++i) D += dy[std::int64_t(r) * C + i] * y[std::int64_t(r) * C + i];
              // softmax backward (ds = p (dp - D)), then the scale of the scores
              std::fill(p, p + first, 0.0f);
              std::fill(ds, ds + first, 0.0f);
#pragma omp simd
              for (int j = first; j < seen; ++j) {
                p[j] = exp_vec(p[j] - row_lse);
                ds[j] = p[j] * (ds[j] - D) * scale;
              }
              std::fill(p + seen, p + keys, 0.0f);
              std::fill(ds + seen, ds + keys, 0.0f);
            }
            // dQ (rows, HS) += dS K; dK (keys, HS) += dS^T Q; dV (keys, HS) += P^T dO
            gemm(false, false, rows, HS, keys, 1.0f, dscore.data(), keys, k + key0, C3, 1.0f, dq, C3);
            gemm(true, false, keys, HS, rows, 1.0f, dscore.data(), keys, q, C3, 1.0f, dk + key0, C3);
            gemm(true, false, keys, HS, rows, 1.0f, prob.data(), keys, dy, C, 1.0f, dv + key0, C3);
          }
        }
      }
    }
  }
}

}  // namespace llmtrain::cpu
