// tokenize's output as it is made: tokens appended to shard files in a private folder inside the
// output folder, split into train and val shards and moved into place only once every input has
// been read, so that a failed or interrupted run leaves no shard that looks complete.
#pragma once

#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <vector>

namespace llmtrain::data {

class ShardSpool {
 public:
  /// Creates `output_dir` (where missing) and a private folder in it. `wide`: uint32 tokens
  /// (shard version 2), else uint16 (version 1).
  ShardSpool(std::string output_dir, std::int64_t shard_tokens, bool wide);
  /// Unless finish() completed: removes the private folder, and the output folder if this spool
  /// created it and it is empty.
  ~ShardSpool();
  ShardSpool(const ShardSpool&) = delete;
  ShardSpool& operator=(const ShardSpool&) = delete;

  void append(std::span<const std::uint32_t> tokens);
  std::int64_t tokens() const { return total_; }

  /// The first `train_tokens` tokens become DIR/train_NNNNNN.bin, the rest DIR/val_NNNNNN.bin
  /// (shard_tokens each, the last shorter); shards of an earlier run in DIR are removed first.
  /// Returns the shards' paths, train first.
  std::vector<std::string> finish(std::int64_t train_tokens);

 private:
  void close_part();
  std::string part_path(std::size_t k) const;

  std::string dir_;
  std::string spool_;
  bool created_dir_ = false;
  bool finished_ = false;
  std::int64_t per_shard_;
  bool wide_;
  std::int64_t total_ = 0;
  std::size_t parts_ = 0;          // part files opened so far
  std::FILE* part_ = nullptr;      // the part being filled
  std::int64_t part_tokens_ = 0;   // tokens in it
  std::vector<char> buffer_;
};

}  // namespace llmtrain::data
