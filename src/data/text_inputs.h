// The documents of tokenize's input files: plain text (one document a file) or JSON Lines (one a
// line), either of them gzip (.gz, through zlib) or Zstandard (.zst, through libzstd) compressed.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace llmtrain::data {

/// The documents of one input file. Its name says its format: `.gz` or `.zst` last, the file is
/// decompressed first; then `.jsonl` last (`data.jsonl.zst`), each non-blank line is a JSON
/// object whose string field `jsonl_field` is one document; else the whole (decompressed) file
/// is one document. InputError naming the file and line for a line that is not a JSON object,
/// holds bytes that are not UTF-8 or lacks the field (or has a non-string there), and for a
/// compressed stream that is corrupt or ends early; naming the library for a compression this
/// build lacks.
std::vector<std::string> read_documents(const std::string& path, const std::string& jsonl_field);

/// Every input's documents, in the order of `paths` and then of their lines, each file read and
/// decompressed on one of `threads` threads (at least 1). The error of the first bad file (in
/// the order of `paths`) is the one thrown, whatever thread met it first.
std::vector<std::string> read_all_documents(const std::vector<std::string>& paths, const std::string& jsonl_field,
                                            int threads);

/// Calls `each(object, where)` for each non-blank line of `text`, the contents of the JSON Lines
/// file `path`, in order, until `each` returns false; `where` is "PATH:LINE" for its errors. A
/// line's trailing '\r' is dropped; a line of nothing but spaces, tabs and '\r' is blank.
/// InputError naming the file and line for a line that is not valid UTF-8, not JSON, or not a
/// JSON object.
void for_each_json_line(const std::string& path, std::string_view text,
                        const std::function<bool(const nlohmann::json& object, const std::string& where)>& each);

/// Whether this build reads gzip (zlib) and Zstandard (libzstd) inputs.
bool reads_gzip();
bool reads_zstd();

}  // namespace llmtrain::data
