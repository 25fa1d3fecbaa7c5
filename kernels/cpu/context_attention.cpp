// Context parallelism's attention on the CPU: queries against one block of keys and values at
// their true positions in the sequence (llmtrain/kernels/context_attention.h), the log-sum-exp
// merge of two blocks' results, and the packing of key/value columns. The blocking follows
// flash_attention.cpp: blocks of query rows inside one chunk (contiguous positions), their scores
// against the keys each block may see in every chunk of the key block, sgemm on the blocks.
// Document masks: seg holds the whole sequences' segment ids, read at the rows' positions; a
// block's keys in each chunk start at its first row's document (earlier keys are skipped).
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
constexpr float minus_infinity = -std::numeric_limits<float>::infinity();

// A block of query rows: local rows [t0, t0 + rows) at positions p0 .. p0 + rows - 1.
struct QueryBlock {
  int t0, rows, p0;
};

std::vector<QueryBlock> query_blocks(kernels::Chunks q) {
  std::vector<QueryBlock> out;
  for (int i = 0; i < q.count(); ++i) {
    for (int t = 0; t < q.len; t += query_block) {
      out.push_back({i * q.len + t, std::min(query_block, q.len - t), q.start(i) + t});
    }
  }
  return out;
}

// The keys of key chunk i that row position p sees: the first `seen` of the chunk.
int seen_keys(kernels::Chunks k, int i, int p) { return std::clamp(p - k.start(i) + 1, 0, k.len); }
// The first key of key chunk i in the document that begins at position `start`.
int first_key(kernels::Chunks k, int i, int start) { return std::clamp(start - k.start(i), 0, k.len); }

// The keys of each chunk a query block computes scores for: [lo[i], lo[i] + width[i]) of chunk i,
// side by side in the score rows (columns from off[i]), total in all.
struct KeySpan {
  int lo[2] = {0, 0}, width[2] = {0, 0}, off[2] = {0, 0}, total = 0;
  KeySpan(kernels::Chunks k, int last, int first_start) {
    for (int i = 0; i < k.count(); ++i) {
      const int vis = seen_keys(k, i, last);
      lo[i] = std::min(vis, first_key(k, i, first_start));
      width[i] = vis - lo[i];
      off[i] = total;
      total += width[i];
    }
  }
};

}  // namespace

void attention_block_forward(float* out, float* lse, const float* qkv, const float* kv, int B, int Tq, int Tk, int C,
                             int NH, int NKV, int kv_width, kernels::Chunks q_at, kernels::Chunks k_at,
                             const std::int32_t* seg, int T) {
  const int HS = C / NH, group = NH / NKV, KVC = NKV * HS;
  const float scale = 1.0f / std::sqrt(float(HS));
  const std::int64_t QKV = std::int64_t(C) + 2 * KVC, ld = kv_width;
  const std::int64_t k_col = kv_width - 2 * KVC, v_col = k_col + KVC;
  const std::vector<QueryBlock> blocks = query_blocks(q_at);
  const std::vector<int> starts = document_starts(seg, seg ? B : 0, T);
  // the first position of the document of position p of sequence b
  const auto doc = [&](int b, int p) { return seg ? starts[std::size_t(b) * std::size_t(T) + std::size_t(p)] : 0; };
  const int nblocks = int(blocks.size());
  const bool threads = worth_threads(std::int64_t(B) * NH * Tq * Tk * HS);
#pragma omp parallel if (threads)
  {
    std::vector<float> score(std::size_t(query_block) * std::size_t(std::max(Tk, 1)));
#pragma omp for collapse(3) schedule(dynamic)
    for (int b = 0; b < B; ++b) {
      for (int h = 0; h < NH; ++h) {
        for (int bi = 0; bi < nblocks; ++bi) {
          const QueryBlock& qb = blocks[std::size_t(bi)];
          const float* q = qkv + (std::int64_t(b) * Tq + qb.t0) * QKV + std::int64_t(h) * HS;
          float* o = out + (std::int64_t(b) * Tq + qb.t0) * C + std::int64_t(h) * HS;
          float* l = lse + (std::int64_t(b) * NH + h) * Tq + qb.t0;
          // The keys of each chunk the block's rows may see, side by side in the scores.
          const KeySpan span(k_at, qb.p0 + qb.rows - 1, doc(b, qb.p0));
          const int total = span.total;
          if (total == 0) {
            for (int r = 0; r < qb.rows; ++r) {
              std::fill(o + std::int64_t(r) * C, o + std::int64_t(r) * C + HS, 0.0f);
              l[r] = minus_infinity;
            }
            continue;
          }
          const float* kbase = kv + std::int64_t(b) * Tk * ld + k_col + std::int64_t(h / group) * HS;
          const float* vbase = kv + std::int64_t(b) * Tk * ld + v_col + std::int64_t(h / group) * HS;
          for (int i = 0; i < k_at.count(); ++i) {
            if (span.width[i] == 0) continue;
            gemm(false, true, qb.rows, span.width[i], HS, scale, q, QKV,
                       kbase + (std::int64_t(i) * k_at.len + span.lo[i]) * ld, ld, 0.0f, score.data() + span.off[i],
                       total);
          }
          for (int r = 0; r < qb.rows; ++r) {
            float* s = score.data() + std::int64_t(r) * total;
            // row r sees columns [first[i], seen[i]) of chunk i's span
            const int p = qb.p0 + r;
            int first[2] = {0, 0}, seen[2] = {0, 0};
            for (int i = 0; i < k_at.count(); ++i) {
              first[i] = span.off[i] + first_key(k_at, i, doc(b, p)) - span.lo[i];
              seen[i] = span.off[i] + seen_keys(k_at, i, p) - span.lo[i];
            }
            float max_score = minus_infinity;
            for (int i = 0; i < k_at.count(); ++i) {
              for (int j = first[i]; j < seen[i]; ++j) max_score = std::max(max_score, s[j]);
            }
            if (max_score == minus_infinity) {
              l[r] = minus_infinity;
              std::fill(s, s + total, 0.0f);
              continue;
            }
            float sum = 0.0f;
            for (int i = 0; i < k_at.count(); ++i) {
              for (int j = first[i]; j < seen[i]; ++j) sum += exp_vec(s[j] - max_score);
            }
            const float row_lse = max_score + std::log(sum);
            l[r] = row_lse;
            for (int i = 0; i < k_at.count(); ++i) {
              std::fill(s + span.off[i], s + first[i], 0.0f);
              for (int j = first[i]; j < seen[i]; ++j) s[j] = exp_vec(s[j] - row_lse);
              std::fill(s + seen[i], s + span.off[i] + span.width[i], 0.0f);
            }
          }
          // O (rows, HS) = sum over the chunks of P V
          float beta = 0.0f;
          for (int i = 0; i < k_at.count(); ++i) {
            if (span.width[i] == 0) continue;
            gemm(false, false, qb.rows, HS, span.width[i], 1.0f, score.data() + span.off[i], total,
                       vbase + (std::int64_t(i) * k_at.len + span.lo[i]) * ld, ld, beta, o, C);
            beta = 1.0f;
          }
        }
      }
    }
  }
}

void attention_block_backward(float* dq, float* dkv, const float* dout, const float* qkv, const float* out,
                              const float* lse, const float* kv, int B, int Tq, int Tk, int C, int NH, int NKV,
                              int kv_width, kernels::Chunks q_at, kernels::Chunks k_at, const std::int32_t* seg,
                              int T) {
  const int HS = C / NH, group = NH / NKV, KVC = NKV * HS;
  const float scale = 1.0f / std::sqrt(float(HS));
  const std::int64_t QKV = std::int64_t(C) + 2 * KVC, ld = kv_width;
  const std::int64_t k_col = kv_width - 2 * KVC, v_col = k_col + KVC;
  const std::vector<QueryBlock> blocks = query_blocks(q_at);
  const std::vector<int> starts = document_starts(seg, seg ? B : 0, T);
  // the first position of the document of position p of sequence b
  const auto doc = [&](int b, int p) { return seg ? starts[std::size_t(b) * std::size_t(T) + std::size_t(p)] : 0; };
  const bool threads = worth_threads(std::int64_t(B) * NH * Tq * Tk * HS);
  // One task per (batch, key/value head): it owns that head's dK, dV and its query heads' dQ.
#pragma omp parallel if (threads)
  {
    const std::size_t scratch = std::size_t(query_block) * std::size_t(std::max(Tk, 1));
    std::vector<float> prob(scratch), dscore(scratch);
#pragma omp for collapse(2) schedule(dynamic)
    for (int b = 0; b < B; ++b) {
      for (int kvh = 0; kvh < NKV; ++kvh) {
        const std::int64_t kv0 = std::int64_t(b) * Tk * ld;
        const float* kbase = kv + kv0 + k_col + std::int64_t(kvh) * HS;
        const float* vbase = kv + kv0 + v_col + std::int64_t(kvh) * HS;
        float* dkbase = dkv + kv0 + k_col + std::int64_t(kvh) * HS;
        float* dvbase = dkv + kv0 + v_col + std::int64_t(kvh) * HS;
        for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
          for (const QueryBlock& qb : blocks) {
            const KeySpan span(k_at, qb.p0 + qb.rows - 1, doc(b, qb.p0));
            const int total = span.total;
            if (total == 0) continue;
            const std::int64_t row0 = std::int64_t(b) * Tq + qb.t0;
            const float* q = qkv + row0 * QKV + std::int64_t(h) * HS;
            float* dqh = dq + row0 * QKV + std::int64_t(h) * HS;
            const float* dy = dout + row0 * C + std::int64_t(h) * HS;
            const float* y = out + row0 * C + std::int64_t(h) * HS;
            const float* l = lse + (std::int64_t(b) * NH + h) * Tq + qb.t0;
            for (int i = 0; i < k_at.count(); ++i) {
              if (span.width[i] == 0) continue;
              const std::int64_t k0 = (std::int64_t(i) * k_at.len + span.lo[i]) * ld;
              gemm(false, true, qb.rows, span.width[i], HS, scale, q, QKV, kbase + k0, ld, 0.0f,
                         prob.data() + span.off[i], total);
              gemm(false, true, qb.rows, span.width[i], HS, 1.0f, dy, C, vbase + k0, ld, 0.0f,
                         dscore.data() + span.off[i], total);
            }
            for (int r = 0; r < qb.rows; ++r) {
              float* p = prob.data() + std::int64_t(r) * total;
              float* ds = dscore.data() + std::int64_t(r) * total;
              float D = 0.0f;
              for (int e = 0; e < HS; ++e) D += dy[std::int64_t(r) * C + e] * y[std::int64_t(r) * C + e];
              const int pos = qb.p0 + r;
              for (int i = 0; i < k_at.count(); ++i) {
                const int end = span.off[i] + span.width[i];
                const int first = span.off[i] + first_key(k_at, i, doc(b, pos)) - span.lo[i];
                const int seen = span.off[i] + seen_keys(k_at, i, pos) - span.lo[i];
                std::fill(p + span.off[i], p + first, 0.0f);
                std::fill(ds + span.off[i], ds + first, 0.0f);
                for (int j = first; j < seen; ++j) {
                  p[j] = exp_vec(p[j] - l[r]);
                  ds[j] = p[j] * (ds[j] - D) * scale;
                }
                std::fill(p + seen, p + end, 0.0f);
                std::fill(ds + seen, ds + end, 0.0f);
              }
            }
            for (int i = 0; i < k_at.count(); ++i) {
              if (span.width[i] == 0) continue;
              const std::int64_t k0 = (std::int64_t(i) * k_at.len + span.lo[i]) * ld;
              const int off = span.off[i], width = span.width[i];
              // dQ += dS K, dK += dS^T Q, dV += P^T dO
              gemm(false, false, qb.rows, HS, width, 1.0f, dscore.data() + off, total, kbase + k0, ld, 1.0f,
                         dqh, QKV);
              gemm(true, false, width, HS, qb.rows, 1.0f, dscore.data() + off, total, q, QKV, 1.0f,
                         dkbase + k0, ld);
              gemm(true, false, width, HS, qb.rows, 1.0f, prob.data() + off, total, dy, C, 1.0f, dvbase + k0,
                         ld);
            }
          }
        }
      }
    }
  }
}

void attention_lse_merge(float* out, float* lse, const float* block_out, const float* block_lse, int B, int T, int C,
                         int NH) {
  const int HS = C / NH;
#pragma omp parallel for collapse(2) if (worth_threads(std::int64_t(B) * T * C))
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < NH; ++h) {
      for (int t = 0; t < T; ++t) {
        float& l = lse[(std::int64_t(b) * NH + h) * T + t];
        const float lb = block_lse[(std::int64_t(b) * NH + h) * T + t];
        if (lb == minus_infinity) continue;  // the block held no key this row sees
        float* o = out + (std::int64_t(b) * T + t) * C + std::int64_t(h) * HS;
        const float* ob = block_out + (std::int64_t(b) * T + t) * C + std::int64_t(h) * HS;
        const float m = std::max(l, lb);
        const float merged = m + std::log(std::exp(l - m) + std::exp(lb - m));
        const float wa = std::exp(l - merged), wb = std::exp(lb - merged);
        for (int e = 0; e < HS; ++e) o[e] = wa * o[e] + wb * ob[e];
        l = merged;
      }
    }
  }
}

void kv_pack(float* kv, const float* qkv, std::int64_t N, int C, int KVC) {
  const std::int64_t QKV = std::int64_t(C) + 2 * KVC;
  for (std::int64_t n = 0; n < N; ++n) std::copy_n(qkv + n * QKV + C, 2 * KVC, kv + n * 2 * KVC);
}

void qkv_join(float* dqkv, const float* dq, const float* dkv, std::int64_t N, int C, int KVC) {
  const std::int64_t QKV = std::int64_t(C) + 2 * KVC;
  for (std::int64_t n = 0; n < N; ++n) {
    if (dq != dqkv) std::copy_n(dq + n * QKV, C, dqkv + n * QKV);  // dq may be dqkv itself
    std::copy_n(dkv + n * 2 * KVC, 2 * KVC, dqkv + n * QKV + C);
  }
}

}  // namespace llmtrain::cpu
