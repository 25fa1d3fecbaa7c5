// Range checks for command-line options. Each error names the option and the range in plain
// numbers, as CLI11 prefixes the option's name: "--batches: expected an integer >= 1, got 0".
// (CLI11's own Range prints its bounds with %f: "Value 0 not in range 0.000000 to 1797693...")
#pragma once

#include <charconv>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include <CLI/CLI.hpp>

#include "core/strings.h"

namespace llmtrain::cli {

namespace detail {
// The value as typed, for the message: short, and safe to print whatever bytes it holds.
inline std::string typed(const std::string& text) {
  return text.size() > 40 ? escape_text(text.substr(0, 37)) + "..." : escape_text(text);
}
}  // namespace detail

/// An integer option of type T in [lo, hi]; without hi, any value T holds from lo up, and the
/// message says "an integer >= LO" (the type's bound is spelled out only to a value past it).
template <typename T>
CLI::Validator integer_in(std::int64_t lo, std::int64_t hi = std::int64_t(std::numeric_limits<T>::max())) {
  const bool open = hi == std::int64_t(std::numeric_limits<T>::max());
  const auto range = [lo, hi](bool open_above) {
    return open_above ? "an integer >= " + std::to_string(lo)
                      : "an integer from " + std::to_string(lo) + " to " + std::to_string(hi);
  };
  return CLI::Validator(
      [lo, hi, open, range](std::string& text) -> std::string {
        std::int64_t v = 0;
        const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), v);
        const bool parsed = end == text.data() + text.size();
        if (error == std::errc() && parsed && v >= lo && v <= hi) return "";
        const bool too_large = parsed && (error == std::errc::result_out_of_range || v > hi);
        return "expected " + range(open && !too_large) + ", got " + detail::typed(text);
      },
      range(open), "INTEGER RANGE");
}

/// A finite number option of type T in [lo, hi] (without hi: lo up, "a number >= LO"); `above`:
/// lo itself excluded ("a number > 0").
template <typename T>
CLI::Validator number_in(double lo, double hi = double(std::numeric_limits<T>::max()), bool above = false) {
  const std::string range = hi == double(std::numeric_limits<T>::max())
                                ? std::string("a number ") + (above ? "> " : ">= ") + number_text(lo)
                                : "a number from " + number_text(lo) + " to " + number_text(hi);
  return CLI::Validator(
      [lo, hi, above, range](std::string& text) -> std::string {
        double v = 0.0;
        const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), v);
        const bool ok = error == std::errc() && end == text.data() + text.size() && std::isfinite(v) &&
                        (above ? v > lo : v >= lo) && v <= hi;
        return ok ? "" : "expected " + range + ", got " + detail::typed(text);
      },
      range, "NUMBER RANGE");
}

}  // namespace llmtrain::cli
