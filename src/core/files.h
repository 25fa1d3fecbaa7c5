// Files read from and written for users, safely: inputs must be regular files (never a FIFO, a
// device or a directory read as a file), and outputs are written under a temporary name created
// exclusively in the target's folder (never following a link), then renamed into place.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace llmtrain {

/// The whole regular file at `path`. InputError naming the file and `what` (the file expected)
/// when it is missing, not a regular file (opened without blocking, so a FIFO cannot hang), or
/// larger than `max_bytes`.
std::string read_regular_file(const std::string& path, const std::string& what,
                              std::uint64_t max_bytes = std::uint64_t(1) << 40);

/// InputError unless `path` is a regular file (following links; a link loop is an error too).
void require_regular_file(const std::string& path, const std::string& what);

/// Whether `name` is a plain file name: not empty, not "." or "..", no '/' and no NUL byte.
bool is_plain_file_name(std::string_view name);

/// Whether `path` exists as anything (a dangling link counts); never throws.
bool path_exists(const std::string& path);
/// Whether `path` is a directory (following links); never throws.
bool is_directory(const std::string& path);

/// InputError "OPTION: PATH is an existing file, expected a folder" unless `path` is absent or a
/// folder: checked before any work, so that a run does not fail after loading its data.
void require_output_folder(const std::string& path, const std::string& option);

/// Whether the folder `inner` is `outer` or lies inside it (paths compared after resolving links
/// of the parts that exist).
bool same_or_inside(const std::string& inner, const std::string& outer);

/// A file written atomically: bytes go to PATH.tmp-XXXXXX, created with O_EXCL in PATH's folder
/// (so an existing name, a planted link included, is never opened), then fsync, rename onto
/// PATH (which replaces a link rather than following it) and fsync of the folder. Removed by the
/// destructor unless committed. Errors are RuntimeError naming PATH.
class AtomicFile {
 public:
  explicit AtomicFile(std::string path);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  void write(const void* data, std::size_t n);
  void write(std::string_view text) { write(text.data(), text.size()); }
  void commit();
  const std::string& path() const { return path_; }
  const std::string& temp_path() const { return temp_; }
  /// The temporary's descriptor, for writers with their own I/O (fallocate, sync_file_range);
  /// valid until commit().
  int fd() const { return fd_; }

 private:
  std::string path_;
  std::string temp_;
  int fd_ = -1;
  bool committed_ = false;
};

/// Writes `text` to `path` through an AtomicFile.
void write_file_atomic(const std::string& path, std::string_view text);

}  // namespace llmtrain
