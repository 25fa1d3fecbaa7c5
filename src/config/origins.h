// Where each config value came from (the file, or the --set that gave it), and the errors that
// name it: shared by the reader (config/reader.cpp) and the rules (config/rules.cpp).
#pragma once

#include <cstddef>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"

namespace llmtrain::config {

// Where each value came from, so that an error can say "(in FILE)" or "(from --set K=V)".
struct Origins {
  std::string file;
  std::vector<std::pair<std::string, std::string>> sets;  // (key path, the --set text)

  std::string of(const std::string& path) const {
    const auto covers = [](const std::string& outer, const std::string& inner) {
      return inner == outer || inner.starts_with(outer + ".");
    };
    for (auto it = sets.rbegin(); it != sets.rend(); ++it) {
      if (covers(it->first, path) || covers(path, it->first)) return "from --set " + it->second;
    }
    return "in " + file;
  }
};

// A key path as an error shows it: a hostile file's key may be any length.
inline std::string shown_key(const std::string& path, std::size_t limit = 120) {
  return path.size() <= limit ? path : path.substr(0, limit - 3) + "...";
}

[[noreturn]] inline void fail(const Origins& origins, const std::string& path, const std::string& what) {
  throw InputError(shown_key(path) + ": " + what + " (" + shown_key(origins.of(path), 400) + ")");
}

// A rule between two keys: blamed on `path`, but a --set of `other` is named when it gave `other`.
[[noreturn]] inline void fail_rule(const Origins& origins, const std::string& path, const std::string& other,
                            const std::string& what) {
  const std::string from_other = origins.of(other);
  const std::string where = shown_key(from_other.starts_with("from --set") ? from_other : origins.of(path), 400);
  throw InputError(shown_key(path) + ": " + what + " (" + where + ")");
}

/// A number as config messages show it.
inline std::string format_number(double x) {
  std::ostringstream out;
  out << x;
  return out.str();
}

}  // namespace llmtrain::config
