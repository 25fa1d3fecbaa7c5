// The vocabulary-parallel cross-entropy (ops::classifier_row_max, classifier_row_stats,
// classifier_parallel_finish) on the CPU, against fused_classifier on the whole vocabulary: ranks
// are simulated by column ranges of one logits matrix, and the all-reduces between the steps are
// done here by hand (max, then sums).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "catch_compat.h"
#include "core/bf16.h"
#include "core/error.h"
#include "grad_check.h"
#include "ops/ops.h"

using namespace llmtrain;
using namespace llmtrain::test;

namespace {

using U16 = std::vector<std::uint16_t>;

/// Logits (N,V) as a rank's tensor: f32, or bf16 (the values rounded to bf16 beforehand, so both
/// sides read the same numbers).
struct Logits {
  DType dtype;
  std::int64_t N;
  int V;
  Vec f;   // f32 values
  U16 b;   // bf16 bits

  Logits(DType dtype_, std::int64_t N_, int V_, const Vec& values) : dtype(dtype_), N(N_), V(V_) {
    if (dtype == DType::bf16) {
      for (const float x : values) b.push_back(float_to_bf16_bits(x));
    } else {
      f = values;
    }
  }
  Tensor tensor() {
    return dtype == DType::bf16 ? Tensor(b.data(), DType::bf16, Device::cpu, {N, V})
                                : Tensor(f.data(), DType::f32, Device::cpu, {N, V});
  }
  float at(std::int64_t i, int v) const {
    const std::size_t k = std::size_t(i * V + v);
    return dtype == DType::bf16 ? bf16_bits_to_float(b[k]) : f[k];
  }
  /// Columns [begin, begin + width) of every row.
  Logits columns(int begin, int width) const {
    Vec values;
    for (std::int64_t i = 0; i < N; ++i) {
      for (int v = begin; v < begin + width; ++v) values.push_back(at(i, v));
    }
    return Logits(dtype, N, width, values);  // exact: bf16 values round to themselves
  }
};

/// What fused_classifier gives on the whole vocabulary.
struct Full {
  Vec losses;
  Logits dlogits;
  double sum;
};

Full full_reference(const Logits& logits, std::vector<std::int32_t> targets, float scale) {
  Full r{Vec(std::size_t(logits.N)), logits, 0.0};
  r.sum = ops::fused_classifier(r.dlogits.tensor(), t(r.losses, {logits.N}), ti(targets, {logits.N}), scale);
  return r;
}

/// The three steps on column ranges of `widths` (their sum is V), with the all-reduces by hand.
struct Parallel {
  Vec losses;                 // rank 0's (every rank's must be the same)
  std::vector<Logits> parts;  // each rank's logits after the finish
  std::vector<double> sums;   // each rank's returned loss sum
};

Parallel parallel_steps(const Logits& logits, std::vector<std::int32_t> targets, const std::vector<int>& widths,
                        float scale) {
  const std::int64_t N = logits.N;
  const std::size_t n = std::size_t(N);
  Parallel out;
  std::vector<int> begins;
  for (int begin = 0; const int w : widths) {
    begins.push_back(begin);
    out.parts.push_back(logits.columns(begin, w));
    begin += w;
  }
  REQUIRE(begins.back() + widths.back() == logits.V);
  const std::size_t ranks = widths.size();

  // 1, then the max over the ranks.
  Vec row_max(n, -std::numeric_limits<float>::infinity());
  for (std::size_t rank = 0; rank < ranks; ++rank) {
    Vec local(n, 123.0f);
    ops::classifier_row_max(t(local, {N}), out.parts[rank].tensor());
    for (std::size_t i = 0; i < n; ++i) row_max[i] = std::max(row_max[i], local[i]);
  }
  // 2, then the sums over the ranks (in float, as an all-reduce of f32 buffers adds).
  Vec sum_exp(n, 0.0f), target_logit(n, 0.0f);
  for (std::size_t rank = 0; rank < ranks; ++rank) {
    Vec s(n, 123.0f), tl(n, 123.0f);
    ops::classifier_row_stats(t(s, {N}), t(tl, {N}), out.parts[rank].tensor(), t(row_max, {N}), ti(targets, {N}),
                              begins[rank]);
    for (std::size_t i = 0; i < n; ++i) {
      sum_exp[i] += s[i];
      target_logit[i] += tl[i];
    }
  }
  // 3 on every rank.
  for (std::size_t rank = 0; rank < ranks; ++rank) {
    Vec losses(n, 123.0f);
    out.sums.push_back(ops::classifier_parallel_finish(out.parts[rank].tensor(), t(losses, {N}), t(row_max, {N}),
                                                     t(sum_exp, {N}), t(target_logit, {N}), ti(targets, {N}),
                                                     begins[rank], scale));
    if (rank == 0) out.losses = losses;
    CHECK(losses == out.losses);  // every rank computes the same losses from the same statistics
  }
  return out;
}

double max_abs(const Logits& x) {
  double m = 0.0;
  for (std::int64_t i = 0; i < x.N; ++i) {
    for (int v = 0; v < x.V; ++v) m = std::max(m, double(std::abs(x.at(i, v))));
  }
  return m;
}

/// The split's losses, loss sums and every rank's dlogits against fused_classifier's. Losses
/// and sums within `loss_tol` relative; dlogits within `grad_tol` of the largest gradient
/// element (an absolute error: most gradient elements are tiny probabilities).
void check_split(DType dtype, const std::vector<int>& widths, double loss_tol, double grad_tol) {
  const std::int64_t N = 37;
  int V = 0;
  for (const int w : widths) V += w;
  std::mt19937 rng(1700 + V);
  const Vec values = random_vec(rng, std::size_t(N) * V, 3.0f);
  const Logits logits(dtype, N, V, values);
  std::vector<std::int32_t> targets(static_cast<std::size_t>(N));
  for (std::int64_t i = 0; i < N; ++i) targets[std::size_t(i)] = std::int32_t((i * 53 + 7) % V);  // spread over every range

  for (const float scale : {0.0f, 1.0f / 37.0f}) {
    CAPTURE(dtype_name(dtype), widths.size(), scale);
    const Full full = full_reference(logits, targets, scale);
    const Parallel par = parallel_steps(logits, targets, widths, scale);

    double worst_loss = 0.0;
    for (std::size_t i = 0; i < full.losses.size(); ++i) {
      REQUIRE(std::isfinite(par.losses[i]));
      worst_loss = std::max(worst_loss, std::abs(double(par.losses[i]) - full.losses[i]) / std::abs(full.losses[i]));
    }
    CAPTURE(worst_loss);
    CHECK(worst_loss < loss_tol);
    for (const double sum : par.sums) CHECK(std::abs(sum - full.sum) <= loss_tol * std::abs(full.sum));

    const double grad_scale = max_abs(full.dlogits);
    if (scale > 0.0f) REQUIRE(grad_scale > 0.0);
    double worst_grad = 0.0;
    int begin = 0;
    for (std::size_t r = 0; r < widths.size(); begin += widths[r], ++r) {
      for (std::int64_t i = 0; i < N; ++i) {
        for (int v = 0; v < widths[r]; ++v) {
          const float got = par.parts[r].at(i, v), want = full.dlogits.at(i, begin + v);
          if (scale == 0.0f) {
            REQUIRE(got == want);  // no gradient asked: the logits stay as they were
          } else {
            worst_grad = std::max(worst_grad, std::abs(double(got) - want) / grad_scale);
          }
        }
      }
    }
    CAPTURE(worst_grad);
    CHECK(worst_grad < grad_tol);
  }
}

}  // namespace

TEST_CASE("vocabulary-parallel cross-entropy over 3 uneven ranks equals fused_classifier, f32", "[ops][vocab]") {
  check_split(DType::f32, {40, 33, 28}, 1e-6, 1e-6);
}

TEST_CASE("vocabulary-parallel cross-entropy on one rank equals fused_classifier, f32", "[ops][vocab]") {
  check_split(DType::f32, {101}, 1e-6, 1e-6);
}

// bf16 logits: the same widened values on both sides; the f32 losses agree to rounding, and the
// bf16 gradient to a rounding of the result (up to 2^-8 relative: 1e-2 of the largest element,
// as the bf16 op tests allow).
TEST_CASE("vocabulary-parallel cross-entropy over 3 uneven ranks and on one rank, bf16 logits", "[ops][vocab][bf16]") {
  check_split(DType::bf16, {40, 33, 28}, 1e-6, 1e-2);
  check_split(DType::bf16, {101}, 1e-6, 1e-2);
}

TEST_CASE("vocabulary-parallel cross-entropy: hand values, NaN targets and logits, bad arguments", "[ops][vocab]") {
  // One row of logits (0, ln 2, ln 3, 0) over 2 ranks of 2 columns, target 2: exp sum 1 + 2 + 3 + 1
  // = 7 around the max ln 3, so sum_exp = 7/3, and the loss is log(7) - log(3).
  Vec a = {0.0f, std::log(2.0f)}, b = {std::log(3.0f), 0.0f};
  std::vector<std::int32_t> target = {2};
  Vec m_a(1), m_b(1);
  ops::classifier_row_max(t(m_a, {1}), t(a, {1, 2}));
  ops::classifier_row_max(t(m_b, {1}), t(b, {1, 2}));
  CHECK(m_a[0] == std::log(2.0f));
  CHECK(m_b[0] == std::log(3.0f));
  Vec m = {std::max(m_a[0], m_b[0])};
  Vec s_a(1), s_b(1), tl_a(1), tl_b(1);
  ops::classifier_row_stats(t(s_a, {1}), t(tl_a, {1}), t(a, {1, 2}), t(m, {1}), ti(target, {1}), 0);
  ops::classifier_row_stats(t(s_b, {1}), t(tl_b, {1}), t(b, {1, 2}), t(m, {1}), ti(target, {1}), 2);
  CHECK(std::abs(s_a[0] - 1.0f) < 1e-6f);         // (1 + 2) / 3
  CHECK(std::abs(s_b[0] - 4.0f / 3.0f) < 1e-6f);  // (3 + 1) / 3
  CHECK(tl_a[0] == 0.0f);                         // rank 0 does not hold column 2
  CHECK(tl_b[0] == std::log(3.0f));
  Vec s = {s_a[0] + s_b[0]}, tl = {tl_a[0] + tl_b[0]}, loss(1);
  const double sum = ops::classifier_parallel_finish(t(b, {1, 2}), t(loss, {1}), t(m, {1}), t(s, {1}), t(tl, {1}),
                                                     ti(target, {1}), 2, 1.0f);
  CHECK(std::abs(loss[0] - std::log(7.0f / 3.0f)) < 1e-6f);
  CHECK(sum == double(loss[0]));
  CHECK(std::abs(b[0] - (3.0f / 7.0f - 1.0f)) < 1e-6f);  // softmax - onehot at the target
  CHECK(std::abs(b[1] - 1.0f / 7.0f) < 1e-6f);

  // A negative target is no rank's: NaN on every rank, so the summed statistic and the loss are NaN.
  std::vector<std::int32_t> negative = {-1};
  ops::classifier_row_stats(t(s_a, {1}), t(tl_a, {1}), t(a, {1, 2}), t(m, {1}), ti(negative, {1}), 0);
  CHECK(std::isnan(tl_a[0]));
  // A NaN logit: skipped by the max (as std::max and fmaxf do), it makes its rank's sum NaN.
  Vec with_nan = {std::numeric_limits<float>::quiet_NaN(), 1.0f};
  Vec m_nan(1);
  ops::classifier_row_max(t(m_nan, {1}), t(with_nan, {1, 2}));
  CHECK(m_nan[0] == 1.0f);
  ops::classifier_row_stats(t(s_a, {1}), t(tl_a, {1}), t(with_nan, {1, 2}), t(m_nan, {1}), ti(target, {1}), 0);
  CHECK(std::isnan(s_a[0]));

  // Shapes and vocab_begin are checked.
  Vec wrong(2);
  CHECK_THROWS_AS(ops::classifier_row_max(t(wrong, {2}), t(a, {1, 2})), RuntimeError);
  CHECK_THROWS_AS(ops::classifier_row_stats(t(s_a, {1}), t(tl_a, {1}), t(a, {1, 2}), t(m, {1}), ti(target, {1}), -1),
                  RuntimeError);
  CHECK_THROWS_AS(ops::classifier_parallel_finish(t(a, {1, 2}), t(wrong, {2}), t(m, {1}), t(s, {1}), t(tl, {1}),
                                                  ti(target, {1}), 0, 1.0f),
                  RuntimeError);
}

TEST_CASE("padded logits rows: the head's matmuls and the classifier on rows of logits_stride(V) give the "
          "unpadded results bit for bit and never read the padding", "[ops][vocab]") {
  const std::int64_t N = 5, C = 7, V = 131, ld = ops::logits_stride(V);  // rows of 256
  REQUIRE(ld == 256);
  const float nan = std::numeric_limits<float>::quiet_NaN(), scale = 0.2f;
  std::mt19937 rng(77);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  Vec inp(std::size_t(N * C)), weight(std::size_t(V * C));
  for (float& x : inp) x = u(rng);
  for (float& x : weight) x = u(rng);
  std::vector<std::int32_t> targets = {0, 130, 64, 7, 99};

  Vec flat(std::size_t(N * V)), losses(static_cast<std::size_t>(N)), dinp(std::size_t(N * C)), dweight(std::size_t(V * C), 0.0f);
  ops::matmul_forward(t(flat, {N, V}), t(inp, {N, C}), t(weight, {V, C}), Tensor());
  const double sum = ops::fused_classifier(t(flat, {N, V}), t(losses, {N}), ti(targets, {N}), scale);
  ops::matmul_backward(t(dinp, {N, C}), t(dweight, {V, C}), Tensor(), t(flat, {N, V}), t(inp, {N, C}),
                       t(weight, {V, C}), ops::Accumulate::no);

  Vec padded(std::size_t(N * ld), nan), padded_losses(static_cast<std::size_t>(N)), padded_dinp(std::size_t(N * C));
  Vec padded_dweight(std::size_t(V * C), 0.0f);
  ops::matmul_forward(t(padded, {N, ld}), t(inp, {N, C}), t(weight, {V, C}), Tensor());
  for (std::int64_t i = 0; i < N; ++i) {
    for (std::int64_t v = V; v < ld; ++v) REQUIRE(std::isnan(padded[std::size_t(i * ld + v)]));  // not written
  }
  const double padded_sum =
      ops::fused_classifier(t(padded, {N, ld}), t(padded_losses, {N}), ti(targets, {N}), scale, nullptr, V);
  CHECK(padded_sum == sum);
  CHECK(padded_losses == losses);
  for (std::int64_t i = 0; i < N; ++i) {
    for (std::int64_t v = 0; v < ld; ++v) {
      const float got = padded[std::size_t(i * ld + v)];
      REQUIRE(got == (v < V ? flat[std::size_t(i * V + v)] : 0.0f));  // the gradient, its padding 0
    }
  }
  ops::matmul_backward(t(padded_dinp, {N, C}), t(padded_dweight, {V, C}), Tensor(), t(padded, {N, ld}),
                       t(inp, {N, C}), t(weight, {V, C}), ops::Accumulate::no);
  CHECK(padded_dinp == dinp);
  CHECK(padded_dweight == dweight);

  // The vocabulary-parallel steps on one rank, on padded rows: the same losses as fused_classifier.
  Vec again(std::size_t(N * ld), nan), row_max(static_cast<std::size_t>(N)), sum_exp(static_cast<std::size_t>(N)), target_logit(static_cast<std::size_t>(N));
  Vec parallel_losses(static_cast<std::size_t>(N));
  ops::matmul_forward(t(again, {N, ld}), t(inp, {N, C}), t(weight, {V, C}), Tensor());
  ops::classifier_row_max(t(row_max, {N}), t(again, {N, ld}), V);
  ops::classifier_row_stats(t(sum_exp, {N}), t(target_logit, {N}), t(again, {N, ld}), t(row_max, {N}), ti(targets, {N}),
                            0, V);
  ops::classifier_parallel_finish(t(again, {N, ld}), t(parallel_losses, {N}), t(row_max, {N}), t(sum_exp, {N}),
                                  t(target_logit, {N}), ti(targets, {N}), 0, scale, nullptr, V);
  for (std::size_t i = 0; i < losses.size(); ++i) CHECK(std::abs(parallel_losses[i] - losses[i]) <= 1e-6f * losses[i]);
  for (std::int64_t i = 0; i < N; ++i) CHECK(again[std::size_t(i * ld + V)] == 0.0f);

  // More vocabulary columns than the rows hold, or a matmul output narrower than the weight: refused.
  CHECK_THROWS_AS(ops::fused_classifier(t(padded, {N, ld}), t(padded_losses, {N}), ti(targets, {N}), scale, nullptr,
                                        ld + 1),
                  RuntimeError);
  CHECK_THROWS_AS(ops::matmul_forward(t(padded, {N, V - 1}), t(inp, {N, C}), t(weight, {V, C}), Tensor()), RuntimeError);
}
