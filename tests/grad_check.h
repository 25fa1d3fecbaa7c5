// Helpers for checking backward ops against central finite differences of their forward.
#pragma once

#include <cmath>
#include <functional>
#include <random>
#include <vector>

#include "catch_compat.h"
#include "core/tensor.h"

namespace llmtrain::test {

using Vec = std::vector<float>;

inline Tensor t(Vec& v, std::initializer_list<std::int64_t> shape) { return Tensor(v.data(), DType::f32, Device::cpu, shape); }
inline Tensor ti(std::vector<std::int32_t>& v, std::initializer_list<std::int64_t> shape) {
  return Tensor(v.data(), DType::i32, Device::cpu, shape);
}

inline Vec random_vec(std::mt19937& rng, std::size_t n, float scale = 1.0f, float offset = 0.0f) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Vec v(n);
  for (auto& x : v) x = offset + scale * normal(rng);
  return v;
}

// L = sum(out * R), computed in double. `forward` recomputes out from the current inputs.
inline double weighted_sum(const Vec& out, const Vec& R) {
  double s = 0.0;
  for (std::size_t i = 0; i < out.size(); ++i) s += double(out[i]) * R[i];
  return s;
}

// Compares `analytic` (dL/dx) with central differences over (up to 300 sampled) elements of x:
// the norm of the difference over the norm of the numerical gradient must be below `tol`.
inline void check_gradient(const char* what, Vec& x, const Vec& analytic, const std::function<double()>& loss,
                    double eps = 1e-2, double tol = 2e-3) {
  REQUIRE(analytic.size() == x.size());
  double diff2 = 0.0, ref2 = 0.0;
  const std::size_t stride = std::max<std::size_t>(1, x.size() / 300);
  for (std::size_t i = 0; i < x.size(); i += stride) {
    const float saved = x[i];
    x[i] = saved + float(eps);
    const double plus = loss();
    x[i] = saved - float(eps);
    const double minus = loss();
    x[i] = saved;
    const double numeric = (plus - minus) / (2 * eps);
    diff2 += (numeric - analytic[i]) * (numeric - analytic[i]);
    ref2 += numeric * numeric;
  }
  CAPTURE(what, std::sqrt(diff2), std::sqrt(ref2));
  REQUIRE(ref2 > 0.0);  // the check is not trivially zero
  CHECK(std::sqrt(diff2 / ref2) < tol);
}

struct Shape {
  int B, T, C, NH;
};
inline const Shape shapes[] = {{1, 3, 4, 1}, {2, 5, 6, 2}, {3, 7, 12, 3}};

}  // namespace llmtrain::test
