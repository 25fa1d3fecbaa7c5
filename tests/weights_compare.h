// Comparing trained weights of two runs that should agree up to float rounding.
#pragma once

#include <cmath>
#include <string>
#include <vector>

namespace llmtrain::test {

/// Relative error |got - expected| / |expected| over one tensor. The key part [C, 2C) of a
/// c_attn.bias has an exactly zero gradient (softmax ignores a shift shared by every key), so
/// AdamW divides pure rounding noise by its own size there and may move it by up to lr per step in
/// any run: those entries are checked apart, |got - expected| <= `key_bias_bound`, and excluded.
/// `sums`, when given, gets |got - expected|^2 and |expected|^2 added (a whole model's error).
inline double weights_relative_error(const std::string& name, std::vector<float> got, std::vector<float> expected,
                                     std::int64_t C, double key_bias_bound, bool* key_bias_ok,
                                     double (*sums)[2] = nullptr) {
  *key_bias_ok = true;
  if (name.ends_with("attn.c_attn.bias")) {
    for (std::int64_t i = C; i < 2 * C; ++i) {
      if (std::abs(got[std::size_t(i)] - expected[std::size_t(i)]) > key_bias_bound) *key_bias_ok = false;
      got[std::size_t(i)] = expected[std::size_t(i)] = 0.0f;
    }
  }
  double diff = 0.0, norm = 0.0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    diff += (double(got[i]) - expected[i]) * (double(got[i]) - expected[i]);
    norm += double(expected[i]) * expected[i];
  }
  if (sums) {
    (*sums)[0] += diff;
    (*sums)[1] += norm;
  }
  return norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

}  // namespace llmtrain::test
