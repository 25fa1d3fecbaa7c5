// Small string helpers shared by error messages.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace llmtrain {

/// Levenshtein distance (insert, delete, substitute each cost 1).
std::size_t edit_distance(std::string_view a, std::string_view b);

/// The candidate closest to `word` if it is a plausible typo of it (distance at most
/// max(2, |word| / 3)); empty when none is.
std::string closest_match(std::string_view word, const std::vector<std::string>& candidates);

/// `items` joined by `separator`, each wrapped in `quote`.
std::string join_quoted(const std::vector<std::string>& items, std::string_view separator,
                        std::string_view quote = "\"");

/// Bytes in human units: "1.50 GiB".
std::string format_bytes(double bytes);

}  // namespace llmtrain
