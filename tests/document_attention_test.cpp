// Document masks of packed sequences in the CPU attention kernels. Flash attention with segment
// ids against the textbook attention run on each document alone (its own causal sequence): the
// same output and input gradient, with three or more documents a sequence, boundaries inside and
// across the kernel's 64-row query blocks, a one-token document and grouped-query heads. Context
// parallelism's block kernels with the whole sequences' ids, over 2 and 4 simulated ranks merged
// by log-sum-exp, against flash attention with the mask. [cuda]: the GPU's block kernels with the
// mask (CUDA cores in fp32, tensor cores in bf16 at head sizes 64 and 128) against the CPU's.
#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "catch_compat.h"
#include "cuda_compare.h"
#include "grad_check.h"
#include "llmtrain/kernels/cpu.h"
#include "ops/ops.h"

using namespace llmtrain;
using namespace llmtrain::test;

namespace {

using Ids = std::vector<std::int32_t>;

// Segment ids (B,T) from each sequence's document starts (0 first).
Ids segments_of(const std::vector<std::vector<int>>& starts, int T) {
  Ids seg;
  for (const auto& s : starts) {
    for (int t = 0; t < T; ++t) seg.push_back(std::int32_t(std::upper_bound(s.begin(), s.end(), t) - s.begin() - 1));
  }
  return seg;
}

double max_abs_diff(const Vec& a, const Vec& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(double(a[i]) - double(b[i])));
  return worst;
}

double max_abs(const Vec& a) {
  double m = 0.0;
  for (const float x : a) m = std::max(m, double(std::abs(x)));
  return m;
}

Vec rows_of(const Vec& whole, int B, int T, int W, ops::Chunks at) {
  const int Tl = at.rows();
  Vec out(std::size_t(B) * Tl * W);
  for (int b = 0; b < B; ++b) {
    for (int i = 0; i < at.count(); ++i) {
      for (int t = 0; t < at.len; ++t) {
        std::copy_n(&whole[(std::size_t(b) * T + at.start(i) + t) * W], W, &out[(std::size_t(b) * Tl + i * at.len + t) * W]);
      }
    }
  }
  return out;
}

}  // namespace

TEST_CASE("flash attention with a document mask is causal attention of each document alone", "[ops][flash][documents]") {
  const int B = 2, T = 150, NH = 4, NKV = 2, HS = 8, C = NH * HS, W = C + 2 * NKV * HS;
  const std::vector<std::vector<int>> starts{{0, 37, 70, 140}, {0, 5, 6, 64, 90}};
  Ids seg = segments_of(starts, T);
  std::mt19937 rng(3);
  Vec qkv = random_vec(rng, std::size_t(B) * T * W), dout = random_vec(rng, std::size_t(B) * T * C);
  // The reference: each document as a sequence of its own through the textbook attention.
  Vec out_ref(std::size_t(B) * T * C), dqkv_ref(qkv.size(), 0.0f);
  for (int b = 0; b < B; ++b) {
    for (std::size_t d = 0; d < starts[std::size_t(b)].size(); ++d) {
      const int s = starts[std::size_t(b)][d];
      const int e = d + 1 < starts[std::size_t(b)].size() ? starts[std::size_t(b)][d + 1] : T, n = e - s;
      const std::size_t q0 = (std::size_t(b) * T + s) * W, o0 = (std::size_t(b) * T + s) * C;
      Vec dq(std::size_t(n) * W, 0.0f), att(std::size_t(NH) * n * n);
      cpu::attention_forward(&out_ref[o0], att.data(), &qkv[q0], 1, n, C, NH, NKV);
      cpu::attention_backward(dq.data(), &dout[o0], &qkv[q0], att.data(), 1, n, C, NH, NKV);
      std::copy(dq.begin(), dq.end(), dqkv_ref.begin() + std::ptrdiff_t(q0));
    }
  }
  Vec out(out_ref.size()), lse(std::size_t(B) * NH * T), dqkv(qkv.size()), again(qkv.size());
  ops::flash_attention_forward(t(out, {B, T, C}), t(lse, {B, NH, T}), t(qkv, {B, T, W}), NH, NKV,
                               ops::AttentionKernels::flash, ti(seg, {B, T}));
  CHECK(max_abs_diff(out, out_ref) < 1e-5);
  for (Vec* grads : {&dqkv, &again}) {
    ops::flash_attention_backward(t(*grads, {B, T, W}), t(dout, {B, T, C}), t(qkv, {B, T, W}), t(out, {B, T, C}),
                                  t(lse, {B, NH, T}), NH, NKV, ops::AttentionKernels::flash, ops::Accumulate::no,
                                  ti(seg, {B, T}));
  }
  CHECK(max_abs(dqkv_ref) > 0.1);
  CHECK(max_abs_diff(dqkv, dqkv_ref) < 1e-5);
  CHECK(dqkv == again);  // deterministic: the same bits twice
  // The mask matters: plain causal attention differs.
  Vec causal(out.size()), causal_lse(lse.size());
  ops::flash_attention_forward(t(causal, {B, T, C}), t(causal_lse, {B, NH, T}), t(qkv, {B, T, W}), NH, NKV);
  CHECK(max_abs_diff(causal, out_ref) > 1e-2);
}

TEST_CASE("flash attention refuses segment ids that decrease", "[ops][flash][documents]") {
  const int B = 1, T = 4, NH = 1, C = 4, W = 3 * C;
  Vec qkv(std::size_t(T) * W, 0.5f), out(std::size_t(T) * C), lse(std::size_t(T) * NH);
  Ids seg{0, 1, 0, 1};
  std::string message;
  try {
    ops::flash_attention_forward(t(out, {B, T, C}), t(lse, {B, NH, T}), t(qkv, {B, T, W}), NH, NH,
                                 ops::AttentionKernels::flash, ti(seg, {B, T}));
  } catch (const std::exception& e) {
    message = e.what();
  }
  CAPTURE(message);
  CHECK(message.find("segments: decrease at sequence 0, position 2") != std::string::npos);
}

TEST_CASE("context attention with a document mask over 2 and 4 ranks is flash attention with it",
          "[ops][context][documents]") {
  for (const int n : {2, 4}) {
    const int B = 2, T = 48, NH = 2, NKV = 1, HS = 4, C = NH * HS, KVC = NKV * HS, W = C + 2 * KVC, Tl = T / n;
    // Boundaries inside chunks, at a chunk's edge, and a document spanning several chunks.
    Ids seg = segments_of({{0, 5, 13, 30}, {0, 12, 19, 20, 41}}, T);
    std::mt19937 rng(11 + n);
    Vec qkv = random_vec(rng, std::size_t(B) * T * W), dout = random_vec(rng, std::size_t(B) * T * C);
    Vec out_ref(std::size_t(B) * T * C), lse_ref(std::size_t(B) * NH * T), dqkv_ref(qkv.size());
    ops::flash_attention_forward(t(out_ref, {B, T, C}), t(lse_ref, {B, NH, T}), t(qkv, {B, T, W}), NH, NKV,
                                 ops::AttentionKernels::flash, ti(seg, {B, T}));
    ops::flash_attention_backward(t(dqkv_ref, {B, T, W}), t(dout, {B, T, C}), t(qkv, {B, T, W}), t(out_ref, {B, T, C}),
                                  t(lse_ref, {B, NH, T}), NH, NKV, ops::AttentionKernels::flash, ops::Accumulate::no,
                                  ti(seg, {B, T}));
    const auto chunks = [&](int r) { return ops::Chunks{T / (2 * n), r, 2 * n - 1 - r}; };
    std::vector<Vec> local, kv, out, lse, local_dout, dq, dkv;
    for (int r = 0; r < n; ++r) {
      local.push_back(rows_of(qkv, B, T, W, chunks(r)));
      local_dout.push_back(rows_of(dout, B, T, C, chunks(r)));
      kv.emplace_back(std::size_t(B) * Tl * 2 * KVC);
      ops::kv_pack(t(kv[r], {B, Tl, 2 * KVC}), t(local[r], {B, Tl, W}), NH, NKV);
    }
    for (int r = 0; r < n; ++r) {
      out.emplace_back(std::size_t(B) * Tl * C);
      lse.emplace_back(std::size_t(B) * NH * Tl);
      for (int s = 0; s < n; ++s) {
        const int j = (r + n - s) % n;
        Vec part(out[r].size()), part_lse(lse[r].size());
        Vec& o = s == 0 ? out[r] : part;
        Vec& l = s == 0 ? lse[r] : part_lse;
        ops::attention_block_forward(t(o, {B, Tl, C}), t(l, {B, NH, Tl}), t(local[r], {B, Tl, W}),
                                     t(kv[j], {B, Tl, 2 * KVC}), chunks(r), chunks(j), NH, NKV, ti(seg, {B, T}));
        if (s > 0) {
          ops::attention_lse_merge(t(out[r], {B, Tl, C}), t(lse[r], {B, NH, Tl}), t(part, {B, Tl, C}),
                                   t(part_lse, {B, NH, Tl}));
        }
      }
      INFO("ranks " << n << " rank " << r);
      CHECK(max_abs_diff(out[r], rows_of(out_ref, B, T, C, chunks(r))) < 1e-5);
      dq.emplace_back(std::size_t(B) * Tl * W, 0.0f);
      dkv.emplace_back(std::size_t(B) * Tl * 2 * KVC, 0.0f);
    }
    for (int r = 0; r < n; ++r) {
      for (int j = 0; j < n; ++j) {
        ops::attention_block_backward(t(dq[r], {B, Tl, W}), t(dkv[j], {B, Tl, 2 * KVC}), t(local_dout[r], {B, Tl, C}),
                                      t(local[r], {B, Tl, W}), t(out[r], {B, Tl, C}), t(lse[r], {B, NH, Tl}),
                                      t(kv[j], {B, Tl, 2 * KVC}), chunks(r), chunks(j), NH, NKV, ti(seg, {B, T}));
      }
    }
    for (int r = 0; r < n; ++r) {
      Vec dqkv(std::size_t(B) * Tl * W);
      ops::qkv_join(t(dqkv, {B, Tl, W}), t(dq[r], {B, Tl, W}), t(dkv[r], {B, Tl, 2 * KVC}), NH, NKV);
      INFO("backward: ranks " << n << " rank " << r);
      CHECK(max_abs_diff(dqkv, rows_of(dqkv_ref, B, T, W, chunks(r))) < 1e-5);
    }
  }
}

namespace {

// A device copy of a host array as the element type E reads it (bf16: rounded).
template <class E>
auto device_copy(const Vec& v) {
  if constexpr (std::is_same_v<E, float>) {
    return DeviceArray<float>(v);
  } else {
    return DeviceArray<Bf16>(to_bf16(v));
  }
}

// A device array's values as floats (bf16 widened exactly).
template <class A>
Vec host_floats(const A& a) {
  if constexpr (std::is_same_v<A, DeviceArray<float>>) {
    return a.to_host();
  } else {
    return to_float(a.to_host());
  }
}

// Rank 0 of 2 (chunks 0 and 3 of 72 rows: two 64-row tiles each, the second partial) against
// its own block and rank 1's, with the document mask, on the device and on the CPU (the same
// rounded inputs in fp32).
template <class E>
void check_document_blocks(int HS, double tol) {
  const int B = 2, n = 2, len = 72, T = 2 * n * len, NH = 4, NKV = 2, C = NH * HS, KVC = NKV * HS, W = C + 2 * KVC;
  const int Tl = T / n;
  const bool fp32 = std::is_same_v<E, float>;
  CAPTURE(HS, fp32);
  // Boundaries inside tiles and chunks, a one-token document, one spanning chunks 0 to 2.
  Ids seg = segments_of({{0, 5, 70, 150, 151, 230}, {0, 100, 217}}, T);
  std::mt19937 rng(7 + HS);
  const bool bf16 = !std::is_same_v<E, float>;
  const auto maybe_round = [&](Vec v) { return bf16 ? round_bf16(v) : v; };
  Vec qkv = maybe_round(random_vec(rng, std::size_t(B) * Tl * W)), other = maybe_round(random_vec(rng, std::size_t(B) * Tl * W));
  Vec dout = maybe_round(random_vec(rng, std::size_t(B) * Tl * C));
  const ops::Chunks me{len, 0, 3}, them{len, 1, 2};
  Vec kv(std::size_t(B) * Tl * 2 * KVC);
  ops::kv_pack(t(kv, {B, Tl, 2 * KVC}), t(other, {B, Tl, W}), NH, NKV);
  // CPU: the own block and the other, merged; the backward of both.
  Vec out(std::size_t(B) * Tl * C), lse(std::size_t(B) * NH * Tl), part(out.size()), part_lse(lse.size());
  ops::attention_block_forward(t(out, {B, Tl, C}), t(lse, {B, NH, Tl}), t(qkv, {B, Tl, W}), t(qkv, {B, Tl, W}), me, me,
                               NH, NKV, ti(seg, {B, T}));
  ops::attention_block_forward(t(part, {B, Tl, C}), t(part_lse, {B, NH, Tl}), t(qkv, {B, Tl, W}), t(kv, {B, Tl, 2 * KVC}),
                               me, them, NH, NKV, ti(seg, {B, T}));
  const auto d_qkv = device_copy<E>(qkv), d_kv = device_copy<E>(kv), d_dout = device_copy<E>(dout);
  const DeviceArray<std::int32_t> d_seg(seg);
  const Vec nan(out.size(), std::numeric_limits<float>::quiet_NaN()), nan_lse(lse.size(), std::numeric_limits<float>::quiet_NaN());
  const DeviceArray<float> g_out(nan), g_lse(nan_lse), g_part(nan), g_part_lse(nan_lse);
  ops::attention_block_forward(g_out.tensor({B, Tl, C}), g_lse.tensor({B, NH, Tl}), d_qkv.tensor({B, Tl, W}),
                               d_qkv.tensor({B, Tl, W}), me, me, NH, NKV, d_seg.tensor({B, T}));
  ops::attention_block_forward(g_part.tensor({B, Tl, C}), g_part_lse.tensor({B, NH, Tl}), d_qkv.tensor({B, Tl, W}),
                               d_kv.tensor({B, Tl, 2 * KVC}), me, them, NH, NKV, d_seg.tensor({B, T}));
  require_close("own block out", g_out.to_host(), out, tol);
  require_close("own block lse", g_lse.to_host(), lse, 1e-4);
  require_close("other block out", g_part.to_host(), part, tol);
  const Vec got_lse = g_part_lse.to_host();
  std::size_t unseen = 0;
  for (std::size_t i = 0; i < lse.size(); ++i) {
    if (std::isinf(part_lse[i])) {
      ++unseen;
      CHECK(std::isinf(got_lse[i]));
    } else {
      CHECK(std::abs(got_lse[i] - part_lse[i]) < 1e-4 * std::max(1.0f, std::abs(part_lse[i])));
    }
  }
  CHECK(unseen > 0);  // rows whose document starts after every key of the other block
  ops::attention_lse_merge(t(out, {B, Tl, C}), t(lse, {B, NH, Tl}), t(part, {B, Tl, C}), t(part_lse, {B, NH, Tl}));
  ops::attention_lse_merge(g_out.tensor({B, Tl, C}), g_lse.tensor({B, NH, Tl}), g_part.tensor({B, Tl, C}),
                           g_part_lse.tensor({B, NH, Tl}));
  Vec out_in = maybe_round(out);  // the backward reads the merged out in the activations' type
  const auto d_out_in = device_copy<E>(out_in);
  Vec dq(qkv.size(), 0.0f), dkv(kv.size(), 0.0f);
  ops::attention_block_backward(t(dq, {B, Tl, W}), t(dq, {B, Tl, W}), t(dout, {B, Tl, C}), t(qkv, {B, Tl, W}),
                                t(out_in, {B, Tl, C}), t(lse, {B, NH, Tl}), t(qkv, {B, Tl, W}), me, me, NH, NKV,
                                ti(seg, {B, T}));
  ops::attention_block_backward(t(dq, {B, Tl, W}), t(dkv, {B, Tl, 2 * KVC}), t(dout, {B, Tl, C}), t(qkv, {B, Tl, W}),
                                t(out_in, {B, Tl, C}), t(lse, {B, NH, Tl}), t(kv, {B, Tl, 2 * KVC}), me, them, NH, NKV,
                                ti(seg, {B, T}));
  const DeviceArray<float> g_dq(Vec(dq.size(), 0.0f)), g_dkv(Vec(dkv.size(), 0.0f));
  ops::attention_block_backward(g_dq.tensor({B, Tl, W}), g_dq.tensor({B, Tl, W}), d_dout.tensor({B, Tl, C}),
                                d_qkv.tensor({B, Tl, W}), d_out_in.tensor({B, Tl, C}), g_lse.tensor({B, NH, Tl}),
                                d_qkv.tensor({B, Tl, W}), me, me, NH, NKV, d_seg.tensor({B, T}));
  ops::attention_block_backward(g_dq.tensor({B, Tl, W}), g_dkv.tensor({B, Tl, 2 * KVC}), d_dout.tensor({B, Tl, C}),
                                d_qkv.tensor({B, Tl, W}), d_out_in.tensor({B, Tl, C}), g_lse.tensor({B, NH, Tl}),
                                d_kv.tensor({B, Tl, 2 * KVC}), me, them, NH, NKV, d_seg.tensor({B, T}));
  require_close("dq (own block's dk, dv included)", g_dq.to_host(), dq, tol);
  require_close("other block's dkv", g_dkv.to_host(), dkv, tol);
}

}  // namespace

TEST_CASE("cuda context attention with a document mask: the GPU's block kernels match the cpu",
          "[cuda][ops][context][documents]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);
  SECTION("fp32, CUDA cores") { check_document_blocks<float>(16, 1e-4); }
  SECTION("bf16 head size 64, tensor cores") { check_document_blocks<Bf16>(64, 1e-2); }
  SECTION("bf16 head size 128, tensor cores") { check_document_blocks<Bf16>(128, 1e-2); }
}

namespace {

// Flash attention with the document mask on the device (through the block kernels) against the
// CPU's, in E's precision: out, lse and dqkv (written, then accumulated once more).
template <class E>
void check_document_flash(int HS, double tol) {
  const int B = 2, T = 150, NH = 4, NKV = 2, C = NH * HS, W = C + 2 * NKV * HS;
  const bool fp32 = std::is_same_v<E, float>;
  CAPTURE(HS, fp32);
  Ids seg = segments_of({{0, 5, 70, 71, 130}, {0, 100}}, T);
  std::mt19937 rng(3 + HS);
  const bool bf16 = !std::is_same_v<E, float>;
  const auto maybe_round = [&](Vec v) { return bf16 ? round_bf16(v) : v; };
  Vec qkv = maybe_round(random_vec(rng, std::size_t(B) * T * W)), dout = maybe_round(random_vec(rng, std::size_t(B) * T * C));
  Vec out(std::size_t(B) * T * C), lse(std::size_t(B) * NH * T), dqkv(qkv.size());
  ops::flash_attention_forward(t(out, {B, T, C}), t(lse, {B, NH, T}), t(qkv, {B, T, W}), NH, NKV,
                               ops::AttentionKernels::flash, ti(seg, {B, T}));
  out = maybe_round(out);
  ops::flash_attention_backward(t(dqkv, {B, T, W}), t(dout, {B, T, C}), t(qkv, {B, T, W}), t(out, {B, T, C}),
                                t(lse, {B, NH, T}), NH, NKV, ops::AttentionKernels::flash, ops::Accumulate::no,
                                ti(seg, {B, T}));
  const auto d_qkv = device_copy<E>(qkv), d_dout = device_copy<E>(dout);
  const auto g_out = device_copy<E>(Vec(out.size(), std::numeric_limits<float>::quiet_NaN()));
  const auto g_dqkv = device_copy<E>(Vec(qkv.size(), std::numeric_limits<float>::quiet_NaN()));
  const DeviceArray<float> g_lse(Vec(lse.size(), std::numeric_limits<float>::quiet_NaN()));
  const DeviceArray<std::int32_t> d_seg(seg);
  ops::flash_attention_forward(g_out.tensor({B, T, C}), g_lse.tensor({B, NH, T}), d_qkv.tensor({B, T, W}), NH, NKV,
                               ops::AttentionKernels::flash, d_seg.tensor({B, T}));
  require_close("out", host_floats(g_out), out, tol);
  require_close("lse", g_lse.to_host(), lse, 1e-4);
  ops::flash_attention_backward(g_dqkv.tensor({B, T, W}), d_dout.tensor({B, T, C}), d_qkv.tensor({B, T, W}),
                                g_out.tensor({B, T, C}), g_lse.tensor({B, NH, T}), NH, NKV, ops::AttentionKernels::flash,
                                ops::Accumulate::no, d_seg.tensor({B, T}));
  require_close("dqkv", host_floats(g_dqkv), dqkv, tol);
  ops::flash_attention_backward(g_dqkv.tensor({B, T, W}), d_dout.tensor({B, T, C}), d_qkv.tensor({B, T, W}),
                                g_out.tensor({B, T, C}), g_lse.tensor({B, NH, T}), NH, NKV, ops::AttentionKernels::flash,
                                ops::Accumulate::yes, d_seg.tensor({B, T}));
  Vec twice = dqkv;
  for (float& x : twice) x *= 2.0f;
  require_close("dqkv accumulated", host_floats(g_dqkv), twice, tol);
}

}  // namespace

TEST_CASE("cuda flash attention with a document mask matches the cpu", "[cuda][ops][flash][documents]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);
  SECTION("fp32") { check_document_flash<float>(16, 1e-4); }
  SECTION("bf16 head size 64, tensor cores") { check_document_flash<Bf16>(64, 2e-2); }
}
