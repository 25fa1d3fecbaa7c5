// Small, fast, reproducible random numbers (the same on every platform and compiler).
#pragma once

#include <cmath>
#include <cstdint>

namespace llmtrain {

/// SplitMix64 (Steele, Lea, Flood 2014): advances `state` and returns 64 well-mixed bits.
inline std::uint64_t splitmix64(std::uint64_t& state) {
  std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/// A value in [0, n) from 64 random bits, by multiply-shift (bias below n / 2^64).
inline std::uint64_t bounded(std::uint64_t bits, std::uint64_t n) {
  __extension__ using u128 = unsigned __int128;  // GCC and Clang; __extension__ quiets -Wpedantic
  return static_cast<std::uint64_t>((static_cast<u128>(bits) * n) >> 64);
}

/// A standard normal value that depends only on (seed, index): Box-Muller over two SplitMix64
/// draws. Counter-based, so any element of a tensor can be drawn alone, on any device.
inline float normal_at(std::uint64_t seed, std::uint64_t index) {
  std::uint64_t state = seed ^ (index * 0xD1B54A32D192ED03ull);
  const double u1 = double((splitmix64(state) >> 11) + 1) * 0x1.0p-53;  // (0, 1]
  const double u2 = double(splitmix64(state) >> 11) * 0x1.0p-53;        // [0, 1)
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
}

}  // namespace llmtrain
