// Python's str rules that lm-evaluation-harness's text handling relies on, over UTF-8: strip and
// rstrip (Unicode white space), len (code points), capitalize (title case of the first character,
// lower case of the rest), and its HellaSwag preprocessing.
//
// Case mapping follows Python 3.11 (Unicode 14.0) for U+0000..U+02AF (ASCII, Latin-1, Latin
// Extended-A and -B, IPA Extensions) and U+1E00..U+1EFF (Latin Extended Additional), full
// mappings included ("ß" capitalizes to "Ss", "İ" lowercases to "i" + U+0307). Characters of other
// blocks (Greek, Cyrillic, Armenian, fullwidth Latin, letterlike symbols such as U+212A, ...)
// are left as they are, so Greek's final-sigma rule is not applied either.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace llmtrain::eval {

/// Python's len(): the code points of valid UTF-8 (each invalid byte counts as one).
std::int64_t code_points(std::string_view text);

/// Python's str.strip(): `text` without the white space (str.isspace) at either end.
std::string_view python_strip(std::string_view text);

/// The bytes of white space (str.isspace) at the end of `text`: len(s) - len(s.rstrip()) in bytes.
std::size_t trailing_space_bytes(std::string_view text);

/// Python's str.capitalize() (see above for the characters covered).
std::string python_capitalize(std::string_view text);

/// lm-evaluation-harness's HellaSwag preprocess(): strip, " [title]" -> ". ", every other
/// bracketed tag removed (regex \[.*?\], which stops at a line end), then "  " -> " " (one pass).
std::string hellaswag_preprocess(std::string_view text);

}  // namespace llmtrain::eval
