// The documents of tokenize's input files: plain text (one document a file) or JSON Lines (one a
// line), either of them gzip (.gz, through zlib) or Zstandard (.zst, through libzstd) compressed,
// read as a stream of blocks so that memory does not grow with the size of a file.
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace llmtrain::data {

enum class TextFormat { text, jsonl };

/// One input file (or standard input, path "-") read a block at a time. The file's name says its
/// format: `.gz` or `.zst` last, it is decompressed as it is read; then `.jsonl` last
/// (`data.jsonl.zst`) it is JSON Lines, else plain text (the whole file one document). Standard
/// input is uncompressed, in `stdin_format`, and named "<stdin>" in errors.
class TextReader {
 public:
  TextReader(const std::string& path, std::size_t block_bytes, TextFormat stdin_format = TextFormat::jsonl);
  ~TextReader();
  TextReader(const TextReader&) = delete;
  TextReader& operator=(const TextReader&) = delete;

  /// The name errors use: the path, or "<stdin>".
  const std::string& name() const { return name_; }
  TextFormat format() const { return format_; }

  /// The next block of about `block_bytes` (decompressed): whole lines for JSON Lines (a longer
  /// line is one block of its own), for plain text a piece of the document cut only right after a
  /// newline that follows and precedes a printable ASCII character, where GPT-2's pattern ends a
  /// piece whatever follows (so blocks encode independently to the tokens of the whole; a text
  /// with no such place is one block). `first_line` is the block's first line number. A plain
  /// text file gives at least one block (an empty file: one empty block). False at the end.
  /// InputError naming the file and the line reached for a compressed stream that is corrupt or
  /// ends early, and naming the library for a compression this build lacks.
  bool next(std::string& block, std::int64_t& first_line);

 private:
  struct Decoder;
  bool fill();  // appends decoded bytes to pending_; false at the end of the stream
  std::size_t read_raw(char* into, std::size_t n);

  std::string name_;
  TextFormat format_ = TextFormat::text;
  std::size_t block_bytes_;
  std::FILE* file_ = nullptr;
  bool owns_file_ = false;
  std::unique_ptr<Decoder> decoder_;
  std::string pending_;          // decoded; from head_ on not yet handed out
  std::size_t head_ = 0;
  std::int64_t lines_seen_ = 0;  // newlines decoded so far (pending_ included)
  std::int64_t next_line_ = 1;   // the line pending_ starts on
  bool ended_ = false;           // the stream has no more bytes
  bool gave_block_ = false;
};

/// Appends to `documents` the string field `jsonl_field` of each non-blank line of `text`,
/// whole lines of the JSON Lines file `path` starting at line `first_line`. InputError naming
/// the file and line for a line that is not a JSON object, holds bytes that are not UTF-8 or
/// lacks the field (or has a non-string there).
void json_documents(const std::string& path, std::string_view text, std::int64_t first_line,
                    const std::string& jsonl_field, std::vector<std::string>& documents);

/// Calls `each(object, where)` for each non-blank line of `text`, the contents of the JSON Lines
/// file `path` from line `first_line` on, in order, until `each` returns false; `where` is
/// "PATH:LINE" for its errors. A line's trailing '\r' is dropped; a line of nothing but spaces,
/// tabs and '\r' is blank. InputError naming the file and line for a line that is not valid
/// UTF-8, not JSON, or not a JSON object.
void for_each_json_line(const std::string& path, std::string_view text,
                        const std::function<bool(const nlohmann::json& object, const std::string& where)>& each,
                        std::int64_t first_line = 1);

/// Whether this build reads gzip (zlib) and Zstandard (libzstd) inputs.
bool reads_gzip();
bool reads_zstd();

}  // namespace llmtrain::data
