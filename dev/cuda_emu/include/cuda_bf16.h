// __nv_bfloat16 for the CPU emulation: storage as the upper 16 bits of a float, conversions from
// float rounding to nearest even (NaN stays a quiet NaN, overflow gives infinity), exact
// conversion to float, arithmetic through float. Trivially default-constructible and 2 bytes,
// as CUDA's, so arrays of it in structs (vector_io.cuh's Chunk) keep their layout.
#pragma once

#include <cstdint>
#include <cstring>

#include "cuda_runtime_api.h"

struct __nv_bfloat16 {
  unsigned short __x;
  __nv_bfloat16() = default;
  __nv_bfloat16(float f) : __x(from_float(f)) {}  // NOLINT: implicit, as CUDA's
  __nv_bfloat16(double f) : __x(from_float(float(f))) {}
  __nv_bfloat16(int i) : __x(from_float(float(i))) {}
  operator float() const {
    const std::uint32_t bits = std::uint32_t(__x) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  }
  static unsigned short from_float(float f) {
    std::uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<unsigned short>((bits >> 16) | 0x40u);  // NaN
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return static_cast<unsigned short>(bits >> 16);
  }
};
typedef __nv_bfloat16 nv_bfloat16;

struct alignas(4) __nv_bfloat162 {
  __nv_bfloat16 x, y;
};
typedef __nv_bfloat162 nv_bfloat162;

inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline float __bfloat162float(__nv_bfloat16 b) { return float(b); }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return {__nv_bfloat16(a), __nv_bfloat16(b)}; }
inline float2 __bfloat1622float2(__nv_bfloat162 v) { return {float(v.x), float(v.y)}; }
inline __nv_bfloat16 __hadd(__nv_bfloat16 a, __nv_bfloat16 b) { return __nv_bfloat16(float(a) + float(b)); }
inline __nv_bfloat16 __hmul(__nv_bfloat16 a, __nv_bfloat16 b) { return __nv_bfloat16(float(a) * float(b)); }
inline __nv_bfloat16 __hsub(__nv_bfloat16 a, __nv_bfloat16 b) { return __nv_bfloat16(float(a) - float(b)); }
inline __nv_bfloat16 __hfma(__nv_bfloat16 a, __nv_bfloat16 b, __nv_bfloat16 c) {
  return __nv_bfloat16(float(a) * float(b) + float(c));
}
