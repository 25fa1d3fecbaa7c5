// Token shard files in llm.c's format, memory-mapped.
//
// Layout: a header of 256 little-endian int32 ([0] magic 20240520, [1] version, [2] token count),
// then the tokens: uint16 for version 1, uint32 for version 2 (vocabularies over 65,536).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace llmtrain::data {

inline constexpr std::int32_t shard_magic = 20240520;
inline constexpr std::size_t shard_header_bytes = 256 * sizeof(std::int32_t);

/// A read-only, memory-mapped shard; the header is validated on open (InputError naming the file
/// and byte offset on any violation).
class ShardFile {
 public:
  explicit ShardFile(const std::string& path);
  ~ShardFile();
  ShardFile(ShardFile&& other) noexcept;
  ShardFile& operator=(ShardFile&&) = delete;
  ShardFile(const ShardFile&) = delete;
  ShardFile& operator=(const ShardFile&) = delete;

  const std::string& path() const { return path_; }
  std::int64_t num_tokens() const { return num_tokens_; }
  int version() const { return version_; }
  std::size_t token_bytes() const { return version_ == 1 ? 2 : 4; }

  /// Copies tokens [start, start + count) into `out` as uint32, checking each is below
  /// `vocab_size` (InputError naming the file and byte offset of the first that is not).
  void read_tokens(std::int64_t start, std::int64_t count, std::uint32_t vocab_size, std::int32_t* out) const;

 private:
  std::string path_;
  const unsigned char* map_ = nullptr;
  std::size_t map_bytes_ = 0;
  std::int64_t num_tokens_ = 0;
  int version_ = 1;
};

/// Writes `tokens` as a shard at `path` (version 1 when every id fits in uint16 and
/// `force_u32` is false, else 2). Written to a temporary name, flushed and renamed into place.
void write_shard(const std::string& path, std::span<const std::uint32_t> tokens, bool force_u32 = false);

/// Expands shell globs (sorted within each pattern, patterns in the order given). A pattern that
/// matches nothing is an InputError naming `key` (the config key path it came from).
std::vector<std::string> expand_paths(const std::vector<std::string>& patterns, const std::string& key);

}  // namespace llmtrain::data
