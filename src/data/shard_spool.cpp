#include "data/shard_spool.h"

#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "core/error.h"
#include "data/shard.h"

namespace llmtrain::data {
namespace {

namespace fs = std::filesystem;

std::string errno_text() { return std::strerror(errno); }

// train_NNNNNN.bin / val_NNNNNN.bin.
bool is_shard_name(const std::string& name) {
  return (name.starts_with("train_") || name.starts_with("val_")) && name.ends_with(".bin");
}

std::string shard_name(const char* split, std::size_t index) {
  char name[64];
  std::snprintf(name, sizeof name, "%s_%06zu.bin", split, index);
  return name;
}

void write_header(std::FILE* file, const std::string& path, bool wide, std::int64_t count) {
  std::int32_t header[256] = {};
  header[0] = shard_magic;
  header[1] = wide ? 2 : 1;
  header[2] = std::int32_t(count);
  if (std::fseek(file, 0, SEEK_SET) != 0 || std::fwrite(header, sizeof header, 1, file) != 1) {
    throw RuntimeError(path + ": cannot write: " + errno_text());
  }
}

void sync_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0 || ::fsync(fd) != 0) throw RuntimeError(path + ": cannot sync: " + errno_text());
  ::close(fd);
}

}  // namespace

ShardSpool::ShardSpool(std::string output_dir, std::int64_t shard_tokens, bool wide)
    : dir_(std::move(output_dir)), per_shard_(shard_tokens), wide_(wide) {
  created_dir_ = !fs::exists(dir_);
  fs::create_directories(dir_);
  std::string name = dir_ + "/.tokenize-XXXXXX";
  if (!::mkdtemp(name.data())) throw RuntimeError(dir_ + ": cannot create a folder for the shards being written: " + errno_text());
  spool_ = name;
  buffer_.resize(1 << 20);
}

ShardSpool::~ShardSpool() {
  if (part_) std::fclose(part_);
  if (finished_) return;
  std::error_code ignored;
  fs::remove_all(spool_, ignored);
  if (created_dir_) fs::remove(dir_, ignored);  // only when empty
}

std::string ShardSpool::part_path(std::size_t k) const { return spool_ + "/" + shard_name("part", k); }

void ShardSpool::close_part() {
  if (!part_) return;
  write_header(part_, part_path(parts_ - 1), wide_, part_tokens_);
  const bool failed = std::fclose(part_) != 0;
  part_ = nullptr;
  if (failed) throw RuntimeError(part_path(parts_ - 1) + ": cannot write: " + errno_text());
}

void ShardSpool::append(std::span<const std::uint32_t> tokens) {
  const std::size_t width = wide_ ? 4 : 2;
  while (!tokens.empty()) {
    if (!part_ || part_tokens_ == per_shard_) {
      close_part();
      const std::string path = part_path(parts_++);
      part_ = std::fopen(path.c_str(), "w+b");
      if (!part_) throw RuntimeError(path + ": cannot create: " + errno_text());
      std::setvbuf(part_, nullptr, _IOFBF, 1 << 20);
      write_header(part_, path, wide_, 0);
      part_tokens_ = 0;
    }
    const std::size_t n = std::min<std::size_t>({tokens.size(), std::size_t(per_shard_ - part_tokens_),
                                                 buffer_.size() / width});
    if (wide_) {
      std::memcpy(buffer_.data(), tokens.data(), n * 4);
    } else {
      auto* narrow = reinterpret_cast<std::uint16_t*>(buffer_.data());
      for (std::size_t i = 0; i < n; ++i) narrow[i] = std::uint16_t(tokens[i]);
    }
    if (std::fwrite(buffer_.data(), width, n, part_) != n) {
      throw RuntimeError(part_path(parts_ - 1) + ": cannot write: " + errno_text());
    }
    part_tokens_ += std::int64_t(n);
    total_ += std::int64_t(n);
    tokens = tokens.subspan(n);
  }
}

std::vector<std::string> ShardSpool::finish(std::int64_t train_tokens) {
  close_part();
  const std::size_t width = wide_ ? 4 : 2;
  const std::int64_t S = per_shard_;
  // Validation shards: tokens [train_tokens, total) copied out of the parts.
  std::vector<std::string> val_temp;
  for (std::int64_t first = train_tokens; first < total_; first += S) {
    const std::int64_t count = std::min(S, total_ - first);
    val_temp.push_back(spool_ + "/" + shard_name("val", val_temp.size()));
    std::FILE* out = std::fopen(val_temp.back().c_str(), "wb");
    if (!out) throw RuntimeError(val_temp.back() + ": cannot create: " + errno_text());
    write_header(out, val_temp.back(), wide_, count);
    for (std::int64_t at = first; at < first + count;) {
      const auto k = std::size_t(at / S);
      const std::int64_t n = std::min({first + count - at, (std::int64_t(k) + 1) * S - at,
                                       std::int64_t(buffer_.size() / width)});
      const int fd = ::open(part_path(k).c_str(), O_RDONLY | O_CLOEXEC);
      const auto bytes = std::size_t(n) * width;
      const bool read = fd >= 0 && ::pread(fd, buffer_.data(), bytes, off_t(shard_header_bytes + std::size_t(at - std::int64_t(k) * S) * width)) == ssize_t(bytes);
      if (fd >= 0) ::close(fd);
      if (!read || std::fwrite(buffer_.data(), 1, bytes, out) != bytes) {
        std::fclose(out);
        throw RuntimeError(val_temp.back() + ": cannot copy tokens from " + part_path(k) + ": " + errno_text());
      }
      at += n;
    }
    if (std::fclose(out) != 0) throw RuntimeError(val_temp.back() + ": cannot write: " + errno_text());
  }
  // Training shards: the parts before train_tokens, the last one cut there; the later ones go.
  const auto train_parts = std::size_t((train_tokens + S - 1) / S);
  for (std::size_t k = train_parts; k < parts_; ++k) fs::remove(part_path(k));
  if (train_tokens % S != 0) {
    const std::int64_t keep = train_tokens % S;
    const std::string last = part_path(train_parts - 1);
    std::FILE* file = std::fopen(last.c_str(), "r+b");
    if (!file) throw RuntimeError(last + ": cannot open: " + errno_text());
    write_header(file, last, wide_, keep);
    std::fclose(file);
    fs::resize_file(last, shard_header_bytes + std::size_t(keep) * width);
  }
  for (std::size_t k = 0; k < train_parts; ++k) sync_file(part_path(k));
  for (const auto& path : val_temp) sync_file(path);

  // Shards of an earlier run go (the caller has checked --force), then the new ones move in.
  for (const auto& entry : fs::directory_iterator(dir_)) {
    if (entry.is_regular_file() && is_shard_name(entry.path().filename().string())) fs::remove(entry.path());
  }
  std::vector<std::string> paths;
  for (std::size_t k = 0; k < train_parts; ++k) {
    paths.push_back(dir_ + "/" + shard_name("train", k));
    fs::rename(part_path(k), paths.back());
  }
  for (std::size_t j = 0; j < val_temp.size(); ++j) {
    paths.push_back(dir_ + "/" + shard_name("val", j));
    fs::rename(val_temp[j], paths.back());
  }
  finished_ = true;
  std::error_code ignored;
  fs::remove_all(spool_, ignored);
  if (const int fd = ::open(dir_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
  return paths;
}

}  // namespace llmtrain::data
