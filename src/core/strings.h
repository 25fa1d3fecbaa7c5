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

/// `text` safe to print on one line: valid UTF-8 kept, other bytes and control characters shown
/// as \xNN (a backslash doubled), so that user text in a message is never raw binary.
std::string escape_text(std::string_view text);

/// Whether `text` is valid UTF-8; when not and `bad_byte` is given, the offset of the first bad byte.
bool is_valid_utf8(std::string_view text, std::size_t* bad_byte = nullptr);

/// Bytes in human units: "1.50 GiB".
std::string format_bytes(double bytes);

/// A number as a person reads it: the shortest text that reads back to the same double ("0.001",
/// "1e-05", "4096", "1.7976931348623157e+308").
std::string number_text(double x);

}  // namespace llmtrain
