// Vectorisable float math and the thread grain of the CPU ops.
//
// std::exp is a call into libm that GCC does not vectorise without -ffast-math, so loops with an
// exp in them ran one element at a time. exp_vec is branch-free arithmetic on floats and their bits
// that the compiler turns into SIMD code inside `#pragma omp simd` loops (-O3, x86-64 baseline SSE2:
// 4 lanes). Accuracy: within 2 ulp of std::exp on [-80, 80] (tests/ops_vec_math_test.cpp).
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>

namespace llmtrain::cpu {

/// e^x for x in [-80, 80], clamped to that range: e^-80 ~ 1.8e-35, e^80 ~ 5.5e34. Inline so that
/// `#pragma omp simd` loops vectorise through it. The range keeps results and their reciprocals
/// (x / (1 + e^-x) in GELU and SiLU) clear of subnormal floats, which cost a microcode assist of
/// ~100 cycles per operation on x86: with a clamp at 88.3, GELU forward took 2x longer than with
/// scalar std::exp, computing x / e^88.3 in the discarded lanes of its clamped branch.
inline float exp_vec(float x) {
  x = std::min(std::max(x, -80.0f), 80.0f);
  // x = n ln2 + r, |r| <= ln2/2; n rounded to nearest by the 1.5 * 2^23 trick (no rint call).
  constexpr float log2e = 1.44269504088896341f, round_magic = 12582912.0f;
  const float shifted = x * log2e + round_magic;
  const float n = shifted - round_magic;
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // ln2 in two parts, Cody-Waite
  // e^r on [-ln2/2, ln2/2]: the degree-6 minimax polynomial (relative error ~1e-7).
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  // 2^n from its exponent bits: the low bits of `shifted` hold n (two's complement).
  const std::int32_t n_int = std::bit_cast<std::int32_t>(shifted) - std::bit_cast<std::int32_t>(round_magic);
  return p * std::bit_cast<float>((n_int + 127) << 23);
}

/// Work below this many elementary operations (a multiply-add, an exp counted as ~10) runs on the
/// calling thread: an OpenMP region costs a few microseconds to open and close on an idle machine,
/// and up to a scheduler time slice (milliseconds) when another process has taken one of the
/// cores and the region must wait for its descheduled thread. 32768 is at::parallel_for's grain
/// (PyTorch); a decoding step's ops (one row) all fall below it.
inline constexpr std::int64_t parallel_grain = 32768;

/// Whether work of `ops` elementary operations is worth an OpenMP region (for `if(...)` clauses).
inline bool worth_threads(std::int64_t ops) { return ops > parallel_grain; }

}  // namespace llmtrain::cpu
