// Reading JSON from files and users (tokenizer files, checkpoint state, safetensors headers,
// configs), with errors that name the file, a bound on nesting, and bounded excerpts of values.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/files.h"
#include "core/strings.h"

namespace llmtrain {

/// The deepest nesting of arrays and objects accepted anywhere llmtrain reads JSON. Real files
/// need a handful of levels; the bound keeps every later walk of a value (printing, comparing)
/// far from the stack's end.
constexpr int max_json_depth = 64;

/// For a parser callback: InputError "WHERE: JSON nested deeper than 64 levels" when an object
/// or array starts at `depth` (0 for the top level) beyond the bound.
inline void check_json_depth(int depth, nlohmann::json::parse_event_t event, const std::string& where) {
  using E = nlohmann::json::parse_event_t;
  if ((event == E::object_start || event == E::array_start) && depth >= max_json_depth) {
    throw InputError(where + ": JSON nested deeper than " + std::to_string(max_json_depth) +
                     " levels (the most accepted)");
  }
}

namespace detail {
inline void append_excerpt(const nlohmann::json& v, std::string& out, std::size_t limit) {
  if (out.size() > limit) return;
  if (v.is_string()) {
    const std::string& s = v.get_ref<const std::string&>();
    out += '"';
    out += escape_text(std::string_view(s).substr(0, limit + 1 - std::min(limit, out.size())));
    out += '"';
  } else if (v.is_object()) {
    out += '{';
    bool first = true;
    for (auto it = v.begin(); it != v.end() && out.size() <= limit; ++it) {
      if (!first) out += ',';
      first = false;
      out += '"' + escape_text(std::string_view(it.key()).substr(0, limit)) + "\":";
      append_excerpt(it.value(), out, limit);
    }
    out += '}';
  } else if (v.is_array()) {
    out += '[';
    bool first = true;
    for (auto it = v.begin(); it != v.end() && out.size() <= limit; ++it) {
      if (!first) out += ',';
      first = false;
      append_excerpt(*it, out, limit);
    }
    out += ']';
  } else {
    out += v.dump();  // a number, true, false or null: short, never throws
  }
}
}  // namespace detail

/// A value for an error message: compact JSON (as dump() writes it) of at most about `limit` characters ("..." when
/// cut), bytes that are not UTF-8 shown as \xNN, never walking deeper than the text it prints.
inline std::string json_excerpt(const nlohmann::json& value, std::size_t limit = 60) {
  std::string out;
  detail::append_excerpt(value, out, limit);
  if (out.size() > limit) out = out.substr(0, limit - 3) + "...";
  return out;
}

/// Parses `text`, bounding the nesting; InputError "WHERE: not valid JSON: ..." on a syntax error.
inline nlohmann::json parse_json_text(std::string_view text, const std::string& where) {
  const nlohmann::json::parser_callback_t guard = [&](int depth, nlohmann::json::parse_event_t event,
                                                      nlohmann::json&) {
    check_json_depth(depth, event, where);
    return true;
  };
  try {
    return nlohmann::json::parse(text.begin(), text.end(), guard);
  } catch (const nlohmann::json::exception& e) {
    throw InputError(where + ": not valid JSON: " + e.what());
  }
}

/// Parses the JSON file at `path` (a regular file of at most 1 GiB); InputError "PATH: cannot
/// open (expected `what`)", "PATH: is a directory ...", or "PATH: not valid JSON: ...".
inline nlohmann::json read_json_file(const std::string& path, const std::string& what) {
  return parse_json_text(read_regular_file(path, what, std::uint64_t(1) << 30), path);
}

// ---------------------------------------------------------------------------------------------
// Typed reads of values from files the user gives (a Hugging Face config.json, tokenizer.json,
// a checkpoint's state.json). Each checks the type and the range before the value is used, and
// every error is one line naming the file and the key: "WHERE: expected ..., got VALUE". WHERE
// is the file and the key's path, as "DIR/state.json: sampler.epoch".

/// `v` as an integer in [lo, hi]; InputError "WHERE: expected an integer from LO to HI, got V".
/// A number with a fraction, a string ("1"), a boolean or null is refused, never converted.
inline std::int64_t json_integer(const nlohmann::json& v, const std::string& where, std::int64_t lo, std::int64_t hi) {
  bool in_range = false;
  if (v.is_number_unsigned()) {  // (2^63 and above too: compared before any conversion)
    const std::uint64_t u = v.get<std::uint64_t>();
    in_range = hi >= 0 && u <= std::uint64_t(hi) && std::int64_t(u) >= lo;
  } else if (v.is_number_integer()) {
    const std::int64_t i = v.get<std::int64_t>();
    in_range = i >= lo && i <= hi;
  }
  if (!in_range) {
    throw InputError(where + ": expected an integer from " + std::to_string(lo) + " to " + std::to_string(hi) +
                     ", got " + json_excerpt(v));
  }
  return v.get<std::int64_t>();
}

/// `v` as a finite number in [lo, hi]; InputError "WHERE: expected a number from LO to HI, got V"
/// ("a number >= LO" without an upper bound: hi the largest double).
inline double json_number(const nlohmann::json& v, const std::string& where, double lo,
                          double hi = std::numeric_limits<double>::max()) {
  const bool in_range = v.is_number() && std::isfinite(v.get<double>()) && v.get<double>() >= lo && v.get<double>() <= hi;
  if (!in_range) {
    const std::string range = hi == std::numeric_limits<double>::max()
                                  ? ">= " + number_text(lo)
                                  : "from " + number_text(lo) + " to " + number_text(hi);
    throw InputError(where + ": expected a number " + range + ", got " + json_excerpt(v));
  }
  return v.get<double>();
}

/// `v` as true or false (not 0, 1 or "true"); InputError "WHERE: expected true or false, got V".
inline bool json_boolean(const nlohmann::json& v, const std::string& where) {
  if (!v.is_boolean()) throw InputError(where + ": expected true or false, got " + json_excerpt(v));
  return v.get<bool>();
}

/// `object[key]`, which must be there; InputError "WHERE: KEY: missing (expected WHAT)" when not,
/// "WHERE: expected an object, got V" when `object` is not one.
inline const nlohmann::json& json_key(const nlohmann::json& object, const std::string& key, const std::string& where,
                                      const std::string& expected) {
  if (!object.is_object()) throw InputError(where + ": expected an object, got " + json_excerpt(object));
  const auto it = object.find(key);
  if (it == object.end()) throw InputError(where + ": " + key + ": missing (expected " + expected + ")");
  return *it;
}

/// `object[key]` when there and not null (a null stands for a value left unset, as transformers
/// writes "head_dim": null); otherwise nullopt. InputError when `object` is not an object.
inline std::optional<std::reference_wrapper<const nlohmann::json>> json_optional_key(const nlohmann::json& object,
                                                                                   const std::string& key,
                                                                                   const std::string& where) {
  if (!object.is_object()) throw InputError(where + ": expected an object, got " + json_excerpt(object));
  const auto it = object.find(key);
  if (it == object.end() || it->is_null()) return std::nullopt;
  return std::cref(*it);
}

}  // namespace llmtrain
