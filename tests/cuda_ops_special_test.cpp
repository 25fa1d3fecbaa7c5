// The [cuda] op tests that are not a grid of shapes (those are the op case registry's, run by
// cuda_ops_test.cpp): every bf16 value through convert, NaN logits, the vocabulary-parallel
// cross-entropy over several ranks, padded logits rows, arguments on different devices, the
// multi-tensor AdamW and sums deferred on the device. Without a GPU every case skips visibly.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "catch_compat.h"
#include "core/error.h"
#include "cuda_compare.h"
#include "grad_check.h"
#include "op_cases.h"
#include "op_check.h"
#include "ops/buffer.h"
#include "ops/ops.h"

using namespace llmtrain;
using namespace llmtrain::test;
using op_cases::act_elementwise;
using op_cases::act_reduction;
using op_cases::f32_elementwise;
using op_cases::f32_reduction;
using op_cases::f32_reduction_of_bf16;
using op_cases::Tol;

TEST_CASE("cuda convert bf16 widens exactly and rounds to nearest even", "[cuda][bf16]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);

  // Every one of the 65536 bf16 values widens to the float with the same upper bits (NaN payloads
  // too), and rounds back to itself (NaNs to a NaN).
  std::vector<Bf16> all(65536);
  for (std::size_t i = 0; i < all.size(); ++i) all[i].bits = std::uint16_t(i);
  const std::int64_t n_all = std::int64_t(all.size());
  for (const std::size_t offset : {0, 1}) {
    CAPTURE(offset);
    const DeviceArray<Bf16> d_all(all, offset), d_back(std::vector<Bf16>(all.size(), sentinel<Bf16>()), offset);
    const DeviceArray<float> d_wide(Vec(all.size(), sentinel<float>()), offset);
    ops::convert(d_wide.tensor({n_all}), d_all.tensor({n_all}));
    ops::convert(d_back.tensor({n_all}), d_wide.tensor({n_all}));
    const Vec wide = d_wide.to_host();
    const std::vector<Bf16> back = d_back.to_host();
    std::size_t wrong_wide = 0, wrong_back = 0;
    for (std::size_t i = 0; i < all.size(); ++i) {
      if (bits_of(wide[i]) != std::uint32_t(i) << 16) ++wrong_wide;
      const bool nan = std::isnan(to_float(all[i]));
      if (nan ? !std::isnan(to_float(back[i])) : back[i].bits != all[i].bits) ++wrong_back;
    }
    CHECK(wrong_wide == 0);
    CHECK(wrong_back == 0);
    require_guards("wide", d_wide);
    require_guards("back", d_back);
  }

  // float -> bf16 on random bit patterns (every exponent, subnormals, infinities, NaNs) after a
  // list of ties and edge cases, against the host's round-to-nearest-even.
  const std::vector<std::uint32_t> edge_bits = {
      0x00000000, 0x80000000, 0x7f800000, 0xff800000, 0x7fc00000, 0xffc00001,  // zeros, infinities, NaNs
      0x3f808000, 0x3f818000, 0xbf808000, 0xbf818000,  // ties: to even down, to even up
      0x3f808001, 0x3f807fff,                          // just above, just below a tie
      0x00008000, 0x00018000, 0x00000001, 0x007fffff,  // subnormal ties and extremes
      0x7f7f7fff, 0x7f7f8000, 0x7f7fffff, 0xff7fffff,  // the top of the range: stays, overflows
      0x00800000, 0x3f800000, 0x4b7fffff};
  std::mt19937 rng(200);
  for (const std::int64_t N : {std::int64_t(1), std::int64_t(3), std::int64_t(8), std::int64_t(9),
                               std::int64_t(4099), std::int64_t(1) << 20}) {
    for (const std::size_t offset : {0, 1}) {
      CAPTURE(N, offset);
      Vec x(static_cast<std::size_t>(N));
      for (std::size_t i = 0; i < x.size(); ++i) {
        const std::uint32_t u = i < edge_bits.size() ? edge_bits[i] : std::uint32_t(rng());
        std::memcpy(&x[i], &u, sizeof u);
      }
      const DeviceArray<float> d_x(x, offset);
      const DeviceArray<Bf16> d_y(std::vector<Bf16>(x.size(), sentinel<Bf16>()), offset);
      ops::convert(d_y.tensor({N}), d_x.tensor({N}));
      const std::vector<Bf16> y = d_y.to_host();
      std::size_t wrong = 0, first_wrong = x.size();
      for (std::size_t i = 0; i < x.size(); ++i) {
        const Bf16 want = to_bf16(x[i]);
        const bool ok = std::isnan(x[i]) ? std::isnan(to_float(y[i])) : y[i].bits == want.bits;
        if (!ok && wrong++ == 0) first_wrong = i;
      }
      INFO(wrong << " elements rounded differently from the host, the first at " << first_wrong
                 << (first_wrong < x.size()
                         ? " (float bits " + std::to_string(bits_of(x[first_wrong])) + ", device bf16 bits " +
                               std::to_string(y[first_wrong].bits) + ", host " +
                               std::to_string(to_bf16(x[first_wrong]).bits) + ")"
                         : std::string()));
      CHECK(wrong == 0);
      require_guards("bf16 out", d_y);
      require_guards("float in", d_x);
    }
  }
}

TEST_CASE("cuda fused_classifier propagates a NaN logit to the loss, f32 and bf16", "[cuda][ops][bf16]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);

  std::mt19937 rng(110);
  const std::int64_t N = 3;
  const int V = 1001;
  Vec logits = uniform_vec(rng, std::size_t(N) * V);
  logits[std::size_t(V) + 17] = std::numeric_limits<float>::quiet_NaN();  // row 1
  std::vector<std::int32_t> targets = {1, 2, 3};
  for (const DType dtype : {DType::f32, DType::bf16}) {
    CAPTURE(dtype_name(dtype));
    const DeviceTensor d_logits(HostValues{dtype == DType::bf16 ? round_bf16(logits) : logits, {}}, dtype, 0);
    const DeviceArray<float> d_losses(Vec(N, 0.0f));
    const DeviceArray<std::int32_t> d_targets(targets);
    const double sum =
        ops::fused_classifier(d_logits.tensor({N, V}), d_losses.tensor({N}), d_targets.tensor({N}), 1.0f);
    const Vec result = d_losses.to_host();
    CHECK(std::isfinite(result[0]));
    CHECK(std::isnan(result[1]));
    CHECK(std::isfinite(result[2]));
    CHECK(std::isnan(sum));
  }
}

TEST_CASE("cuda vocabulary-parallel cross-entropy over 3 uneven ranks and on one rank matches the cpu "
          "fused_classifier, f32 and bf16", "[cuda][ops][bf16]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);

  const std::int64_t N = 37;
  const int V = 1001;
  const float scale = 1.0f / 37.0f;
  std::mt19937 rng(117);
  const Vec values = uniform_vec(rng, std::size_t(N) * V, -8.0f, 8.0f);
  std::vector<std::int32_t> targets(static_cast<std::size_t>(N));
  for (std::size_t i = 0; i < targets.size(); ++i) targets[i] = std::int32_t((i * 271 + 5) % V);  // every range
  // 400 columns: 128-bit accesses for f32 and bf16; 268: f32 only; 333: neither.
  for (const std::vector<int>& widths : {std::vector<int>{400, 333, 268}, std::vector<int>{V}}) {
    for (const DType dtype : {DType::f32, DType::bf16}) {
      CAPTURE(widths.size(), dtype_name(dtype));
      // The reference: the f32 CPU fused_classifier on the full (rounded) logits.
      const Vec logits = dtype == DType::bf16 ? round_bf16(values) : values;
      Vec want_dlogits = logits, want_losses(static_cast<std::size_t>(N));
      const double want_sum =
          ops::fused_classifier(t(want_dlogits, {N, V}), t(want_losses, {N}), ti(targets, {N}), scale);

      std::vector<DeviceTensor> parts;  // each rank's columns
      std::vector<std::int64_t> begins;
      for (int begin = 0; const int w : widths) {
        Vec columns;
        for (std::int64_t i = 0; i < N; ++i) {
          columns.insert(columns.end(), logits.begin() + i * V + begin, logits.begin() + i * V + begin + w);
        }
        parts.emplace_back(HostValues{columns, {}}, dtype, 0);
        begins.push_back(begin);
        begin += w;
      }
      const DeviceArray<std::int32_t> d_targets(targets);
      const Tensor d_t = d_targets.tensor({N});
      // Step 1 on each rank, the max over the ranks on the host.
      Vec row_max(std::size_t(N), -std::numeric_limits<float>::infinity());
      for (std::size_t r = 0; r < parts.size(); ++r) {
        const DeviceArray<float> d_max(Vec(std::size_t(N), 0.0f));
        ops::classifier_row_max(d_max.tensor({N}), parts[r].tensor({N, widths[r]}));
        const Vec local = d_max.to_host();
        for (std::size_t i = 0; i < local.size(); ++i) row_max[i] = std::max(row_max[i], local[i]);
        require_guards("row_max", d_max);
      }
      // Step 2 on each rank, the sums over the ranks on the host.
      const DeviceArray<float> d_row_max(row_max);
      Vec sum_exp(std::size_t(N), 0.0f), target_logit(std::size_t(N), 0.0f);
      for (std::size_t r = 0; r < parts.size(); ++r) {
        const DeviceArray<float> d_sum(Vec(std::size_t(N), 0.0f)), d_target(Vec(std::size_t(N), 0.0f));
        ops::classifier_row_stats(d_sum.tensor({N}), d_target.tensor({N}), parts[r].tensor({N, widths[r]}),
                                  d_row_max.tensor({N}), d_t, begins[r]);
        const Vec s = d_sum.to_host(), tl = d_target.to_host();
        for (std::size_t i = 0; i < s.size(); ++i) {
          sum_exp[i] += s[i];
          target_logit[i] += tl[i];
        }
      }
      // Step 3 on each rank: the losses and this rank's columns of the gradient.
      const DeviceArray<float> d_sum_exp(sum_exp), d_target_logit(target_logit);
      for (std::size_t r = 0; r < parts.size(); ++r) {
        CAPTURE(r);
        const DeviceArray<float> d_losses(Vec(std::size_t(N), 0.0f));
        const double sum = ops::classifier_parallel_finish(parts[r].tensor({N, widths[r]}), d_losses.tensor({N}),
                                                           d_row_max.tensor({N}), d_sum_exp.tensor({N}),
                                                           d_target_logit.tensor({N}), d_t, begins[r], scale);
        require_close("losses", d_losses.to_host(), want_losses, f32_elementwise.f32, 1.0);
        INFO("loss sum " << sum << ", fused_classifier's " << want_sum);
        CHECK(std::abs(sum - want_sum) <= f32_elementwise.f32 * std::abs(want_sum));
        Vec want_columns;
        for (std::int64_t i = 0; i < N; ++i) {
          const auto row = want_dlogits.begin() + i * V + begins[r];
          want_columns.insert(want_columns.end(), row, row + widths[r]);
        }
        const Tol tol = act_elementwise;
        require_close("dlogits", parts[r].values(), want_columns, dtype == DType::bf16 ? tol.bf16 : tol.f32);
        REQUIRE(parts[r].guards_intact());
      }
    }
  }
}

namespace {
/// Columns [0, V) of each row of `rows` (N rows of `ld`).
Vec first_columns(const Vec& rows, std::int64_t N, std::int64_t V, std::int64_t ld) {
  Vec out;
  for (std::int64_t i = 0; i < N; ++i) out.insert(out.end(), rows.begin() + i * ld, rows.begin() + i * ld + V);
  return out;
}
/// Whether every element of columns [V, ld) of every row is `want` (NaN: is NaN).
bool padding_is(const Vec& rows, std::int64_t N, std::int64_t V, std::int64_t ld, float want) {
  for (std::int64_t i = 0; i < N; ++i) {
    for (std::int64_t v = V; v < ld; ++v) {
      const float x = rows[std::size_t(i * ld + v)];
      if (std::isnan(want) ? !std::isnan(x) : x != want) return false;
    }
  }
  return true;
}
}  // namespace

TEST_CASE("cuda padded vocabulary: the head's matmuls and the classifier over rows of logits_stride(V) equal "
          "the unpadded cpu reference, f32 and bf16", "[cuda][ops][bf16]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);

  const std::int64_t N = 37, C = 24, V = 251, ld = ops::logits_stride(V);  // odd V: rows of 256
  REQUIRE(ld == 256);
  const float scale = 1.0f / float(N);
  std::mt19937 rng(131);
  const Vec inp0 = uniform_vec(rng, std::size_t(N * C)), weight0 = uniform_vec(rng, std::size_t(V * C));
  std::vector<std::int32_t> targets(static_cast<std::size_t>(N));
  for (std::size_t i = 0; i < targets.size(); ++i) targets[i] = std::int32_t((i * 97 + 3) % V);
  for (const DType dtype : {DType::f32, DType::bf16}) {
    CAPTURE(dtype_name(dtype));
    const bool bf16 = dtype == DType::bf16;
    Vec inp = bf16 ? round_bf16(inp0) : inp0, weight = bf16 ? round_bf16(weight0) : weight0;
    // The reference: the f32 CPU ops on unpadded (N,V) logits; the device's logits rounded to bf16
    // before the classifier, as a bf16 run rounds them.
    Vec logits(std::size_t(N * V)), losses(static_cast<std::size_t>(N)), dinp(std::size_t(N * C)), dweight(std::size_t(V * C), 0.0f);
    ops::matmul_forward(t(logits, {N, V}), t(inp, {N, C}), t(weight, {V, C}), Tensor());
    const Vec want_logits = logits;
    if (bf16) logits = round_bf16(logits);
    const double want_sum = ops::fused_classifier(t(logits, {N, V}), t(losses, {N}), ti(targets, {N}), scale);
    if (bf16) logits = round_bf16(logits);
    ops::matmul_backward(t(dinp, {N, C}), t(dweight, {V, C}), Tensor(), t(logits, {N, V}), t(inp, {N, C}),
                         t(weight, {V, C}), ops::Accumulate::no);

    // The device: padded rows whose padding starts as NaN, as unwritten memory may be.
    const DeviceTensor d_inp(HostValues{inp, {}}, dtype, 0), d_weight(HostValues{weight, {}}, dtype, 0);
    const DeviceTensor d_logits(HostValues{Vec(std::size_t(N * ld), std::numeric_limits<float>::quiet_NaN()), {}},
                                dtype, 0);
    const DeviceTensor d_dinp(HostValues{Vec(std::size_t(N * C), 0.0f), {}}, dtype, 0);
    const DeviceArray<float> d_dweight(Vec(std::size_t(V * C), 0.0f)), d_losses(Vec(std::size_t(N), 0.0f));
    const DeviceArray<std::int32_t> d_targets(targets);
    ops::matmul_forward(d_logits.tensor({N, ld}), d_inp.tensor({N, C}), d_weight.tensor({V, C}), Tensor());
    const Vec got_logits = d_logits.values();
    require_close("logits", first_columns(got_logits, N, V, ld), want_logits, bf16 ? act_reduction.bf16 : act_reduction.f32);
    CHECK(padding_is(got_logits, N, V, ld, std::numeric_limits<float>::quiet_NaN()));  // not written

    const double sum = ops::fused_classifier(d_logits.tensor({N, ld}), d_losses.tensor({N}), d_targets.tensor({N}),
                                             scale, nullptr, V);
    require_close("losses", d_losses.to_host(), losses, bf16 ? f32_reduction_of_bf16.bf16 : f32_elementwise.f32, 1.0);
    CHECK(std::abs(sum - want_sum) <= (bf16 ? 1e-4 : 1e-5) * std::abs(want_sum));
    const Vec got_dlogits = d_logits.values();
    require_close("dlogits", first_columns(got_dlogits, N, V, ld), logits, bf16 ? act_elementwise.bf16 : act_elementwise.f32);
    CHECK(padding_is(got_dlogits, N, V, ld, 0.0f));  // masked: the gradient's padding is 0

    ops::matmul_backward(d_dinp.tensor({N, C}), d_dweight.tensor({V, C}), Tensor(), d_logits.tensor({N, ld}),
                         d_inp.tensor({N, C}), d_weight.tensor({V, C}), ops::Accumulate::no);
    require_close("dinp", d_dinp.values(), dinp, bf16 ? act_reduction.bf16 : act_reduction.f32);
    require_close("dweight", d_dweight.to_host(), dweight, bf16 ? f32_reduction_of_bf16.bf16 : f32_reduction.f32);

    // The vocabulary-parallel steps on one rank over the same padded rows give the same losses.
    const DeviceTensor d_again(HostValues{Vec(std::size_t(N * ld), std::numeric_limits<float>::quiet_NaN()), {}},
                               dtype, 0);
    ops::matmul_forward(d_again.tensor({N, ld}), d_inp.tensor({N, C}), d_weight.tensor({V, C}), Tensor());
    const DeviceArray<float> d_max(Vec(std::size_t(N), 0.0f)), d_sum_exp(Vec(std::size_t(N), 0.0f)),
        d_target(Vec(std::size_t(N), 0.0f)), d_losses2(Vec(std::size_t(N), 0.0f));
    ops::classifier_row_max(d_max.tensor({N}), d_again.tensor({N, ld}), V);
    ops::classifier_row_stats(d_sum_exp.tensor({N}), d_target.tensor({N}), d_again.tensor({N, ld}), d_max.tensor({N}),
                              d_targets.tensor({N}), 0, V);
    ops::classifier_parallel_finish(d_again.tensor({N, ld}), d_losses2.tensor({N}), d_max.tensor({N}),
                                    d_sum_exp.tensor({N}), d_target.tensor({N}), d_targets.tensor({N}), 0, scale,
                                    nullptr, V);
    require_close("parallel losses", d_losses2.to_host(), losses, bf16 ? f32_reduction_of_bf16.bf16 : f32_elementwise.f32,
                  1.0);
    const Vec got_parallel = d_again.values();
    require_close("parallel dlogits", first_columns(got_parallel, N, V, ld), logits,
                  bf16 ? act_elementwise.bf16 : act_elementwise.f32);
    CHECK(padding_is(got_parallel, N, V, ld, 0.0f));
  }
}

TEST_CASE("cuda vocabulary-parallel steps: a NaN logit makes the sum NaN, a negative target the target logit",
          "[cuda][ops][bf16]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);

  // Rows 0 and 2 are clean; row 1 has a NaN logit; row 2's target is negative. The max skips the
  // NaN (as the CPU's does), so the all-reduced max stays a number and the sum carries the NaN.
  const std::int64_t N = 3;
  const int V = 1001;
  const std::int64_t vocab_begin = 5000;
  std::mt19937 rng(118);
  Vec logits = uniform_vec(rng, std::size_t(N) * V);
  logits[std::size_t(V) + 17] = std::numeric_limits<float>::quiet_NaN();
  std::vector<std::int32_t> targets = {5003, 5004, -1};
  for (const DType dtype : {DType::f32, DType::bf16}) {
    CAPTURE(dtype_name(dtype));
    const Vec values = dtype == DType::bf16 ? round_bf16(logits) : logits;
    const DeviceTensor d_logits(HostValues{values, {}}, dtype, 0);
    const DeviceArray<std::int32_t> d_targets(targets);
    const DeviceArray<float> d_max(Vec(N, 0.0f)), d_sum(Vec(N, 0.0f)), d_target(Vec(N, 0.0f));
    ops::classifier_row_max(d_max.tensor({N}), d_logits.tensor({N, V}));
    const Vec row_max = d_max.to_host();
    for (std::int64_t i = 0; i < N; ++i) {
      float want = -std::numeric_limits<float>::infinity();
      for (int v = 0; v < V; ++v) want = std::max(want, values[std::size_t(i * V + v)]);
      CHECK(row_max[std::size_t(i)] == want);
    }
    ops::classifier_row_stats(d_sum.tensor({N}), d_target.tensor({N}), d_logits.tensor({N, V}), d_max.tensor({N}),
                              d_targets.tensor({N}), vocab_begin);
    const Vec sum_exp = d_sum.to_host(), target_logit = d_target.to_host();
    CHECK(std::isfinite(sum_exp[0]));
    CHECK(std::isnan(sum_exp[1]));
    CHECK(std::isfinite(sum_exp[2]));
    CHECK(target_logit[0] == values[3]);
    CHECK(target_logit[1] == values[std::size_t(V) + 4]);
    CHECK(std::isnan(target_logit[2]));
  }
}

TEST_CASE("cuda ops refuse arguments on different devices", "[cuda][ops]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);

  Vec a(4, 1.0f), out(4);
  const DeviceArray<float> d_b(a);
  CHECK_THROWS_AS(ops::residual_forward(t(out, {4}), t(a, {4}), d_b.tensor({4})), RuntimeError);
}

TEST_CASE("cuda multi-tensor adamw_update_runs matches the cpu adamw_update per run and writes the bf16 copy",
          "[cuda][ops][optim]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);

  // Runs of odd sizes with gaps between them (which must stay untouched), decayed and not, at
  // offsets on and off a multiple of 4 elements (the 128-bit and the scalar paths), one longer
  // than two chunks (several blocks of one run) and one of a single element.
  const std::vector<ops::AdamWRun> runs = {{0, 1000, true},   {1000, 3, false},     {1003, 8197, true},
                                           {9201, 1, false},  {9205, 768, false},   {9973, 4099, true},
                                           {14075, 517, true}};
  const std::int64_t N = 14075 + 517 + 5;  // five elements after the last run
  std::vector<bool> covered(std::size_t(N), false);
  for (const auto& r : runs) {
    for (std::int64_t i = r.offset; i < r.offset + r.length; ++i) covered[std::size_t(i)] = true;
  }
  std::mt19937 rng(2718);
  const Vec param0 = uniform_vec(rng, std::size_t(N)), grad = uniform_vec(rng, std::size_t(N), -2.0f, 2.0f);
  const Vec m0 = uniform_vec(rng, std::size_t(N), -0.1f, 0.1f), v0 = uniform_vec(rng, std::size_t(N), 0.0f, 0.01f);
  const std::vector<Bf16> working0(std::size_t(N), sentinel<Bf16>());
  const ops::AdamWPlan plan(runs, Device::cuda);
  CHECK(plan.chunks() >= std::int64_t(runs.size()) + 2);

  for (const int step : {1, 10}) {
    for (const std::size_t offset : {0, 1}) {
      for (const bool with_working : {true, false}) {
        CAPTURE(step, offset, with_working);
        // A large learning rate and weight decay, so that the update and the decay are far above
        // the rounding of the weights.
        const ops::AdamWParams p{0.05f, 0.9f, 0.95f, 1e-8f, 0.5f, step, 0.5f};
        // The reference: the CPU adamw_update, run by run, with the run's weight decay.
        Vec want_param = param0, want_m = m0, want_v = v0, g = grad;
        for (const auto& r : runs) {
          const auto at = std::size_t(r.offset);
          const ops::AdamWParams q{p.lr, p.beta1, p.beta2, p.eps, r.decay ? p.weight_decay : 0.0f, step, p.grad_scale};
          ops::adamw_update(Tensor(want_param.data() + at, DType::f32, Device::cpu, {r.length}),
                            Tensor(g.data() + at, DType::f32, Device::cpu, {r.length}),
                            Tensor(want_m.data() + at, DType::f32, Device::cpu, {r.length}),
                            Tensor(want_v.data() + at, DType::f32, Device::cpu, {r.length}), q);
        }
        const DeviceArray<float> d_param(param0, offset), d_grad(grad, offset), d_m(m0, offset), d_v(v0, offset);
        const DeviceArray<Bf16> d_working(working0, offset);
        ops::adamw_update_runs(d_param.tensor({N}), d_grad.tensor({N}), d_m.tensor({N}), d_v.tensor({N}),
                               with_working ? d_working.tensor({N}) : Tensor(), plan, p);
        const Vec got_param = d_param.to_host(), got_m = d_m.to_host(), got_v = d_v.to_host();
        require_close("param change", minus(got_param, param0), minus(want_param, param0), f32_elementwise.f32);
        require_close("m", got_m, want_m, f32_elementwise.f32);
        require_close("v", got_v, want_v, f32_elementwise.f32);
        // Outside the runs nothing moves; the gradient is read only.
        std::size_t moved = 0, wrong_copy = 0;
        const std::vector<Bf16> working = d_working.to_host();
        for (std::size_t i = 0; i < std::size_t(N); ++i) {
          if (!covered[i]) {
            moved += bits_of(got_param[i]) != bits_of(param0[i]) || bits_of(got_m[i]) != bits_of(m0[i]) ||
                     bits_of(got_v[i]) != bits_of(v0[i]) || working[i].bits != working0[i].bits;
          } else if (with_working) {
            wrong_copy += working[i].bits != to_bf16(got_param[i]).bits;  // the updated weight, rounded
          } else {
            wrong_copy += working[i].bits != working0[i].bits;
          }
        }
        CHECK(moved == 0);
        CHECK(wrong_copy == 0);
        CHECK(d_grad.to_host() == grad);
        for (const auto* a : {&d_param, &d_grad, &d_m, &d_v}) require_guards("f32 array", *a);
        require_guards("working", d_working);
      }
    }
  }
  // A plan for the wrong device, or runs past the arrays' end, are refused.
  const ops::AdamWPlan cpu_plan(runs, Device::cpu);
  const DeviceArray<float> d_x(param0);
  const ops::AdamWParams p{0.05f, 0.9f, 0.95f, 1e-8f, 0.5f, 1, 1.0f};
  CHECK_THROWS_AS(ops::adamw_update_runs(d_x.tensor({N}), d_x.tensor({N}), d_x.tensor({N}), d_x.tensor({N}), Tensor(),
                                         cpu_plan, p),
                  RuntimeError);
  Vec small(10);
  CHECK_THROWS_AS(ops::adamw_update_runs(t(small, {10}), t(small, {10}), t(small, {10}), t(small, {10}), Tensor(),
                                         cpu_plan, p),
                  RuntimeError);
}

TEST_CASE("cuda adamw_update_runs with moments laid end to end matches the cpu adamw_update per run",
          "[cuda][ops][optim]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);

  // Moments for the runs only, end to end (as Muon keeps AdamW's for the elements outside its
  // matrices): a run's weights and its moments start on different residues modulo 4, so the
  // kernel must take the scalar path there, and the 128-bit one where both are aligned.
  const std::vector<ops::AdamWRun> runs = {{0, 1000, true, 0},       {1004, 4099, false, 1000},
                                           {5107, 9, true, 5099},    {5120, 8200, true, 5108},
                                           {13330, 3, false, 13308}};
  const std::int64_t N = 13340, M = 13311;
  std::mt19937 rng(1618);
  const Vec param0 = uniform_vec(rng, std::size_t(N)), grad = uniform_vec(rng, std::size_t(N), -2.0f, 2.0f);
  const Vec m0 = uniform_vec(rng, std::size_t(M), -0.1f, 0.1f), v0 = uniform_vec(rng, std::size_t(M), 0.0f, 0.01f);
  const ops::AdamWParams p{0.05f, 0.9f, 0.95f, 1e-8f, 0.5f, 3, 0.5f};
  Vec want_param = param0, want_m = m0, want_v = v0, g = grad;
  std::vector<bool> covered(std::size_t(N), false);
  for (const auto& r : runs) {  // the reference: the CPU adamw_update on each run's weights and moments
    const ops::AdamWParams q{p.lr, p.beta1, p.beta2, p.eps, r.decay ? p.weight_decay : 0.0f, p.step, p.grad_scale};
    const auto part = [&](Vec& v, std::int64_t at) { return Tensor(v.data() + at, DType::f32, Device::cpu, {r.length}); };
    ops::adamw_update(part(want_param, r.offset), part(g, r.offset), part(want_m, r.state), part(want_v, r.state), q);
    for (std::int64_t i = r.offset; i < r.offset + r.length; ++i) covered[std::size_t(i)] = true;
  }
  const ops::AdamWPlan plan(runs, Device::cuda);
  CHECK(plan.state_extent() == M);
  const DeviceArray<float> d_param(param0), d_grad(grad), d_m(m0), d_v(v0);
  ops::adamw_update_runs(d_param.tensor({N}), d_grad.tensor({N}), d_m.tensor({M}), d_v.tensor({M}), Tensor(), plan, p);
  const Vec got_param = d_param.to_host();
  require_close("param change", minus(got_param, param0), minus(want_param, param0), f32_elementwise.f32);
  require_close("m", d_m.to_host(), want_m, f32_elementwise.f32);
  require_close("v", d_v.to_host(), want_v, f32_elementwise.f32);
  std::size_t moved = 0;
  for (std::size_t i = 0; i < std::size_t(N); ++i) moved += !covered[i] && bits_of(got_param[i]) != bits_of(param0[i]);
  CHECK(moved == 0);
  // Moments shorter than the plan's runs reach are refused.
  const Tensor short_m(d_m.data(), DType::f32, Device::cuda, {M - 1}), short_v(d_v.data(), DType::f32, Device::cuda, {M - 1});
  CHECK_THROWS_AS(ops::adamw_update_runs(d_param.tensor({N}), d_grad.tensor({N}), short_m, short_v, Tensor(), plan, p),
                  RuntimeError);
}

TEST_CASE("cuda fused_classifier, classifier_parallel_finish and sum_squares add into a DeviceSum",
          "[cuda][ops][bf16]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);

  // Three "micro-steps" of different row counts: the deferred sum must be the sum of the values
  // the immediate calls return, added in the same order (bit for bit), and each deferred call
  // returns 0; take() starts the sum again from 0.
  std::mt19937 rng(314);
  const int V = 251;
  for (const DType dtype : {DType::f32, DType::bf16}) {
    CAPTURE(dtype_name(dtype));
    ops::DeviceSum deferred(Device::cuda);
    double immediate = 0.0;
    for (const std::int64_t N : {std::int64_t(5), std::int64_t(64), std::int64_t(700)}) {
      CAPTURE(N);
      Vec logits = uniform_vec(rng, std::size_t(N) * V, -4.0f, 4.0f);
      if (dtype == DType::bf16) logits = round_bf16(logits);
      std::vector<std::int32_t> targets(static_cast<std::size_t>(N));
      for (std::size_t i = 0; i < targets.size(); ++i) targets[i] = std::int32_t((i * 97 + 3) % V);
      const DeviceArray<std::int32_t> d_targets(targets);
      const DeviceArray<float> d_losses(Vec(std::size_t(N), 0.0f)), d_row_max(Vec(std::size_t(N), 0.0f));
      const DeviceArray<float> d_sum_exp(Vec(std::size_t(N), 0.0f)), d_target(Vec(std::size_t(N), 0.0f));
      const DeviceTensor a(HostValues{logits, {}}, dtype, 0), b(HostValues{logits, {}}, dtype, 0);
      immediate += ops::fused_classifier(a.tensor({N, V}), d_losses.tensor({N}), d_targets.tensor({N}), 0.5f);
      CHECK(ops::fused_classifier(b.tensor({N, V}), d_losses.tensor({N}), d_targets.tensor({N}), 0.5f, &deferred) ==
            0.0);
      CHECK(a.values() == b.values());  // the same gradient either way
      // The vocabulary-parallel finish on one rank, deferred too.
      const DeviceTensor c(HostValues{logits, {}}, dtype, 0);
      ops::classifier_row_max(d_row_max.tensor({N}), c.tensor({N, V}));
      ops::classifier_row_stats(d_sum_exp.tensor({N}), d_target.tensor({N}), c.tensor({N, V}), d_row_max.tensor({N}),
                                d_targets.tensor({N}), 0);
      ops::DeviceSum parallel(Device::cuda);
      const double finish_now =
          ops::classifier_parallel_finish(c.tensor({N, V}), d_losses.tensor({N}), d_row_max.tensor({N}),
                                          d_sum_exp.tensor({N}), d_target.tensor({N}), d_targets.tensor({N}), 0, 0.0f);
      CHECK(ops::classifier_parallel_finish(c.tensor({N, V}), d_losses.tensor({N}), d_row_max.tensor({N}),
                                            d_sum_exp.tensor({N}), d_target.tensor({N}), d_targets.tensor({N}), 0,
                                            0.0f, &parallel) == 0.0);
      CHECK(parallel.take() == finish_now);
    }
    const double got = deferred.take();
    CHECK(std::isfinite(got));
    CHECK(got > 0.0);
    CHECK(got == immediate);
    CHECK(deferred.take() == 0.0);
  }
  // The gradient norm's parts (several ranges, some misaligned): one sum, read once, equal to the
  // returned sums added in order.
  {
    const Vec x = uniform_vec(rng, 20011, -3.0f, 3.0f);
    const DeviceArray<float> d_x(x);
    ops::DeviceSum squares(Device::cuda);
    double immediate = 0.0;
    for (const auto& [begin, length] : {std::pair{0, 4096}, std::pair{4097, 3}, std::pair{4101, 15000}}) {
      const Tensor part(d_x.data() + begin, DType::f32, Device::cuda, {length});
      immediate += ops::sum_squares(part);
      CHECK(ops::sum_squares(part, &squares) == 0.0);
    }
    CHECK(immediate > 0.0);
    CHECK(squares.take() == immediate);
  }
  // A loss sum in host memory for device losses is refused.
  ops::DeviceSum host_sum(Device::cpu);
  Vec logits(2 * 4, 0.5f);
  const DeviceArray<float> d_logits(logits), d_losses(Vec(2, 0.0f));
  const DeviceArray<std::int32_t> d_targets(std::vector<std::int32_t>{0, 1});
  CHECK_THROWS_AS(ops::fused_classifier(d_logits.tensor({2, 4}), d_losses.tensor({2}), d_targets.tensor({2}), 1.0f,
                                        &host_sum),
                  RuntimeError);
}
