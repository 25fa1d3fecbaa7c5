// bfloat16 on the host: the upper 16 bits of an IEEE float. Conversions round to nearest, ties to
// even, as the GPU's __float2bfloat16 does, so the CPU reference rounds exactly like the kernels.
#pragma once

#include <cstdint>
#include <cstring>

namespace llmtrain {

inline float bf16_bits_to_float(std::uint16_t bits) {
  const std::uint32_t wide = std::uint32_t(bits) << 16;
  float x;
  std::memcpy(&x, &wide, sizeof x);
  return x;
}

inline std::uint16_t float_to_bf16_bits(float x) {
  std::uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7F800000u) == 0x7F800000u && (bits & 0x007FFFFFu) != 0) {
    return std::uint16_t((bits >> 16) | 0x0040u);  // NaN stays a (quiet) NaN
  }
  bits += 0x7FFFu + ((bits >> 16) & 1u);  // round to nearest even (infinities stay infinite)
  return std::uint16_t(bits >> 16);
}

}  // namespace llmtrain
