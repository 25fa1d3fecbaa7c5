// Flash attention: the CPU reference against the probability-storing attention op and finite
// differences; the f32 CUDA kernels against it over a grid of shapes; dqkv written, not added to.
#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "catch_compat.h"
#include "core/error.h"
#include "cuda_compare.h"
#include "flash_attention_check.h"
#include "grad_check.h"
#include "ops/buffer.h"
#include "llmtrain/kernels/cpu.h"
#include "ops/ops.h"

using namespace llmtrain;
using namespace llmtrain::test;

namespace {

// Largest |a - b| over |b| floored at 1 (so near-zero elements are compared absolutely).
double max_mixed_error(const Vec& a, const Vec& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, std::abs(double(a[i]) - b[i]) / std::max(1.0, std::abs(double(b[i]))));
  }
  return worst;
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
