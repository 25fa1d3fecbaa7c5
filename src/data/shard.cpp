#include "data/shard.h"

#include <fcntl.h>
#include <glob.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <utility>

#include "core/error.h"
#include "core/files.h"

static_assert(std::endian::native == std::endian::little, "shard files are read in place: little-endian only");

namespace llmtrain::data {
namespace {

[[noreturn]] void bad_shard(const std::string& path, std::size_t offset, const std::string& what) {
  throw InputError(path + ": byte " + std::to_string(offset) + ": " + what);
}

}  // namespace

ShardFile::ShardFile(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);  // a FIFO must not block
  if (fd < 0) throw InputError(path + ": cannot open shard: " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    throw InputError(path + ": cannot stat shard: " + std::strerror(errno));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw InputError(path + ": not a regular file (expected a token shard)");
  }
  map_bytes_ = static_cast<std::size_t>(st.st_size);
  if (map_bytes_ < shard_header_bytes) {
    ::close(fd);
    bad_shard(path, map_bytes_, "file ends inside the 1024-byte header (" + std::to_string(map_bytes_) + " bytes)");
  }
  void* map = ::mmap(nullptr, map_bytes_, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (map == MAP_FAILED) throw InputError(path + ": cannot map shard: " + std::strerror(errno));
  map_ = static_cast<const unsigned char*>(map);
  ::madvise(map, map_bytes_, MADV_WILLNEED);

  std::int32_t header[3];
  std::memcpy(header, map_, sizeof header);
  try {
    if (header[0] != shard_magic) {
      bad_shard(path, 0, "bad magic " + std::to_string(header[0]) + ", expected " + std::to_string(shard_magic) +
                             " (not a token shard)");
    }
    if (header[1] != 1 && header[1] != 2) {
      bad_shard(path, 4, "unsupported version " + std::to_string(header[1]) + ", expected 1 (uint16) or 2 (uint32)");
    }
    version_ = header[1];
    if (header[2] < 0) bad_shard(path, 8, "negative token count " + std::to_string(header[2]));
    num_tokens_ = header[2];
    const std::size_t expected = shard_header_bytes + std::size_t(num_tokens_) * token_bytes();
    if (expected != map_bytes_) {
      bad_shard(path, 8, "header says " + std::to_string(num_tokens_) + " tokens (" + std::to_string(expected) +
                             " bytes) but the file has " + std::to_string(map_bytes_) + " bytes");
    }
  } catch (...) {
    ::munmap(const_cast<unsigned char*>(map_), map_bytes_);
    throw;
  }
}

ShardFile::~ShardFile() {
  if (map_) ::munmap(const_cast<unsigned char*>(map_), map_bytes_);
}

ShardFile::ShardFile(ShardFile&& other) noexcept
    : path_(std::move(other.path_)),
      map_(std::exchange(other.map_, nullptr)),
      map_bytes_(other.map_bytes_),
      num_tokens_(other.num_tokens_),
      version_(other.version_) {}

void ShardFile::read_tokens(std::int64_t start, std::int64_t count, std::uint32_t vocab_size,
                            std::int32_t* out) const {
  if (start < 0 || count < 0 || start + count > num_tokens_) {
    throw RuntimeError(path_ + ": token range [" + std::to_string(start) + ", " + std::to_string(start + count) +
                       ") outside the shard's " + std::to_string(num_tokens_) + " tokens");
  }
  const unsigned char* base = map_ + shard_header_bytes + std::size_t(start) * token_bytes();
  for (std::int64_t i = 0; i < count; ++i) {
    std::uint32_t token;
    if (version_ == 1) {
      std::uint16_t t16;
      std::memcpy(&t16, base + 2 * i, 2);
      token = t16;
    } else {
      std::memcpy(&token, base + 4 * i, 4);
    }
    if (token >= vocab_size) {
      bad_shard(path_, shard_header_bytes + std::size_t(start + i) * token_bytes(),
                "token " + std::to_string(token) + " is not below model.vocab_size (" + std::to_string(vocab_size) + ")");
    }
    out[i] = static_cast<std::int32_t>(token);
  }
}

void write_shard(const std::string& path, std::span<const std::uint32_t> tokens, bool force_u32) {
  if (tokens.size() > std::size_t(std::numeric_limits<std::int32_t>::max())) {
    throw RuntimeError(path + ": " + std::to_string(tokens.size()) + " tokens do not fit in one shard's header");
  }
  const bool wide = force_u32 || std::any_of(tokens.begin(), tokens.end(), [](std::uint32_t t) { return t > 0xFFFF; });
  std::int32_t header[256] = {};
  header[0] = shard_magic;
  header[1] = wide ? 2 : 1;
  header[2] = static_cast<std::int32_t>(tokens.size());

  AtomicFile file(path);
  file.write(header, sizeof header);
  if (wide) {
    file.write(tokens.data(), tokens.size() * 4);
  } else {
    const std::vector<std::uint16_t> narrow(tokens.begin(), tokens.end());
    file.write(narrow.data(), narrow.size() * 2);
  }
  file.commit();
}

std::vector<std::string> expand_paths(const std::vector<std::string>& patterns, const std::string& key) {
  std::vector<std::string> paths;
  for (const auto& pattern : patterns) {
    glob_t matches{};
    const int status = ::glob(pattern.c_str(), GLOB_NOSORT, nullptr, &matches);
    std::vector<std::string> found(matches.gl_pathv, matches.gl_pathv + (status == 0 ? matches.gl_pathc : 0));
    ::globfree(&matches);
    if (found.empty()) throw InputError(key + ": no file matches '" + pattern + "'");
    std::sort(found.begin(), found.end());
    paths.insert(paths.end(), found.begin(), found.end());
  }
  return paths;
}

}  // namespace llmtrain::data
