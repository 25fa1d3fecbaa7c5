#include "core/files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <utility>

#include "core/error.h"

namespace llmtrain {
namespace {

namespace fs = std::filesystem;

constexpr std::size_t io_chunk = std::size_t(1) << 30;  // below Linux's 2 GiB per read/write

std::string errno_text() { return std::strerror(errno); }

const char* kind_of(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode) || S_ISBLK(mode)) return "a device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

}  // namespace

std::string read_regular_file(const std::string& path, const std::string& what, std::uint64_t max_bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) throw InputError(path + ": cannot open (expected " + what + "): " + errno_text());
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    const std::string kind = kind_of(st.st_mode);
    ::close(fd);
    throw InputError(path + ": is " + kind + " (expected " + what + ", a regular file)");
  }
  if (std::uint64_t(st.st_size) > max_bytes) {
    ::close(fd);
    throw InputError(path + ": " + std::to_string(st.st_size) + " bytes, more than the " +
                     std::to_string(max_bytes) + " accepted for " + what);
  }
  std::string text(std::size_t(st.st_size), '\0');
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::read(fd, text.data() + done, std::min(text.size() - done, io_chunk));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const std::string why = errno_text();
      ::close(fd);
      throw InputError(path + ": cannot read (expected " + what + "): " + why);
    }
    if (n == 0) break;  // the file shrank while being read
    done += std::size_t(n);
  }
  ::close(fd);
  text.resize(done);
  return text;
}

void require_regular_file(const std::string& path, const std::string& what) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    throw InputError(path + ": cannot open (expected " + what + "): " + errno_text());
  }
  if (!S_ISREG(st.st_mode)) {
    throw InputError(path + ": is " + std::string(kind_of(st.st_mode)) + " (expected " + what + ", a regular file)");
  }
}

bool is_plain_file_name(std::string_view name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string_view::npos &&
         name.find('\0') == std::string_view::npos;
}

bool path_exists(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

bool is_directory(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

void require_output_folder(const std::string& path, const std::string& option) {
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) {
    if (!S_ISDIR(st.st_mode)) {
      throw InputError(option + ": " + path + " is " + (S_ISREG(st.st_mode) ? std::string("an existing file") : kind_of(st.st_mode)) +
                       ", expected a folder");
    }
    return;
  }
  if (errno == ENOENT && ::lstat(path.c_str(), &st) != 0) return;  // absent: created later
  throw InputError(option + ": " + path + ": cannot use as a folder: " +
                   (errno == ENOENT ? std::string("a dangling link") : errno_text()));
}

bool same_or_inside(const std::string& inner, const std::string& outer) {
  std::error_code e1, e2;
  const fs::path a = fs::weakly_canonical(fs::absolute(inner), e1);
  const fs::path b = fs::weakly_canonical(fs::absolute(outer), e2);
  if (e1 || e2) return false;
  const auto strip = [](const fs::path& p) { return p.has_filename() ? p : p.parent_path(); };
  const fs::path in = strip(a), out = strip(b);
  auto i = in.begin();
  for (auto o = out.begin(); o != out.end(); ++o, ++i) {
    if (i == in.end() || *i != *o) return false;
  }
  return true;
}

AtomicFile::AtomicFile(std::string path) : path_(std::move(path)) {
  std::string name = path_ + ".tmp-XXXXXX";
  // mkostemp creates with O_CREAT | O_EXCL: an existing name, a link included, is never opened.
  fd_ = ::mkostemp(name.data(), O_CLOEXEC);
  if (fd_ < 0) throw RuntimeError(path_ + ": cannot create a temporary file beside it: " + errno_text());
  temp_ = name;
  ::fchmod(fd_, 0644);  // mkostemp's 0600 is stricter than every other file of a run
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_ && !temp_.empty()) ::unlink(temp_.c_str());
}

void AtomicFile::write(const void* data, std::size_t n) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  while (n > 0) {
    const ssize_t written = ::write(fd_, bytes, std::min(n, io_chunk));
    if (written < 0 && errno == EINTR) continue;
    if (written <= 0) throw RuntimeError(path_ + ": cannot write " + temp_ + ": " + errno_text());
    bytes += written;
    n -= std::size_t(written);
  }
}

void AtomicFile::commit() {
  if (::fsync(fd_) != 0) throw RuntimeError(path_ + ": cannot sync " + temp_ + ": " + errno_text());
  const int fd = std::exchange(fd_, -1);
  if (::close(fd) != 0) throw RuntimeError(path_ + ": cannot close " + temp_ + ": " + errno_text());
  if (::rename(temp_.c_str(), path_.c_str()) != 0) {
    throw RuntimeError(path_ + ": cannot rename " + temp_ + " into place: " + errno_text());
  }
  committed_ = true;
  // Best effort: the file is complete and in place; some filesystems refuse fsync on a directory.
  const fs::path parent = fs::path(path_).parent_path();
  const std::string dir = parent.empty() ? std::string(".") : parent.string();
  const int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd >= 0) {
    ::fsync(dir_fd);
    ::close(dir_fd);
  }
}

void write_file_atomic(const std::string& path, std::string_view text) {
  AtomicFile file(path);
  file.write(text);
  file.commit();
}

}  // namespace llmtrain
