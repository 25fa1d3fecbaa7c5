// Flash attention: the CPU reference against the probability-storing attention op and finite
// differences; the CUDA kernels against the CPU reference over a grid of shapes, with NaN
// sentinels around every output, NaN/Inf checks and accumulation into a pre-filled gradient; the
// bf16 kernels (called directly, in a CUDA build) against the CPU reference run on the same
// bf16-rounded inputs; cuDNN's fused attention (kernels/cudnn_attention.h) against both.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "catch_compat.h"
#include "core/error.h"
#include "cuda_compare.h"
#include "grad_check.h"
#include "ops/buffer.h"
#include "llmtrain/kernels/cpu.h"
#include "ops/ops.h"
#if LLMTRAIN_HAVE_CUDA
#include "llmtrain/kernels/cudnn_attention.h"
#include "llmtrain/kernels/flash_attention.h"
#include "device/stream.h"
#endif

using namespace llmtrain;
using namespace llmtrain::test;

namespace {

// Attention shapes: qkv (B,T,(NH+2NKV)HS), out (B,T,NH HS), lse (B,NH,T).
struct AttnShape {
  int B, T, NH, NKV, HS;
  int C() const { return NH * HS; }
  int width() const { return (NH + 2 * NKV) * HS; }
  std::size_t n_qkv() const { return std::size_t(B) * T * width(); }
  std::size_t n_out() const { return std::size_t(B) * T * C(); }
  std::size_t n_lse() const { return std::size_t(B) * NH * T; }
};

// Largest |a - b| over |b| floored at 1 (so near-zero elements are compared absolutely).
double max_mixed_error(const Vec& a, const Vec& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, std::abs(double(a[i]) - b[i]) / std::max(1.0, std::abs(double(b[i]))));
  }
  return worst;
}

// The flash forward and backward on the CPU: out, lse and dqkv (starting from `dqkv0`).
struct FlashResult {
  Vec out, lse, dqkv;
};
FlashResult cpu_flash(const AttnShape& s, Vec& qkv, Vec& dout, const Vec& dqkv0) {
  const int B = s.B, T = s.T, NH = s.NH, C = s.C(), W = s.width();
  FlashResult r{Vec(s.n_out()), Vec(s.n_lse()), dqkv0};
  ops::flash_attention_forward(t(r.out, {B, T, C}), t(r.lse, {B, NH, T}), t(qkv, {B, T, W}), NH, s.NKV);
  ops::flash_attention_backward(t(r.dqkv, {B, T, W}), t(dout, {B, T, C}), t(qkv, {B, T, W}), t(r.out, {B, T, C}),
                                t(r.lse, {B, NH, T}), NH, s.NKV);
  return r;
}

// log-sum-exp of the scaled scores of row t of head h, in double.
double row_lse(const AttnShape& s, const Vec& qkv, int b, int h, int t) {
  const int W = s.width(), kvh = h / (s.NH / s.NKV);
  const double scale = 1.0 / std::sqrt(double(s.HS));
  std::vector<double> score(std::size_t(t) + 1);
  for (int t2 = 0; t2 <= t; ++t2) {
    double dot = 0.0;
    for (int i = 0; i < s.HS; ++i) {
      dot += double(qkv[(std::size_t(b) * s.T + t) * W + std::size_t(h) * s.HS + i]) *
             qkv[(std::size_t(b) * s.T + t2) * W + s.C() + std::size_t(kvh) * s.HS + i];
    }
    score[std::size_t(t2)] = dot * scale;
  }
  const double m = *std::max_element(score.begin(), score.end());
  double sum = 0.0;
  for (const double x : score) sum += std::exp(x - m);
  return m + std::log(sum);
}

}  // namespace

TEST_CASE("flash attention matches the probability-storing attention on the cpu", "[ops][flash]") {
  std::mt19937 rng(21);
  const int NH = 4;
  for (const int B : {1, 2}) {
    for (const int T : {1, 2, 7, 16, 33, 130}) {  // 130: three query blocks of the CPU kernel
      for (const int NKV : {NH, NH / 2, 1}) {
        for (const int HS : {8, 16, 64}) {
          const AttnShape s{B, T, NH, NKV, HS};
          const int C = s.C();
          CAPTURE(B, T, NKV, HS);
          Vec qkv = random_vec(rng, s.n_qkv(), 1.5f), dout = random_vec(rng, s.n_out());
          const Vec dqkv0 = random_vec(rng, s.n_qkv());  // backward accumulates into this
          const FlashResult flash = cpu_flash(s, qkv, dout, dqkv0);

          Vec out(s.n_out()), att(std::size_t(B) * NH * T * T), dqkv = dqkv0;
          cpu::attention_forward(out.data(), att.data(), qkv.data(), B, T, C, NH, NKV);
          cpu::attention_backward(dqkv.data(), dout.data(), qkv.data(), att.data(), B, T, C, NH, NKV);
          CHECK(max_mixed_error(flash.out, out) < 1e-5);
          CHECK(max_mixed_error(flash.dqkv, dqkv) < 1e-5);

          // lse against a double-precision computation, every row.
          double worst = 0.0;
          for (int b = 0; b < B; ++b) {
            for (int h = 0; h < NH; ++h) {
              for (int t2 = 0; t2 < T; ++t2) {
                const double want = row_lse(s, qkv, b, h, t2);
                const double got = flash.lse[(std::size_t(b) * NH + h) * T + t2];
                worst = std::max(worst, std::abs(got - want) / std::max(1.0, std::abs(want)));
              }
            }
          }
          CHECK(worst < 1e-5);
        }
      }
    }
  }
}

TEST_CASE("flash attention backward matches finite differences", "[ops][flash][grad]") {
  std::mt19937 rng(22);
  const int B = 2, T = 5, NH = 4, HS = 3, C = NH * HS;
  for (const int NKV : {4, 2, 1}) {
    CAPTURE(NKV);
    const int W = (NH + 2 * NKV) * HS;
    Vec qkv = random_vec(rng, std::size_t(B) * T * W), out(std::size_t(B) * T * C), lse(std::size_t(B) * NH * T);
    const Vec R = random_vec(rng, out.size());
    const auto loss = [&] {
      ops::flash_attention_forward(t(out, {B, T, C}), t(lse, {B, NH, T}), t(qkv, {B, T, W}), NH, NKV);
      return weighted_sum(out, R);
    };
    loss();
    Vec dqkv(qkv.size(), 0.0f), dout = R;
    ops::flash_attention_backward(t(dqkv, {B, T, W}), t(dout, {B, T, C}), t(qkv, {B, T, W}), t(out, {B, T, C}),
                                  t(lse, {B, NH, T}), NH, NKV);
    check_gradient("qkv", qkv, dqkv, loss, 1e-3);
  }
}

TEST_CASE("flash attention rejects inconsistent tensors", "[ops][flash]") {
  const int B = 1, T = 3, NH = 2, HS = 4, C = NH * HS;
  Vec qkv(std::size_t(B) * T * 3 * C), out(std::size_t(B) * T * C), lse(std::size_t(B) * NH * T), dqkv(qkv.size());
  CHECK_NOTHROW(ops::flash_attention_forward(t(out, {B, T, C}), t(lse, {B, NH, T}), t(qkv, {B, T, 3 * C}), NH));
  CHECK_THROWS(ops::flash_attention_forward(t(out, {B, T, C}), t(lse, {B, T, NH}), t(qkv, {B, T, 3 * C}), NH));
  CHECK_THROWS(ops::flash_attention_forward(t(out, {B, T, C}), t(lse, {B, NH, T}), t(qkv, {B, T, 3 * C}), 3));
  CHECK_THROWS(ops::flash_attention_forward(t(out, {B, T, C}), t(lse, {B, NH, T}), t(qkv, {B, T, 3 * C}), NH, 1));
  CHECK_THROWS(ops::flash_attention_backward(t(dqkv, {B, T, C}), t(out, {B, T, C}), t(qkv, {B, T, 3 * C}),
                                             t(out, {B, T, C}), t(lse, {B, NH, T}), NH));
  CHECK_THROWS(ops::flash_attention_backward(t(dqkv, {B, T, 3 * C}), t(out, {B, T, C}), t(qkv, {B, T, 3 * C}),
                                             t(out, {B, T, C}), Tensor(), NH));
}

namespace {

// Row t of head h of the attention output, in double.
std::vector<double> row_out(const AttnShape& s, const Vec& qkv, int b, int h, int t) {
  const int W = s.width(), kvh = h / (s.NH / s.NKV);
  const double scale = 1.0 / std::sqrt(double(s.HS)), lse = row_lse(s, qkv, b, h, t);
  std::vector<double> o(std::size_t(s.HS), 0.0);
  for (int t2 = 0; t2 <= t; ++t2) {
    double dot = 0.0;
    for (int i = 0; i < s.HS; ++i) {
      dot += double(qkv[(std::size_t(b) * s.T + t) * W + std::size_t(h) * s.HS + i]) *
             qkv[(std::size_t(b) * s.T + t2) * W + s.C() + std::size_t(kvh) * s.HS + i];
    }
    const double p = std::exp(dot * scale - lse);
    for (int i = 0; i < s.HS; ++i) {
      o[std::size_t(i)] += p * qkv[(std::size_t(b) * s.T + t2) * W + s.C() + std::size_t(s.NKV + kvh) * s.HS + i];
    }
  }
  return o;
}

Vec nan_vec(std::size_t n) { return Vec(n, std::numeric_limits<float>::quiet_NaN()); }

#if LLMTRAIN_HAVE_CUDA
// A device array of bf16 as the kernels take it.
cuda::bf16* bf(const DeviceArray<Bf16>& a) { return reinterpret_cast<cuda::bf16*>(a.data()); }
#endif

// The columns [from, to) of every row of x (rows, W), minus the same of `base`.
Vec increment(const Vec& x, const Vec& base, int W, int from, int to) {
  Vec r;
  for (std::size_t row = 0; row < x.size() / std::size_t(W); ++row) {
    for (int i = from; i < to; ++i) r.push_back(x[row * W + i] - base[row * W + i]);
  }
  return r;
}

bool all_zero(const Vec& v) {
  return std::all_of(v.begin(), v.end(), [](float x) { return x == 0.0f; });
}

}  // namespace

namespace {
// The shape and inputs of the first-writer checks: GQA, T not a multiple of the tiles, HS 64 (the
// tensor-core and cuDNN kernels).
struct FirstWriterCase {
  AttnShape s{2, 65, 4, 2, 64};
  Vec qkv, dout;
  FlashResult want;  // the CPU's += onto zeros
  FirstWriterCase() {
    std::mt19937 rng(233);
    qkv = round_bf16(random_vec(rng, s.n_qkv(), 1.5f));
    dout = round_bf16(random_vec(rng, s.n_out()));
    want = cpu_flash(s, qkv, dout, Vec(s.n_qkv(), 0.0f));
  }
};

#if LLMTRAIN_HAVE_CUDA
// dqkv from the device backward of `kernels` in element type E (float or Bf16), onto dqkv0 with
// `mode`; the forward's out and lse from the same kernels.
template <class E>
Vec device_dqkv(const FirstWriterCase& c, ops::AttentionKernels kernels, const Vec& dqkv0, ops::Accumulate mode) {
  const AttnShape& s = c.s;
  const int B = s.B, T = s.T, NH = s.NH, C = s.C(), W = s.width();
  const auto elems = [](const Vec& v) {
    if constexpr (std::is_same_v<E, float>) {
      return v;
    } else {
      return to_bf16(v);
    }
  };
  const DeviceArray<E> d_qkv(elems(c.qkv)), d_dout(elems(c.dout)), d_out(elems(nan_vec(s.n_out())));
  const DeviceArray<E> d_dqkv(elems(dqkv0));
  const DeviceArray<float> d_lse(nan_vec(s.n_lse()));
  ops::flash_attention_forward(d_out.tensor({B, T, C}), d_lse.tensor({B, NH, T}), d_qkv.tensor({B, T, W}), NH, s.NKV,
                               kernels);
  ops::flash_attention_backward(d_dqkv.tensor({B, T, W}), d_dout.tensor({B, T, C}), d_qkv.tensor({B, T, W}),
                                d_out.tensor({B, T, C}), d_lse.tensor({B, NH, T}), NH, s.NKV, kernels, mode);
  require_guards("dqkv", d_dqkv);
  if constexpr (std::is_same_v<E, float>) {
    return d_dqkv.to_host();
  } else {
    return to_float(d_dqkv.to_host());
  }
}
#endif
}  // namespace

TEST_CASE("flash_attention_backward as dqkv's first writer (Accumulate::no) ignores what dqkv held", "[ops][flash]") {
  // The models' attention backward writes dqkv instead of adding into a zeroed one: the += onto
  // zeros, bit for bit, whatever (here: NaN) dqkv held before.
  FirstWriterCase c;
  const int B = c.s.B, T = c.s.T, NH = c.s.NH, C = c.s.C(), W = c.s.width();
  Vec out = c.want.out, lse = c.want.lse, written = nan_vec(c.s.n_qkv());
  ops::flash_attention_backward(t(written, {B, T, W}), t(c.dout, {B, T, C}), t(c.qkv, {B, T, W}), t(out, {B, T, C}),
                                t(lse, {B, NH, T}), NH, c.s.NKV, ops::AttentionKernels::flash, ops::Accumulate::no);
  CHECK(written == c.want.dqkv);
}

TEST_CASE("cuda flash_attention_backward as dqkv's first writer (Accumulate::no), f32, bf16 and cuDNN",
          "[cuda][flash]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);
#if LLMTRAIN_HAVE_CUDA
  const FirstWriterCase c;
  const Vec zeros(c.s.n_qkv(), 0.0f), nans = nan_vec(c.s.n_qkv());
  // llmtrain's kernels add into zeros either way: the same bits as the += onto zeros.
  const Vec f32_written = device_dqkv<float>(c, ops::AttentionKernels::flash, nans, ops::Accumulate::no);
  require_close("f32 dqkv written", f32_written, c.want.dqkv, 1e-4);
  CHECK(f32_written == device_dqkv<float>(c, ops::AttentionKernels::flash, zeros, ops::Accumulate::yes));
  const Vec bf16_written = device_dqkv<Bf16>(c, ops::AttentionKernels::flash, nans, ops::Accumulate::no);
  require_close("bf16 dqkv written", bf16_written, c.want.dqkv, 1e-2);
  CHECK(bf16_written == device_dqkv<Bf16>(c, ops::AttentionKernels::flash, zeros, ops::Accumulate::yes));
  // cuDNN writes straight into dqkv (no scratch, no add kernel): every element, within bf16 accuracy.
  if (!ops::cudnn_attention_available(&why) ||
      !ops::cudnn_attention_supported(c.s.B, c.s.T, c.s.C(), c.s.NH, c.s.NKV, &why)) {
    WARN("cuDNN's write into dqkv not checked: " << why);
    return;
  }
  require_close("cudnn dqkv written", device_dqkv<Bf16>(c, ops::AttentionKernels::cudnn, nans, ops::Accumulate::no),
                c.want.dqkv, 1e-2);
#endif
}

TEST_CASE("cuda flash attention matches the cpu reference", "[cuda][ops][flash]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);
  constexpr double tol = 1e-4;  // fp32: other summation orders and exp2f, over up to 1024 keys
  std::mt19937 rng(23);
  const int NH = 4;
  std::size_t offset = 0;
  for (const int B : {1, 2}) {
    for (const int T : {1, 7, 64, 65, 300, 1024}) {
      for (const int HS : {16, 64, 128}) {
        for (const int NKV : {NH, NH / 2, 1}) {
          const AttnShape s{B, T, NH, NKV, HS};
          const int C = s.C(), W = s.width();
          offset = 1 - offset;  // every other case 4 bytes off 16-byte alignment
          CAPTURE(B, T, HS, NKV, offset);
          Vec qkv = random_vec(rng, s.n_qkv(), 1.5f), dout = random_vec(rng, s.n_out());
          const Vec dqkv0 = random_vec(rng, s.n_qkv());  // nonzero: the backward must accumulate
          const FlashResult want = cpu_flash(s, qkv, dout, dqkv0);

          // Outputs start as NaN: an element never written fails the NaN check.
          const DeviceArray<float> d_qkv(qkv, offset), d_dout(dout, offset), d_dqkv(dqkv0, offset);
          const DeviceArray<float> d_out(nan_vec(s.n_out()), offset), d_lse(nan_vec(s.n_lse()), offset);
          ops::flash_attention_forward(d_out.tensor({B, T, C}), d_lse.tensor({B, NH, T}), d_qkv.tensor({B, T, W}), NH,
                                       NKV);
          ops::flash_attention_backward(d_dqkv.tensor({B, T, W}), d_dout.tensor({B, T, C}), d_qkv.tensor({B, T, W}),
                                        d_out.tensor({B, T, C}), d_lse.tensor({B, NH, T}), NH, NKV);
          require_close("out", d_out.to_host(), want.out, tol);
          require_close("lse", d_lse.to_host(), want.lse, tol);
          const Vec dqkv = d_dqkv.to_host();
          require_changed("dqkv", dqkv, dqkv0);
          // What the backward added, against what the CPU added; with T = 1 the q and k parts add
          // nothing (one key: a constant softmax), else each part must add something.
          require_close("dqkv increment", increment(dqkv, dqkv0, W, 0, W), increment(want.dqkv, dqkv0, W, 0, W), tol);
          if (T > 1) {
            CHECK_FALSE(all_zero(increment(dqkv, dqkv0, W, 0, C)));                // dq
            CHECK_FALSE(all_zero(increment(dqkv, dqkv0, W, C, C + NKV * HS)));     // dk
          }
          CHECK_FALSE(all_zero(increment(dqkv, dqkv0, W, C + NKV * HS, W)));       // dv
          for (const auto* a : {&d_qkv, &d_dout, &d_dqkv, &d_out, &d_lse}) require_guards("flash attention", *a);
        }
      }
    }
  }
}

TEST_CASE("cuda flash attention forward at T = 8192", "[cuda][ops][flash]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);
  const AttnShape s{1, 8192, 2, 2, 64};
  const int B = s.B, T = s.T, NH = s.NH, C = s.C(), W = s.width();
  std::mt19937 rng(24);
  const Vec qkv = random_vec(rng, s.n_qkv(), 1.5f);
  const DeviceArray<float> d_qkv(qkv), d_out(nan_vec(s.n_out())), d_lse(nan_vec(s.n_lse()));
  ops::flash_attention_forward(d_out.tensor({B, T, C}), d_lse.tensor({B, NH, T}), d_qkv.tensor({B, T, W}), NH, s.NKV);
  const Vec out = d_out.to_host(), lse = d_lse.to_host();
  require_guards("out", d_out);
  require_guards("lse", d_lse);
  CHECK(std::all_of(out.begin(), out.end(), [](float x) { return std::isfinite(x); }));
  CHECK(std::all_of(lse.begin(), lse.end(), [](float x) { return std::isfinite(x); }));
  // A few rows against a double-precision computation: the first, tile edges, the last.
  for (const int t2 : {0, 1, 31, 32, 63, 64, 65, 1000, 4095, 4096, 8190, 8191}) {
    for (int h = 0; h < NH; ++h) {
      CAPTURE(t2, h);
      const std::vector<double> want = row_out(s, qkv, 0, h, t2);
      double worst = 0.0, scale = 0.0;
      for (int i = 0; i < s.HS; ++i) {
        worst = std::max(worst, std::abs(out[std::size_t(t2) * C + std::size_t(h) * s.HS + i] - want[std::size_t(i)]));
        scale = std::max(scale, std::abs(want[std::size_t(i)]));
      }
      REQUIRE(scale > 0.0);
      CHECK(worst / scale < 1e-4);
      const double want_lse = row_lse(s, qkv, 0, h, t2);
      CHECK(std::abs(lse[std::size_t(h) * T + t2] - want_lse) / std::max(1.0, std::abs(want_lse)) < 1e-4);
    }
  }
}

TEST_CASE("cuda flash attention rejects unsupported head sizes", "[cuda][ops][flash]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);
  const AttnShape s{1, 4, 2, 2, 8};  // HS 8: fine on the CPU, not instantiated on CUDA
  const DeviceArray<float> d_qkv(Vec(s.n_qkv(), 0.5f)), d_out(nan_vec(s.n_out())), d_lse(nan_vec(s.n_lse()));
  std::string message;
  try {
    ops::flash_attention_forward(d_out.tensor({1, 4, s.C()}), d_lse.tensor({1, 2, 4}), d_qkv.tensor({1, 4, s.width()}),
                                 2);
  } catch (const RuntimeError& e) {
    message = e.what();
  }
  CHECK(message.find("head size 8") != std::string::npos);
}

TEST_CASE("cuda bf16 flash attention matches the cpu reference", "[cuda][bf16][flash]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);
#if LLMTRAIN_HAVE_CUDA
  // bf16 outputs: a few ulps (2^-8 relative) of the largest element; lse is fp32 from the same
  // bf16 inputs as the reference.
  constexpr double bf16_tol = 1e-2, lse_tol = 2e-3;
  std::mt19937 rng(223);
  const int NH = 4;
  std::size_t offset = 0;
  for (const int B : {1, 2}) {
    for (const int T : {1, 7, 64, 65, 300}) {
      for (const int HS : {16, 64, 128}) {
        for (const int NKV : {NH, NH / 2, 1}) {
          const AttnShape s{B, T, NH, NKV, HS};
          const int C = s.C(), W = s.width();
          offset = 1 - offset;  // every other case 2 bytes off 16-byte alignment
          CAPTURE(B, T, HS, NKV, offset);
          Vec qkv = round_bf16(random_vec(rng, s.n_qkv(), 1.5f)),
              dout = round_bf16(random_vec(rng, s.n_out()));
          // Pre-filled, smaller than what the backward adds, so that each part's error is measured
          // against its gradient rather than against the starting values.
          const Vec dqkv0 = round_bf16(random_vec(rng, s.n_qkv(), 0.1f));
          const FlashResult want = cpu_flash(s, qkv, dout, dqkv0);

          // Outputs start as NaN: an element never written fails the NaN check.
          const DeviceArray<Bf16> d_qkv(to_bf16(qkv), offset), d_dout(to_bf16(dout), offset),
              d_dqkv(to_bf16(dqkv0), offset), d_out(to_bf16(nan_vec(s.n_out())), offset);
          const DeviceArray<float> d_lse(nan_vec(s.n_lse()), offset);
          const cudaStream_t stream = device::compute_stream();
          cuda::flash_attention_forward(bf(d_out), d_lse.data(), bf(d_qkv), B, T, C, NH, NKV, stream);
          cuda::flash_attention_backward(bf(d_dqkv), bf(d_dout), bf(d_qkv), bf(d_out), d_lse.data(), B, T, C,
                                         NH, NKV, true, stream);
          require_close("out", to_float(d_out.to_host()), want.out, bf16_tol);
          require_close("lse", d_lse.to_host(), want.lse, lse_tol);
          const Vec dqkv = to_float(d_dqkv.to_host());
          require_changed("dqkv", dqkv, dqkv0);
          // dq, dk and dv (totals, after the +=) each against its own largest element.
          const Vec zeros(dqkv.size(), 0.0f);
          require_close("dq", increment(dqkv, zeros, W, 0, C), increment(want.dqkv, zeros, W, 0, C),
                        bf16_tol);
          require_close("dk", increment(dqkv, zeros, W, C, C + NKV * HS),
                        increment(want.dqkv, zeros, W, C, C + NKV * HS), bf16_tol);
          require_close("dv", increment(dqkv, zeros, W, C + NKV * HS, W),
                        increment(want.dqkv, zeros, W, C + NKV * HS, W), bf16_tol);
          // With T = 1 the q and k parts add nothing (one key: a constant softmax); else each part
          // must have changed.
          if (T > 1) {
            CHECK_FALSE(all_zero(increment(dqkv, dqkv0, W, 0, C)));             // dq
            CHECK_FALSE(all_zero(increment(dqkv, dqkv0, W, C, C + NKV * HS)));  // dk
          }
          CHECK_FALSE(all_zero(increment(dqkv, dqkv0, W, C + NKV * HS, W)));  // dv
          for (const auto* a : {&d_qkv, &d_dout, &d_dqkv, &d_out}) require_guards("bf16 flash attention", *a);
          require_guards("lse", d_lse);
        }
      }
    }
  }
#endif
}

#if LLMTRAIN_HAVE_CUDA
namespace {

// One shape through the tensor-core kernels (16-byte aligned tensors, head size 64 or 128): the
// forward, then the backward that set_flash_attention_deterministic chose, onto a pre-filled
// dqkv, against the CPU reference run on the same bf16-rounded inputs. Same tolerances as the
// CUDA-core bf16 kernels; P and dS are rounded to bf16 as matrix operands here, which they stay
// well within.
void check_tensor_core_flash(const AttnShape& s, std::mt19937& rng) {
  constexpr double bf16_tol = 1e-2, lse_tol = 2e-3;
  const int B = s.B, T = s.T, NH = s.NH, NKV = s.NKV, HS = s.HS, C = s.C(), W = s.width();
  Vec qkv = round_bf16(random_vec(rng, s.n_qkv(), 1.5f)), dout = round_bf16(random_vec(rng, s.n_out()));
  // Pre-filled, smaller than what the backward adds, so that each part's error is measured
  // against its gradient rather than against the starting values (a backward that overwrote
  // instead of adding would still be off by far more than the tolerance).
  const Vec dqkv0 = round_bf16(random_vec(rng, s.n_qkv(), 0.1f));
  const FlashResult want = cpu_flash(s, qkv, dout, dqkv0);

  // 8 elements (16 bytes) of leading guard: aligned, with sentinels on both sides.
  constexpr std::size_t guard = 8;
  const DeviceArray<Bf16> d_qkv(to_bf16(qkv), guard), d_dout(to_bf16(dout), guard), d_dqkv(to_bf16(dqkv0), guard),
      d_out(to_bf16(nan_vec(s.n_out())), guard);
  const DeviceArray<float> d_lse(nan_vec(s.n_lse()), 4);
  REQUIRE(cuda::flash_attention_uses_tensor_cores(HS, d_qkv.data(), d_out.data()));
  const cudaStream_t stream = device::compute_stream();
  cuda::flash_attention_forward(bf(d_out), d_lse.data(), bf(d_qkv), B, T, C, NH, NKV, stream);
  require_close("out", to_float(d_out.to_host()), want.out, bf16_tol);
  require_close("lse", d_lse.to_host(), want.lse, lse_tol);
  cuda::flash_attention_backward(bf(d_dqkv), bf(d_dout), bf(d_qkv), bf(d_out), d_lse.data(), B, T, C, NH, NKV,
                                 true, stream);
  const Vec dqkv = to_float(d_dqkv.to_host());
  const Vec zeros(dqkv.size(), 0.0f);
  require_close("dq", increment(dqkv, zeros, W, 0, C), increment(want.dqkv, zeros, W, 0, C), bf16_tol);
  require_close("dk", increment(dqkv, zeros, W, C, C + NKV * HS), increment(want.dqkv, zeros, W, C, C + NKV * HS),
                bf16_tol);
  require_close("dv", increment(dqkv, zeros, W, C + NKV * HS, W), increment(want.dqkv, zeros, W, C + NKV * HS, W),
                bf16_tol);
  if (T > 1) CHECK_FALSE(all_zero(increment(dqkv, dqkv0, W, 0, C)));  // dq changed
  for (const auto* a : {&d_qkv, &d_dout, &d_dqkv, &d_out}) require_guards("tensor-core flash attention", *a);
  require_guards("lse", d_lse);
}

// check_tensor_core_flash at head sizes 64 and 128, each of these T, and GQA groups of 1, 2 and 4
// (4 query heads); B = 2 for the short sequences.
void check_tensor_core_shapes(std::initializer_list<int> Ts, std::mt19937& rng) {
  const int NH = 4;
  for (const int HS : {64, 128}) {
    for (const int T : Ts) {
      for (const int NKV : {NH, NH / 2, 1}) {
        const int B = T <= 65 ? 2 : 1;
        CAPTURE(B, T, HS, NKV);
        check_tensor_core_flash(AttnShape{B, T, NH, NKV, HS}, rng);
      }
    }
  }
}

// train.deterministic false for one scope (ops::set_deterministic, as the trainer sets it), the
// default again after it, also when a check fails.
struct SinglePassBackward {
  SinglePassBackward() { ops::set_deterministic(false); }
  ~SinglePassBackward() { ops::set_deterministic(true); }
  SinglePassBackward(const SinglePassBackward&) = delete;
  SinglePassBackward& operator=(const SinglePassBackward&) = delete;
};

}  // namespace
#endif

TEST_CASE("cuda bf16 tensor-core flash attention matches the cpu reference", "[cuda][bf16][flash]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);
#if LLMTRAIN_HAVE_CUDA
  // The mma.sync kernels and the default (deterministic, two-kernel) backward: T not a multiple
  // of the 64-row tiles, one and several key tiles, GQA groups of 1, 2 and 4.
  REQUIRE(cuda::flash_attention_deterministic());
  std::mt19937 rng(227);
  check_tensor_core_shapes({1, 17, 64, 65, 130, 257}, rng);
#endif
}

TEST_CASE("cuda bf16 tensor-core single-pass flash backward (train.deterministic false) matches the cpu reference",
          "[cuda][bf16][flash]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);
#if LLMTRAIN_HAVE_CUDA
  // dQ by atomics into the fp32 accumulator, then added into dqkv: T not a multiple of the tiles
  // (64 keys per block, 64 or 32 queries per step), B = 2, GQA groups of 1, 2 and 4 (the block
  // loops over the group's query heads), dqkv pre-filled.
  const SinglePassBackward single_pass;
  REQUIRE_FALSE(cuda::flash_attention_deterministic());
  std::mt19937 rng(229);
  check_tensor_core_shapes({1, 17, 65, 130}, rng);
#endif
}

TEST_CASE("cuda bf16 tensor-core flash backward is bitwise repeatable by default, also after single-pass runs",
          "[cuda][bf16][flash]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);
#if LLMTRAIN_HAVE_CUDA
  // The default backward twice, then the single pass, then the default again, each from the same
  // pre-filled dqkv: every default run gives the same bytes, and so the switch leaves no trace.
  // (Under the emulator the single pass repeats too, blocks running in a fixed order; on a GPU
  // its dQ may differ in the last bits, so it is only compared within tolerance.)
  std::mt19937 rng(231);
  for (const int HS : {64, 128}) {
    const AttnShape s{2, 130, 4, 2, HS};
    const int B = s.B, T = s.T, NH = s.NH, NKV = s.NKV, C = s.C(), W = s.width();
    CAPTURE(HS);
    const Vec qkv = round_bf16(random_vec(rng, s.n_qkv(), 1.5f)), dout = round_bf16(random_vec(rng, s.n_out()));
    const std::vector<Bf16> dqkv0 = to_bf16(round_bf16(random_vec(rng, s.n_qkv(), 0.1f)));
    const DeviceArray<Bf16> d_qkv(to_bf16(qkv)), d_dout(to_bf16(dout)), d_out(to_bf16(nan_vec(s.n_out())));
    const DeviceArray<float> d_lse(nan_vec(s.n_lse()));
    REQUIRE(cuda::flash_attention_uses_tensor_cores(HS, d_qkv.data(), d_out.data()));
    const cudaStream_t stream = device::compute_stream();
    cuda::flash_attention_forward(bf(d_out), d_lse.data(), bf(d_qkv), B, T, C, NH, NKV, stream);
    const auto backward = [&] {
      const DeviceArray<Bf16> d_dqkv(dqkv0);
      cuda::flash_attention_backward(bf(d_dqkv), bf(d_dout), bf(d_qkv), bf(d_out), d_lse.data(), B, T, C, NH, NKV,
                                     true, stream);
      require_guards("dqkv", d_dqkv);
      return to_float(d_dqkv.to_host());
    };
    const auto same_bytes = [](const Vec& a, const Vec& b) {
      return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
    };
    REQUIRE(cuda::flash_attention_deterministic());
    const Vec first = backward();
    CHECK(same_bytes(backward(), first));
    Vec single;
    {
      const SinglePassBackward single_pass;
      single = backward();
    }
    REQUIRE(cuda::flash_attention_deterministic());
    CHECK(same_bytes(backward(), first));
    // The single pass's dK and dV come from another instantiation of the dK/dV kernel (the one that
    // also adds dQ): the same sums in the same order, but nvcc may contract them into FMAs
    // differently, so they agree within a few bf16 ulps, not bit for bit; its dQ agrees within the
    // bf16 tolerance. (The bitwise checks above run the same kernel twice.)
    const Vec zeros(first.size(), 0.0f);
    require_close("dk and dv, single pass against the default", increment(single, zeros, W, C, W),
                  increment(first, zeros, W, C, W), 1e-2);
    require_close("dq, single pass against the default", increment(single, zeros, W, 0, C),
                  increment(first, zeros, W, 0, C), 1e-2);
  }
#endif
}

TEST_CASE("cudnn fused attention matches the cpu reference and the bf16 kernels", "[cuda][cudnn][flash]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);
#if LLMTRAIN_HAVE_CUDA
  if (!cuda::cudnn_attention_available(&why)) LLMTRAIN_SKIP("no cuDNN attention here: " + why);
  // As the bf16 kernels' test: bf16 outputs to a few ulps of the largest element, lse fp32.
  constexpr double bf16_tol = 1e-2, lse_tol = 2e-3;
  const cudaStream_t stream = device::compute_stream();
  std::mt19937 rng(224);
  const int NH = 4;
  for (const int B : {1, 2}) {
    for (const int T : {1, 64, 257}) {
      for (const int HS : {64, 128}) {
        for (const int NKV : {NH, NH / 2}) {
          const AttnShape s{B, T, NH, NKV, HS};
          const int C = s.C(), W = s.width();
          CAPTURE(B, T, HS, NKV);
          if (!cuda::cudnn_attention_supported(B, T, C, NH, NKV, &why)) {
            // cuDNN may lack an engine for an edge shape (say T = 1), but a graph it refuses at
            // the plainest shape is a mistake in the graph, not a gap in cuDNN.
            if (B == 1 && T == 64 && HS == 64 && NKV == NH) FAIL("cuDNN refuses the plainest shape: " << why);
            WARN("cuDNN has no engine for this shape, not compared: " << why);
            continue;
          }
          Vec qkv = round_bf16(random_vec(rng, s.n_qkv(), 1.5f)),
              dout = round_bf16(random_vec(rng, s.n_out()));
          const Vec dqkv0 = round_bf16(random_vec(rng, s.n_qkv(), 0.1f));  // the backward adds to this
          const FlashResult want = cpu_flash(s, qkv, dout, dqkv0);

          // 16-byte aligned (cuDNN's requirement); outputs start as NaN, so an element never written
          // fails the NaN check, and sentinels frame every array.
          const DeviceArray<Bf16> d_qkv(to_bf16(qkv)), d_dout(to_bf16(dout)), d_dqkv(to_bf16(dqkv0)),
              d_out(to_bf16(nan_vec(s.n_out())));
          const DeviceArray<float> d_lse(nan_vec(s.n_lse()));
          cuda::cudnn_attention_forward(bf(d_out), d_lse.data(), bf(d_qkv), B, T, C, NH, NKV, stream);
          cuda::cudnn_attention_backward(bf(d_dqkv), bf(d_dout), bf(d_qkv), bf(d_out), d_lse.data(), B, T, C,
                                         NH, NKV, true, stream);
          const Vec out = to_float(d_out.to_host()), lse = d_lse.to_host(), dqkv = to_float(d_dqkv.to_host());
          require_close("out", out, want.out, bf16_tol);
          require_close("lse", lse, want.lse, lse_tol);
          require_changed("dqkv", dqkv, dqkv0);
          // dq, dk and dv (totals, after the +=) each against its own largest element.
          const Vec zeros(dqkv.size(), 0.0f);
          require_close("dq", increment(dqkv, zeros, W, 0, C), increment(want.dqkv, zeros, W, 0, C),
                        bf16_tol);
          require_close("dk", increment(dqkv, zeros, W, C, C + NKV * HS),
                        increment(want.dqkv, zeros, W, C, C + NKV * HS), bf16_tol);
          require_close("dv", increment(dqkv, zeros, W, C + NKV * HS, W),
                        increment(want.dqkv, zeros, W, C + NKV * HS, W), bf16_tol);
          if (T > 1) {  // with one key the softmax is constant: dq and dk add nothing
            CHECK_FALSE(all_zero(increment(dqkv, dqkv0, W, 0, C)));
            CHECK_FALSE(all_zero(increment(dqkv, dqkv0, W, C, C + NKV * HS)));
          }
          CHECK_FALSE(all_zero(increment(dqkv, dqkv0, W, C + NKV * HS, W)));
          for (const auto* a : {&d_qkv, &d_dout, &d_dqkv, &d_out}) require_guards("cudnn attention", *a);
          require_guards("lse", d_lse);

          // Against our bf16 kernels directly, on the same inputs (and cuDNN's out and lse for the
          // backward, so that only the backward differs).
          const DeviceArray<Bf16> k_out(to_bf16(nan_vec(s.n_out()))), k_dqkv(to_bf16(dqkv0));
          const DeviceArray<float> k_lse(nan_vec(s.n_lse()));
          cuda::flash_attention_forward(bf(k_out), k_lse.data(), bf(d_qkv), B, T, C, NH, NKV, stream);
          cuda::flash_attention_backward(bf(k_dqkv), bf(d_dout), bf(d_qkv), bf(d_out), d_lse.data(), B, T, C,
                                         NH, NKV, true, stream);
          require_close("out, cuDNN against the bf16 kernel", out, to_float(k_out.to_host()), bf16_tol);
          require_close("lse, cuDNN against the bf16 kernel", lse, k_lse.to_host(), lse_tol);
          const Vec k_dqkv_host = to_float(k_dqkv.to_host());
          for (const auto& [name, from, to] : {std::tuple{"dq", 0, C}, std::tuple{"dk", C, C + NKV * HS},
                                               std::tuple{"dv", C + NKV * HS, W}}) {
            require_close(std::string(name) + ", cuDNN against the bf16 kernel",
                          increment(dqkv, zeros, W, from, to), increment(k_dqkv_host, zeros, W, from, to),
                          bf16_tol);
          }
        }
      }
    }
  }

  // A pointer off 16-byte alignment is refused, not passed to cuDNN.
  const AttnShape s{1, 64, NH, NH, 64};
  const DeviceArray<Bf16> d_qkv(to_bf16(round_bf16(random_vec(rng, s.n_qkv()))), 1),
      d_out(to_bf16(nan_vec(s.n_out())));
  const DeviceArray<float> d_lse(nan_vec(s.n_lse()));
  std::string message;
  try {
    cuda::cudnn_attention_forward(bf(d_out), d_lse.data(), bf(d_qkv), s.B, s.T, s.C(), NH, NH, stream);
  } catch (const RuntimeError& e) {
    message = e.what();
  }
  CHECK(message.find("16-byte aligned") != std::string::npos);
#endif
}
