// exp_vec (the vectorised exp of the CPU ops) against double-precision exp over its whole range,
// and the grain rule that keeps small work on the calling thread.
#include <cmath>
#include <limits>
#include <vector>

#include "catch_compat.h"
#include "llmtrain/kernels/vec_math.h"

using namespace llmtrain;

TEST_CASE("exp_vec is within 2 ulp of exp over [-80, 80]", "[ops][vec]") {
  std::vector<float> x, y;
  for (float v = -80.0f; v <= 80.0f; v += 0.0007f) x.push_back(v);
  for (const float v : {0.0f, -0.0f, 1e-8f, -1e-8f, 0.5f * 0.6931472f, -0.5f * 0.6931472f}) x.push_back(v);
  y.resize(x.size());
#pragma omp simd
  for (std::size_t i = 0; i < x.size(); ++i) y[i] = cpu::exp_vec(x[i]);  // the vectorised path
  double worst_ulp = 0.0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double want = std::exp(double(x[i]));
    const float want_f = float(want);
    const double ulp = double(std::nextafter(want_f, std::numeric_limits<float>::infinity()) - want_f);
    worst_ulp = std::max(worst_ulp, std::abs(double(y[i]) - want) / ulp);
  }
  CAPTURE(worst_ulp);
  CHECK(worst_ulp <= 2.0);
  CHECK(cpu::exp_vec(0.0f) == 1.0f);
  // Clamped outside the range: e^-80 and e^80, normal floats (no subnormals, no inf, no NaN).
  const float lowest = cpu::exp_vec(-1000.0f), highest = cpu::exp_vec(1000.0f);
  CHECK(std::abs(lowest / float(std::exp(-80.0)) - 1.0f) < 1e-6f);
  CHECK(std::abs(highest / float(std::exp(80.0)) - 1.0f) < 1e-6f);
  CHECK(std::isnormal(1.0f / (1.0f + highest)));
  CHECK(cpu::exp_vec(-std::numeric_limits<float>::infinity()) == lowest);
}

TEST_CASE("small work stays on the calling thread", "[ops][vec]") {
  CHECK_FALSE(cpu::worth_threads(cpu::parallel_grain));
  CHECK(cpu::worth_threads(cpu::parallel_grain + 1));
  CHECK_FALSE(cpu::worth_threads(1024 * 4));  // one decoding row of a 1024-wide GELU
}
