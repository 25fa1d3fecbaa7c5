// Comparing a CUDA op with its CPU reference, in the manner of ggml's test-backend-ops: device
// copies of host arrays framed by sentinel elements that must survive (out-of-bounds writes),
// an explicit NaN/Inf check, errors normalised by the reference's magnitude, and a check that
// the result is not trivially zero or unchanged. Uses only the public ops API (no CUDA headers),
// so any test may include it. bf16 arrays are Bf16 on the host (the 16 bits, no arithmetic), made
// with the round-to-nearest-even helper below, and compared after widening to float.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

#include "catch_compat.h"
#include "core/tensor.h"
#include "ops/buffer.h"

namespace llmtrain::test {

/// A bfloat16 as the host holds it: the upper 16 bits of an IEEE float.
struct Bf16 {
  std::uint16_t bits;
};

/// float -> bf16, rounded to nearest, ties to even (as __float2bfloat16_rn): infinities stay,
/// finite values beyond the largest bf16 become infinities, NaN stays a (quiet) NaN.
inline Bf16 to_bf16(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return Bf16{std::uint16_t((u >> 16) | 0x0040u)};  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // a carry out of the mantissa bumps the exponent: exact RNE
  return Bf16{std::uint16_t(u >> 16)};
}

/// bf16 -> float, exact.
inline float to_float(Bf16 x) {
  const std::uint32_t u = std::uint32_t(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline std::vector<Bf16> to_bf16(const std::vector<float>& v) {
  std::vector<Bf16> r(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) r[i] = to_bf16(v[i]);
  return r;
}
inline std::vector<float> to_float(const std::vector<Bf16>& v) {
  std::vector<float> r(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) r[i] = to_float(v[i]);
  return r;
}
/// Every element rounded to bf16, as float: the exact values a bf16 kernel reads, to feed the
/// fp32 CPU reference.
inline std::vector<float> round_bf16(const std::vector<float>& v) {
  return to_float(to_bf16(v));
}

template <class T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<float>() {
  return DType::f32;
}
template <>
constexpr DType dtype_of<std::int32_t>() {
  return DType::i32;
}
template <>
constexpr DType dtype_of<Bf16>() {
  return DType::bf16;
}

/// The sentinel bit pattern: a signalling NaN with a payload for floats and bf16 (so "still NaN"
/// is not enough: the bits must be unchanged; and arithmetic on it gives a quiet NaN, other bits,
/// so a value computed from a neighbouring sentinel and written out of bounds shows too: with a
/// quiet NaN, x86's add would pass its payload on unchanged), an unlikely value for integers.
template <class T>
T sentinel() {
  static_assert(sizeof(T) == 4 || sizeof(T) == 2, "4- or 2-byte elements only");
  T value;
  if constexpr (sizeof(T) == 4) {
    const std::uint32_t bits = 0x7fa0dead;  // exponent all ones, quiet bit (0x00400000) clear
    std::memcpy(&value, &bits, sizeof value);
  } else {
    const std::uint16_t bits = 0x7fad;  // bf16: exponent all ones, mantissa 0x2d, quiet bit (0x40) clear
    std::memcpy(&value, &bits, sizeof value);
  }
  return value;
}

/// A copy of a host array in device memory, after `offset` leading sentinels (offset 1 makes the
/// view one element, 4 bytes (2 for Bf16), off 16-byte alignment: the kernels' scalar paths) and
/// before `trailing_guard` trailing ones.
template <class T>
class DeviceArray {
 public:
  static constexpr std::size_t trailing_guard = 8;

  explicit DeviceArray(const std::vector<T>& host, std::size_t offset = 0)
      : n_(host.size()),
        offset_(offset),
        buffer_(Device::cuda, (offset + host.size() + trailing_guard) * sizeof(T)) {
    std::vector<T> framed(offset_ + n_ + trailing_guard, sentinel<T>());
    std::copy(host.begin(), host.end(), framed.begin() + std::ptrdiff_t(offset_));
    ops::copy(whole(), Tensor(framed.data(), dtype_of<T>(), Device::cpu, {std::int64_t(framed.size())}));
  }

  /// The data (without the sentinels) as a device tensor of this shape.
  Tensor tensor(std::initializer_list<std::int64_t> shape) const {
    const Tensor t(data(), dtype_of<T>(), Device::cuda, shape);
    REQUIRE(std::size_t(t.numel()) == n_);
    return t;
  }
  T* data() const { return static_cast<T*>(buffer_.data()) + offset_; }

  /// The data, copied back.
  std::vector<T> to_host() const {
    const std::vector<T> framed = framed_to_host();
    return std::vector<T>(framed.begin() + std::ptrdiff_t(offset_),
                          framed.begin() + std::ptrdiff_t(offset_ + n_));
  }

  /// True when every sentinel before and after the data still has its bits.
  bool guards_intact() const {
    const std::vector<T> framed = framed_to_host();
    const T expected = sentinel<T>();
    for (std::size_t i = 0; i < framed.size(); ++i) {
      if (i >= offset_ && i < offset_ + n_) continue;
      if (std::memcmp(&framed[i], &expected, sizeof(T)) != 0) return false;
    }
    return true;
  }

 private:
  Tensor whole() const {
    return Tensor(buffer_.data(), dtype_of<T>(), Device::cuda, {std::int64_t(offset_ + n_ + trailing_guard)});
  }
  std::vector<T> framed_to_host() const {
    std::vector<T> framed(offset_ + n_ + trailing_guard);
    ops::copy(Tensor(framed.data(), dtype_of<T>(), Device::cpu, {std::int64_t(framed.size())}), whole());
    return framed;
  }

  std::size_t n_, offset_;
  ops::Buffer buffer_;
};

/// Uniform random floats in [lo, hi) (faster than normals for the large test arrays).
inline std::vector<float> uniform_vec(std::mt19937& rng, std::size_t n, float lo = -1.0f, float hi = 1.0f) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

/// max |result - reference| / max |reference|, with the reference's magnitude floored at
/// `scale_floor` (a quantity whose error does not shrink with it, such as a loss near 0) and 1e-30.
inline double normalized_error(const std::vector<float>& result, const std::vector<float>& reference,
                               double scale_floor = 0.0) {
  double max_diff = 0.0, max_ref = 0.0;
  for (std::size_t i = 0; i < reference.size(); ++i) {
    max_diff = std::max(max_diff, std::abs(double(result[i]) - double(reference[i])));
    max_ref = std::max(max_ref, std::abs(double(reference[i])));
  }
  return max_diff / std::max({max_ref, scale_floor, 1e-30});
}

/// A tensor's f32 values on the host, from any device.
inline std::vector<float> to_host(const Tensor& t) {
  std::vector<float> out(std::size_t(t.numel()));
  ops::copy(Tensor(out.data(), DType::f32, Device::cpu, {t.numel()}), t.reshape({t.numel()}));
  return out;
}

/// sqrt(sum (a - b)^2 / sum b^2) over n values (the reference b's norm floored at 1e-30), and
/// *finite false if any value of `a` is not finite.
inline double relative_error(const float* a, const float* b, std::int64_t n, bool* finite) {
  double diff = 0.0, norm = 0.0;
  *finite = true;
  for (std::int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(a[i])) *finite = false;
    diff += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    norm += double(b[i]) * b[i];
  }
  return std::sqrt(diff / std::max(norm, 1e-30));
}
inline double relative_error(const std::vector<float>& a, const std::vector<float>& b, bool* finite) {
  return relative_error(a.data(), b.data(), std::int64_t(a.size()), finite);
}

/// Requires `result` (from the device) to be finite, the reference finite and not all zero, and
/// their normalised error (above) at most `tolerance`.
inline void require_close(const std::string& what, const std::vector<float>& result,
                          const std::vector<float>& reference, double tolerance, double scale_floor = 0.0) {
  REQUIRE(result.size() == reference.size());
  std::size_t bad_result = 0, bad_reference = 0, first_bad = result.size();
  double max_ref = 0.0;
  for (std::size_t i = 0; i < result.size(); ++i) {
    if (!std::isfinite(result[i]) && bad_result++ == 0) first_bad = i;
    if (!std::isfinite(reference[i])) ++bad_reference;
    max_ref = std::max(max_ref, std::abs(double(reference[i])));
  }
  const double error = normalized_error(result, reference, scale_floor);
  INFO(what << ": " << result.size() << " elements, " << bad_result << " NaN/Inf from the device (first at "
            << first_bad << "), normalised error " << error << " (tolerance " << tolerance
            << "), max |reference| " << max_ref);
  REQUIRE(bad_reference == 0);
  REQUIRE(bad_result == 0);
  REQUIRE(max_ref > 0.0);  // not trivially zero
  REQUIRE(error <= tolerance);
}

/// Requires the op to have changed `after` from `before` somewhere (an accumulating op that
/// added nothing would pass require_close against a reference that also added nothing).
inline void require_changed(const std::string& what, const std::vector<float>& after,
                            const std::vector<float>& before) {
  bool changed = false;
  for (std::size_t i = 0; i < after.size() && !changed; ++i) changed = after[i] != before[i];
  INFO(what << " was not changed by the op");
  REQUIRE(changed);
}

/// Requires every sentinel around the device array to be intact.
template <class T>
void require_guards(const std::string& what, const DeviceArray<T>& array) {
  INFO(what << ": a sentinel before or after the array was overwritten");
  REQUIRE(array.guards_intact());
}

}  // namespace llmtrain::test
