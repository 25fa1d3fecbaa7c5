// Context parallelism's attention pieces on the CPU: a sequence split over n simulated ranks (head
// and tail chunks), each rank's queries against every rank's key/value block merged by
// log-sum-exp, gives the rows of the textbook (probability-storing) attention over the whole
// sequence; the blocks' backward, with each block's key/value gradients summed over the ranks,
// gives its input gradient. The merge against a hand computation; the packing of key/value
// columns against its definition. [cuda]: the GPU kernels of each piece against the CPU's.
#include <cmath>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "catch_compat.h"
#include "cuda_compare.h"
#include "grad_check.h"
#include "llmtrain/kernels/cpu.h"
#include "ops/ops.h"

using namespace llmtrain;
using namespace llmtrain::test;

namespace {

// Rows of rank r of n (chunks r and 2n-1-r of T / 2n) from a (B,T,W) array into (B,T/n,W).
Vec rows_of(const Vec& whole, int B, int T, int W, ops::Chunks at) {
  const int Tl = at.rows();
  Vec out(std::size_t(B) * Tl * W);
  for (int b = 0; b < B; ++b) {
    for (int i = 0; i < at.count(); ++i) {
      for (int t = 0; t < at.len; ++t) {
        for (int w = 0; w < W; ++w) {
          out[(std::size_t(b) * Tl + i * at.len + t) * W + w] = whole[(std::size_t(b) * T + at.start(i) + t) * W + w];
        }
      }
    }
  }
  return out;
}

ops::Chunks rank_chunks(int r, int n, int T) {
  if (n == 1) return {T, 0, -1};
  return {T / (2 * n), r, 2 * n - 1 - r};
}

Vec nan_values(std::size_t n) { return Vec(n, std::numeric_limits<float>::quiet_NaN()); }

double max_abs_diff(const Vec& a, const Vec& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(double(a[i]) - double(b[i])));
  return worst;
}

}  // namespace

TEST_CASE("context attention: n ranks' blocks merged by log-sum-exp give the whole sequence's attention and gradient",
          "[ops][context]") {
  struct Case {
    int B, T, NH, NKV, HS, n;
  };
  for (const Case c : {Case{2, 16, 2, 2, 4, 2}, Case{1, 32, 4, 2, 8, 4}, Case{2, 24, 4, 1, 4, 3}, Case{1, 8, 2, 2, 4, 1}}) {
    const int B = c.B, T = c.T, NH = c.NH, NKV = c.NKV, HS = c.HS, n = c.n, C = NH * HS, KVC = NKV * HS;
    const int W = C + 2 * KVC, Tl = T / n;
    std::mt19937 rng(17 + n);
    Vec qkv = random_vec(rng, std::size_t(B) * T * W), dout = random_vec(rng, std::size_t(B) * T * C);
    // The independent reference: attention with its (B,NH,T,T) probabilities, and its backward.
    Vec out_ref(std::size_t(B) * T * C), att(std::size_t(B) * NH * T * T), dqkv_ref(qkv.size(), 0.0f);
    cpu::attention_forward(out_ref.data(), att.data(), qkv.data(), B, T, C, NH, NKV);
    cpu::attention_backward(dqkv_ref.data(), dout.data(), qkv.data(), att.data(), B, T, C, NH, NKV);

    std::vector<Vec> local_qkv, kv, out, lse, local_dout;
    for (int r = 0; r < n; ++r) {
      local_qkv.push_back(rows_of(qkv, B, T, W, rank_chunks(r, n, T)));
      local_dout.push_back(rows_of(dout, B, T, C, rank_chunks(r, n, T)));
      kv.emplace_back(std::size_t(B) * Tl * 2 * KVC);
      ops::kv_pack(t(kv[r], {B, Tl, 2 * KVC}), t(local_qkv[r], {B, Tl, W}), NH, NKV);
    }
    // kv_pack: the key and value columns.
    CHECK(kv[0][1] == local_qkv[0][std::size_t(C) + 1]);
    CHECK(kv[0][2 * KVC] == local_qkv[0][std::size_t(W) + C]);
    // Forward: each rank merges its own block, then the others in ring order.
    for (int r = 0; r < n; ++r) {
      const ops::Chunks me = rank_chunks(r, n, T);
      out.emplace_back(std::size_t(B) * Tl * C);
      lse.emplace_back(std::size_t(B) * NH * Tl);
      ops::attention_block_forward(t(out[r], {B, Tl, C}), t(lse[r], {B, NH, Tl}), t(local_qkv[r], {B, Tl, W}),
                                   t(kv[r], {B, Tl, 2 * KVC}), me, me, NH, NKV);
      for (int s = 1; s < n; ++s) {
        const int j = (r + n - s) % n;
        Vec part(out[r].size()), part_lse(lse[r].size());
        ops::attention_block_forward(t(part, {B, Tl, C}), t(part_lse, {B, NH, Tl}), t(local_qkv[r], {B, Tl, W}),
                                     t(kv[j], {B, Tl, 2 * KVC}), me, rank_chunks(j, n, T), NH, NKV);
        ops::attention_lse_merge(t(out[r], {B, Tl, C}), t(lse[r], {B, NH, Tl}), t(part, {B, Tl, C}),
                                 t(part_lse, {B, NH, Tl}));
      }
      const double err = max_abs_diff(out[r], rows_of(out_ref, B, T, C, me));
      INFO("B " << B << " T " << T << " NH " << NH << " NKV " << NKV << " ranks " << n << " rank " << r);
      CHECK(err < 1e-5);
    }
    // Backward: every rank adds into every block's key/value gradient (a ring or a reduce-scatter
    // sums them over the ranks); the queries' gradient stays on their rank.
    std::vector<Vec> dq, dkv;
    for (int r = 0; r < n; ++r) {
      dq.emplace_back(std::size_t(B) * Tl * W, 0.0f);
      dkv.emplace_back(std::size_t(B) * Tl * 2 * KVC, 0.0f);
    }
    for (int r = 0; r < n; ++r) {
      for (int j = 0; j < n; ++j) {
        ops::attention_block_backward(t(dq[r], {B, Tl, W}), t(dkv[j], {B, Tl, 2 * KVC}), t(local_dout[r], {B, Tl, C}),
                                      t(local_qkv[r], {B, Tl, W}), t(out[r], {B, Tl, C}), t(lse[r], {B, NH, Tl}),
                                      t(kv[j], {B, Tl, 2 * KVC}), rank_chunks(r, n, T), rank_chunks(j, n, T), NH, NKV);
      }
    }
    for (int r = 0; r < n; ++r) {
      Vec dqkv(std::size_t(B) * Tl * W);
      ops::qkv_join(t(dqkv, {B, Tl, W}), t(dq[r], {B, Tl, W}), t(dkv[r], {B, Tl, 2 * KVC}), NH, NKV);
      const double err = max_abs_diff(dqkv, rows_of(dqkv_ref, B, T, W, rank_chunks(r, n, T)));
      INFO("backward: B " << B << " T " << T << " NH " << NH << " NKV " << NKV << " ranks " << n << " rank " << r);
      CHECK(err < 1e-5);
    }
  }
}

TEST_CASE("context attention: a packed qkv block, with dq and dkv one tensor, is flash attention", "[ops][context]") {
  const int B = 2, T = 12, NH = 2, NKV = 1, HS = 4, C = NH * HS, W = C + 2 * NKV * HS;
  std::mt19937 rng(5);
  Vec qkv = random_vec(rng, std::size_t(B) * T * W), dout = random_vec(rng, std::size_t(B) * T * C);
  Vec out(std::size_t(B) * T * C), lse(std::size_t(B) * NH * T), flash_out(out.size()), flash_lse(lse.size());
  const ops::Chunks all{T, 0, -1};
  ops::attention_block_forward(t(out, {B, T, C}), t(lse, {B, NH, T}), t(qkv, {B, T, W}), t(qkv, {B, T, W}), all, all,
                               NH, NKV);
  ops::flash_attention_forward(t(flash_out, {B, T, C}), t(flash_lse, {B, NH, T}), t(qkv, {B, T, W}), NH, NKV);
  CHECK(max_abs_diff(out, flash_out) < 1e-5);
  CHECK(max_abs_diff(lse, flash_lse) < 1e-5);
  Vec dqkv(qkv.size(), 0.0f), flash_dqkv(qkv.size(), 0.0f);
  ops::attention_block_backward(t(dqkv, {B, T, W}), t(dqkv, {B, T, W}), t(dout, {B, T, C}), t(qkv, {B, T, W}),
                                t(out, {B, T, C}), t(lse, {B, NH, T}), t(qkv, {B, T, W}), all, all, NH, NKV);
  ops::flash_attention_backward(t(flash_dqkv, {B, T, W}), t(dout, {B, T, C}), t(qkv, {B, T, W}), t(flash_out, {B, T, C}),
                                t(flash_lse, {B, NH, T}), NH, NKV);
  CHECK(max_abs_diff(dqkv, flash_dqkv) < 1e-5);
}

TEST_CASE("context attention: the log-sum-exp merge, by hand", "[ops][context]") {
  // Block a saw scores summing to e^lse = 2 with output (1, 0); block b to 6 with (0, 1): together
  // the softmax weights are 2/8 and 6/8, and the log-sum-exp log 8. A block that saw no key
  // (lse -inf) changes nothing.
  Vec out{1.0f, 0.0f}, lse{std::log(2.0f)}, block_out{0.0f, 1.0f}, block_lse{std::log(6.0f)};
  ops::attention_lse_merge(t(out, {1, 1, 2}), t(lse, {1, 1, 1}), t(block_out, {1, 1, 2}), t(block_lse, {1, 1, 1}));
  CHECK(std::abs(out[0] - 0.25f) < 1e-6);
  CHECK(std::abs(out[1] - 0.75f) < 1e-6);
  CHECK(std::abs(lse[0] - std::log(8.0f)) < 1e-6);
  Vec none_out{5.0f, 5.0f}, none_lse{-std::numeric_limits<float>::infinity()};
  ops::attention_lse_merge(t(out, {1, 1, 2}), t(lse, {1, 1, 1}), t(none_out, {1, 1, 2}), t(none_lse, {1, 1, 1}));
  CHECK(std::abs(out[0] - 0.25f) < 1e-6);
  CHECK(std::abs(lse[0] - std::log(8.0f)) < 1e-6);
}

TEST_CASE("context attention: chunks that do not cover the rows are refused", "[ops][context]") {
  Vec qkv(2 * 8 * 12), out(2 * 8 * 4), lse(2 * 1 * 8);
  CHECK_THROWS(ops::attention_block_forward(t(out, {2, 8, 4}), t(lse, {2, 1, 8}), t(qkv, {2, 8, 12}),
                                            t(qkv, {2, 8, 12}), ops::Chunks{3, 0, 1}, ops::Chunks{8, 0, -1}, 1, 1));
}

TEST_CASE("cuda context attention: block forward and backward, the merge and the packing match the cpu",
          "[cuda][ops][context]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);
  constexpr double tol = 1e-4;
  struct Case {
    int B, T, NH, NKV, HS, n;
  };
  for (const Case c : {Case{2, 16, 2, 2, 8, 2}, Case{1, 24, 4, 2, 16, 3}, Case{1, 40, 2, 1, 36, 2}}) {
    const int B = c.B, T = c.T, NH = c.NH, NKV = c.NKV, HS = c.HS, n = c.n, C = NH * HS, KVC = NKV * HS;
    const int W = C + 2 * KVC, Tl = T / n;
    CAPTURE(B, T, NH, NKV, HS, n);
    std::mt19937 rng(31 + T);
    // Rank 0's queries against rank n-1's block (every key of its head chunk is seen by rank 0's
    // tail chunk) and against its own (the causal diagonal), the own block packed in qkv itself.
    const ops::Chunks me = rank_chunks(0, n, T), them = rank_chunks(n - 1, n, T);
    Vec qkv = random_vec(rng, std::size_t(B) * Tl * W), other = random_vec(rng, std::size_t(B) * Tl * W);
    Vec dout = random_vec(rng, std::size_t(B) * Tl * C);
    Vec kv(std::size_t(B) * Tl * 2 * KVC);
    ops::kv_pack(t(kv, {B, Tl, 2 * KVC}), t(other, {B, Tl, W}), NH, NKV);
    const DeviceArray<float> d_qkv(qkv), d_other(other), d_dout(dout), d_kv(nan_values(kv.size()));
    ops::kv_pack(d_kv.tensor({B, Tl, 2 * KVC}), d_other.tensor({B, Tl, W}), NH, NKV);
    require_close("kv_pack", d_kv.to_host(), kv, 0.0);
    // Forward: the own block, the other, merged.
    Vec out(std::size_t(B) * Tl * C), lse(std::size_t(B) * NH * Tl), part(out.size()), part_lse(lse.size());
    ops::attention_block_forward(t(out, {B, Tl, C}), t(lse, {B, NH, Tl}), t(qkv, {B, Tl, W}), t(qkv, {B, Tl, W}), me, me,
                                 NH, NKV);
    ops::attention_block_forward(t(part, {B, Tl, C}), t(part_lse, {B, NH, Tl}), t(qkv, {B, Tl, W}), t(kv, {B, Tl, 2 * KVC}),
                                 me, them, NH, NKV);
    const DeviceArray<float> d_out(nan_values(out.size())), d_lse(nan_values(lse.size())), d_part(nan_values(part.size())),
        d_part_lse(nan_values(lse.size()));
    ops::attention_block_forward(d_out.tensor({B, Tl, C}), d_lse.tensor({B, NH, Tl}), d_qkv.tensor({B, Tl, W}),
                                 d_qkv.tensor({B, Tl, W}), me, me, NH, NKV);
    ops::attention_block_forward(d_part.tensor({B, Tl, C}), d_part_lse.tensor({B, NH, Tl}), d_qkv.tensor({B, Tl, W}),
                                 d_kv.tensor({B, Tl, 2 * KVC}), me, them, NH, NKV);
    require_close("own block out", d_out.to_host(), out, tol);
    require_close("own block lse", d_lse.to_host(), lse, tol);
    require_close("other block out", d_part.to_host(), part, tol);
    // Rows that see no key of the other block: lse -inf on both.
    const Vec got_part_lse = d_part_lse.to_host();
    for (std::size_t i = 0; i < part_lse.size(); ++i) {
      if (std::isinf(part_lse[i])) {
        CHECK(std::isinf(got_part_lse[i]));
      } else {
        CHECK(std::abs(got_part_lse[i] - part_lse[i]) < tol * std::max(1.0f, std::abs(part_lse[i])));
      }
    }
    ops::attention_lse_merge(t(out, {B, Tl, C}), t(lse, {B, NH, Tl}), t(part, {B, Tl, C}), t(part_lse, {B, NH, Tl}));
    ops::attention_lse_merge(d_out.tensor({B, Tl, C}), d_lse.tensor({B, NH, Tl}), d_part.tensor({B, Tl, C}),
                             d_part_lse.tensor({B, NH, Tl}));
    require_close("merged out", d_out.to_host(), out, tol);
    require_close("merged lse", d_lse.to_host(), lse, tol);
    // Backward against the merged softmax: into nonzero gradients (they accumulate).
    const Vec dq0 = random_vec(rng, qkv.size()), dkv0 = random_vec(rng, kv.size());
    Vec dq = dq0, dkv = dkv0;
    ops::attention_block_backward(t(dq, {B, Tl, W}), t(dq, {B, Tl, W}), t(dout, {B, Tl, C}), t(qkv, {B, Tl, W}),
                                  t(out, {B, Tl, C}), t(lse, {B, NH, Tl}), t(qkv, {B, Tl, W}), me, me, NH, NKV);
    ops::attention_block_backward(t(dq, {B, Tl, W}), t(dkv, {B, Tl, 2 * KVC}), t(dout, {B, Tl, C}), t(qkv, {B, Tl, W}),
                                  t(out, {B, Tl, C}), t(lse, {B, NH, Tl}), t(kv, {B, Tl, 2 * KVC}), me, them, NH, NKV);
    const DeviceArray<float> d_dq(dq0), d_dkv(dkv0);
    ops::attention_block_backward(d_dq.tensor({B, Tl, W}), d_dq.tensor({B, Tl, W}), d_dout.tensor({B, Tl, C}),
                                  d_qkv.tensor({B, Tl, W}), d_out.tensor({B, Tl, C}), d_lse.tensor({B, NH, Tl}),
                                  d_qkv.tensor({B, Tl, W}), me, me, NH, NKV);
    ops::attention_block_backward(d_dq.tensor({B, Tl, W}), d_dkv.tensor({B, Tl, 2 * KVC}), d_dout.tensor({B, Tl, C}),
                                  d_qkv.tensor({B, Tl, W}), d_out.tensor({B, Tl, C}), d_lse.tensor({B, NH, Tl}),
                                  d_kv.tensor({B, Tl, 2 * KVC}), me, them, NH, NKV);
    const Vec got_dq = d_dq.to_host(), got_dkv = d_dkv.to_host();
    require_changed("dq", got_dq, dq0);
    require_changed("dkv", got_dkv, dkv0);
    require_close("dq (own block's dk, dv included)", got_dq, dq, tol);
    require_close("other block's dkv", got_dkv, dkv, tol);
    // The join: query columns of dq next to dkv.
    Vec joined(qkv.size());
    ops::qkv_join(t(joined, {B, Tl, W}), t(dq, {B, Tl, W}), t(dkv, {B, Tl, 2 * KVC}), NH, NKV);
    const DeviceArray<float> d_joined(nan_values(joined.size()));
    ops::qkv_join(d_joined.tensor({B, Tl, W}), d_dq.tensor({B, Tl, W}), d_dkv.tensor({B, Tl, 2 * KVC}), NH, NKV);
    require_close("qkv_join", d_joined.to_host(), joined, tol);
    for (const auto* a : {&d_qkv, &d_kv, &d_out, &d_lse, &d_part, &d_part_lse, &d_dq, &d_dkv, &d_joined}) {
      require_guards("context attention", *a);
    }
  }
}

TEST_CASE("cuda context attention on tensor cores: n ranks' bf16 blocks, merged, give one-rank flash attention",
          "[cuda][ops][context]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);
  // bf16 inputs (the reference reads the same rounded values in fp32); the device rounds P and dS
  // to bf16 for the products, and the backward reads the merged out rounded to bf16.
  constexpr double tol = 2e-2;
  struct Case {
    int B, len, NH, NKV, HS, n;  // len: rows per chunk (T = 2 n len)
  };
  // Chunks of 72 rows: two query and key tiles of 64 per chunk, the second partial; 40 and 24:
  // one partial tile. GQA (NKV < NH) everywhere.
  for (const Case c : {Case{1, 72, 4, 2, 64, 2}, Case{2, 24, 4, 1, 64, 4}, Case{1, 40, 2, 1, 128, 2},
                       Case{1, 24, 4, 2, 128, 4}}) {
    const int B = c.B, n = c.n, T = 2 * n * c.len, NH = c.NH, NKV = c.NKV, HS = c.HS, C = NH * HS, KVC = NKV * HS;
    const int W = C + 2 * KVC, Tl = T / n;
    CAPTURE(B, T, NH, NKV, HS, n);
    std::mt19937 rng(101 + T + HS);
    Vec qkv = round_bf16(random_vec(rng, std::size_t(B) * T * W));
    Vec dout = round_bf16(random_vec(rng, std::size_t(B) * T * C));
    // The reference: one rank's CPU flash attention over the whole sequence.
    Vec out_ref(std::size_t(B) * T * C), lse_ref(std::size_t(B) * NH * T), dqkv_ref(qkv.size());
    ops::flash_attention_forward(t(out_ref, {B, T, C}), t(lse_ref, {B, NH, T}), t(qkv, {B, T, W}), NH, NKV);
    ops::flash_attention_backward(t(dqkv_ref, {B, T, W}), t(dout, {B, T, C}), t(qkv, {B, T, W}), t(out_ref, {B, T, C}),
                                  t(lse_ref, {B, NH, T}), NH, NKV);
    // lse (B,NH,T) rows of rank r: positions as (B,NH,T) with width 1 per (b, h) sequence.
    const auto lse_rows = [&](const Vec& whole, ops::Chunks at) { return rows_of(whole, B * NH, T, 1, at); };

    std::vector<std::unique_ptr<DeviceArray<Bf16>>> d_qkv, d_dout, d_kv;
    std::vector<std::unique_ptr<DeviceArray<float>>> d_out, d_lse;
    for (int r = 0; r < n; ++r) {
      const ops::Chunks me = rank_chunks(r, n, T);
      d_qkv.push_back(std::make_unique<DeviceArray<Bf16>>(to_bf16(rows_of(qkv, B, T, W, me))));
      d_dout.push_back(std::make_unique<DeviceArray<Bf16>>(to_bf16(rows_of(dout, B, T, C, me))));
      d_kv.push_back(std::make_unique<DeviceArray<Bf16>>(std::vector<Bf16>(std::size_t(B) * Tl * 2 * KVC)));
      ops::kv_pack(d_kv[r]->tensor({B, Tl, 2 * KVC}), d_qkv[r]->tensor({B, Tl, W}), NH, NKV);
    }
    // Forward: the own block (packed in qkv itself), then the others in ring order, merged.
    for (int r = 0; r < n; ++r) {
      const ops::Chunks me = rank_chunks(r, n, T);
      d_out.push_back(std::make_unique<DeviceArray<float>>(nan_values(std::size_t(B) * Tl * C)));
      d_lse.push_back(std::make_unique<DeviceArray<float>>(nan_values(std::size_t(B) * NH * Tl)));
      const Tensor out = d_out[r]->tensor({B, Tl, C}), lse = d_lse[r]->tensor({B, NH, Tl});
      ops::attention_block_forward(out, lse, d_qkv[r]->tensor({B, Tl, W}), d_qkv[r]->tensor({B, Tl, W}), me, me, NH,
                                   NKV);
      for (int s = 1; s < n; ++s) {
        const int j = (r + n - s) % n;
        const DeviceArray<float> part(nan_values(std::size_t(B) * Tl * C)), part_lse(nan_values(std::size_t(B) * NH * Tl));
        ops::attention_block_forward(part.tensor({B, Tl, C}), part_lse.tensor({B, NH, Tl}), d_qkv[r]->tensor({B, Tl, W}),
                                     d_kv[j]->tensor({B, Tl, 2 * KVC}), me, rank_chunks(j, n, T), NH, NKV);
        ops::attention_lse_merge(out, lse, part.tensor({B, Tl, C}), part_lse.tensor({B, NH, Tl}));
      }
      INFO("rank " << r);
      require_close("out", d_out[r]->to_host(), rows_of(out_ref, B, T, C, me), tol);
      require_close("lse", d_lse[r]->to_host(), lse_rows(lse_ref, me), 1e-3);
    }
    // Backward against the merged softmax: each rank adds into every block's key/value gradient
    // (its own block's into its dq, which holds the packed qkv's columns).
    std::vector<std::unique_ptr<DeviceArray<float>>> d_dq, d_dkv;
    for (int r = 0; r < n; ++r) {
      d_dq.push_back(std::make_unique<DeviceArray<float>>(Vec(std::size_t(B) * Tl * W, 0.0f)));
      d_dkv.push_back(std::make_unique<DeviceArray<float>>(Vec(std::size_t(B) * Tl * 2 * KVC, 0.0f)));
    }
    for (int r = 0; r < n; ++r) {
      const ops::Chunks me = rank_chunks(r, n, T);
      const DeviceArray<Bf16> out_bf16(to_bf16(d_out[r]->to_host()));
      for (int j = 0; j < n; ++j) {
        const bool own = j == r;
        ops::attention_block_backward(d_dq[r]->tensor({B, Tl, W}),
                                      own ? d_dq[r]->tensor({B, Tl, W}) : d_dkv[j]->tensor({B, Tl, 2 * KVC}),
                                      d_dout[r]->tensor({B, Tl, C}), d_qkv[r]->tensor({B, Tl, W}),
                                      out_bf16.tensor({B, Tl, C}), d_lse[r]->tensor({B, NH, Tl}),
                                      own ? d_qkv[r]->tensor({B, Tl, W}) : d_kv[j]->tensor({B, Tl, 2 * KVC}), me,
                                      rank_chunks(j, n, T), NH, NKV);
      }
    }
    for (int r = 0; r < n; ++r) {
      const Vec dq = d_dq[r]->to_host(), dkv = d_dkv[r]->to_host();
      const Vec want = rows_of(dqkv_ref, B, T, W, rank_chunks(r, n, T));
      Vec got_q, got_k, got_v, want_q, want_k, want_v;
      for (std::size_t row = 0; row < std::size_t(B) * Tl; ++row) {
        for (int col = 0; col < W; ++col) {
          const std::size_t i = row * W + col;
          const float g = col < C ? dq[i] : dq[i] + dkv[row * 2 * KVC + (col - C)];
          (col < C ? got_q : col < C + KVC ? got_k : got_v).push_back(g);
          (col < C ? want_q : col < C + KVC ? want_k : want_v).push_back(want[i]);
        }
      }
      INFO("rank " << r);
      require_close("dQ", got_q, want_q, tol);
      require_close("dK", got_k, want_k, tol);
      require_close("dV", got_v, want_v, tol);
    }
    for (int r = 0; r < n; ++r) {
      for (const auto* a : {d_out[r].get(), d_lse[r].get(), d_dq[r].get(), d_dkv[r].get()}) require_guards("cp", *a);
    }
  }
}
