#include "checkpoint/disk_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "core/crc32.h"
#include "core/error.h"

namespace llmtrain::checkpoint {
namespace {

constexpr std::size_t io_chunk = std::size_t(1) << 30;  // below Linux's 2 GiB per write
constexpr std::size_t min_writeback = std::size_t(1) << 20;
constexpr std::size_t min_parallel_crc = std::size_t(1) << 20;
// Direct writes: files from this size on; buffers aligned (and sized) for any block size up to 4 KiB.
constexpr std::size_t direct_min_bytes = std::size_t(4) << 20;
constexpr std::size_t direct_align = 4096;
constexpr std::size_t bounce_bytes = std::size_t(8) << 20;

std::atomic<std::uint64_t> direct_total{0};
std::atomic<int> first_direct_fault{0};

// Writes all `n` bytes at `offset` (the descriptor direct or not); 0, or the errno that stopped it.
int write_at(int fd, const unsigned char* bytes, std::size_t n, std::size_t offset) {
  while (n > 0) {
    const ssize_t written = ::pwrite(fd, bytes, std::min(n, io_chunk), off_t(offset));
    if (written < 0 && errno == EINTR) continue;
    if (written <= 0) return written < 0 ? errno : EIO;
    bytes += written;
    offset += std::size_t(written);
    n -= std::size_t(written);
  }
  return 0;
}

}  // namespace

bool direct_refused(int error) {
  // What file systems answer a direct write they do not take: EINVAL (the usual one, and an
  // alignment they cannot do), EOPNOTSUPP/ENOTSUP (some network and FUSE file systems), EPERM
  // (FUSE, some overlay mounts), ENOSYS. Everything else is the disk's answer to any write
  // (ENOSPC, EDQUOT, EFBIG, EIO, EROFS, ...): the same bytes written buffered would fail alike,
  // or worse, seem to succeed.
  return error == EINVAL || error == EOPNOTSUPP || error == ENOTSUP || error == EPERM || error == ENOSYS;
}

std::uint64_t direct_bytes_written() { return direct_total.load(); }

void fail_first_direct_write_for_test(int error) { first_direct_fault.store(error); }

void DiskWriter::FreeAligned::operator()(unsigned char* p) const { std::free(p); }

DiskWriter::DiskWriter(const std::string& path, std::size_t chunk, std::size_t crc_chunk)
    : file_(path), chunk_(chunk), crc_chunk_(std::max<std::size_t>(crc_chunk, 1)) {}

DiskWriter::~DiskWriter() {
  if (in_flight_.valid()) in_flight_.wait();
}

void DiskWriter::reserve(std::size_t total) {
  if (total != 0 && ::fallocate(file_.fd(), 0, 0, off_t(total)) != 0) {
    // Out of space or quota: say so now. Anything else (a file system or device that cannot
    // reserve): the writes find out.
    if (errno == ENOSPC || errno == EDQUOT || errno == EFBIG) {
      throw RuntimeError(file_.path() + ": cannot write " + file_.temp_path() + ": " + std::strerror(errno));
    }
  }
  if (total >= direct_min_bytes) start_direct();
}

void DiskWriter::write(const void* data, std::size_t n) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  while (n > 0) {
    const std::size_t to_chunk_end = crc_chunk_ - written_ % crc_chunk_;
    if (direct_) {
      // Into the bounce buffer, then its CRC from there (still in the cache).
      const std::size_t piece = std::min({n, to_chunk_end, bounce_bytes - filled_});
      unsigned char* at = buffers_[current_].get() + filled_;
      std::memcpy(at, bytes, piece);
      chunk_crc_ = crc32(at, piece, chunk_crc_);
      filled_ += piece;
      written_ += piece;
      if (filled_ == bounce_bytes) send_buffer();
      if (written_ % crc_chunk_ == 0) end_chunk();
      bytes += piece;
      n -= piece;
      continue;
    }
    const std::size_t piece = std::min({n, chunk_, to_chunk_end});
    if (piece < min_parallel_crc) {
      chunk_crc_ = crc32(bytes, piece, chunk_crc_);
      write_all(bytes, piece);
    } else {
      // The CRC by a second thread while this one writes: both read the same memory side by side.
      auto crc = std::async(std::launch::async, [bytes, piece, previous = chunk_crc_] { return crc32(bytes, piece, previous); });
      try {
        write_all(bytes, piece);
      } catch (...) {
        crc.wait();
        throw;
      }
      chunk_crc_ = crc.get();
    }
    if (written_ % crc_chunk_ == 0) end_chunk();
    bytes += piece;
    n -= piece;
  }
}

void DiskWriter::commit() {
  if (direct_) finish_direct();
  if (written_ % crc_chunk_ != 0) end_chunk();
  file_.commit();
}

void DiskWriter::write_all(const unsigned char* bytes, std::size_t n) {
  const std::size_t start = written_;
  while (n > 0) {
    const ssize_t written = ::write(file_.fd(), bytes, std::min(n, io_chunk));
    if (written < 0 && errno == EINTR) continue;
    if (written <= 0) throw RuntimeError(file_.path() + ": cannot write " + file_.temp_path() + ": " + std::strerror(errno));
    bytes += written;
    n -= std::size_t(written);
    written_ += std::size_t(written);
  }
  // Start the write-back of what was just written (best effort; fsync in commit() is the guarantee).
  if (written_ - start >= min_writeback) ::sync_file_range(file_.fd(), off_t(start), off_t(written_ - start), SYNC_FILE_RANGE_WRITE);
}

// Direct writes from here on, if the file system takes them (tmpfs and some network file systems
// do not: those stay buffered).
void DiskWriter::start_direct() {
  const int flags = ::fcntl(file_.fd(), F_GETFL);
  if (flags < 0 || ::fcntl(file_.fd(), F_SETFL, flags | O_DIRECT) != 0) return;
  for (Aligned& b : buffers_) {
    b.reset(static_cast<unsigned char*>(std::aligned_alloc(direct_align, bounce_bytes)));
    if (!b) {  // no memory for the buffers: buffered writes need none
      ::fcntl(file_.fd(), F_SETFL, flags);
      return;
    }
  }
  direct_ = true;
}

// The test hook's fault, for this file's first direct write only.
int DiskWriter::take_fault() {
  if (fault_taken_) return 0;
  fault_taken_ = true;
  return first_direct_fault.load();
}

namespace {

// Writes a bounce buffer's `n` bytes at `offset` through `fd` (set for O_DIRECT, unless an earlier
// refusal cleared it); `fault`, when not 0, stands for what the first write would have answered.
// A refusal of O_DIRECT clears the flag for good and writes the same bytes buffered.
auto write_direct(int fd, const unsigned char* bytes, std::size_t n, std::size_t offset, int fault) {
  struct Result {
    int error;
    std::uint64_t direct;
  };
  const int flags = ::fcntl(fd, F_GETFL);
  const bool direct = flags >= 0 && (flags & O_DIRECT) != 0;
  const int error = fault != 0 ? fault : write_at(fd, bytes, n, offset);
  if (error == 0) return Result{0, direct ? std::uint64_t(n) : 0};
  if (!direct_refused(error)) return Result{error, 0};
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_DIRECT) != 0) return Result{error, 0};
  return Result{write_at(fd, bytes, n, offset), 0};
}

}  // namespace

// The full current buffer goes to the disk on the second thread; this one fills the other.
void DiskWriter::send_buffer() {
  wait_in_flight();
  const unsigned char* bytes = buffers_[current_].get();
  const std::size_t n = filled_, offset = written_ - filled_;
  const int fd = file_.fd(), fault = take_fault();
  in_flight_ = std::async(std::launch::async, [fd, bytes, n, offset, fault] {
    const auto result = write_direct(fd, bytes, n, offset, fault);
    return Sent{result.error, result.direct};
  });
  current_ ^= 1;
  filled_ = 0;
}

void DiskWriter::wait_in_flight() {
  if (!in_flight_.valid()) return;
  const Sent sent = in_flight_.get();
  direct_bytes_ += sent.direct;
  direct_total += sent.direct;
  if (sent.error != 0) {
    throw RuntimeError(file_.path() + ": cannot write " + file_.temp_path() + ": " + std::strerror(sent.error));
  }
}

// The last buffer: its whole blocks directly, the rest (under a block) buffered; the file's
// length is then exactly what was written (fallocate may have reserved more only if asked to).
void DiskWriter::finish_direct() {
  wait_in_flight();
  const unsigned char* bytes = buffers_[current_].get();
  const std::size_t offset = written_ - filled_, whole = filled_ / direct_align * direct_align;
  int error = 0;
  if (whole > 0) {
    const auto result = write_direct(file_.fd(), bytes, whole, offset, take_fault());
    error = result.error;
    direct_bytes_ += result.direct;
    direct_total += result.direct;
  }
  const int flags = ::fcntl(file_.fd(), F_GETFL);
  if (flags >= 0) ::fcntl(file_.fd(), F_SETFL, flags & ~O_DIRECT);
  if (error == 0 && filled_ > whole) error = write_at(file_.fd(), bytes + whole, filled_ - whole, offset + whole);
  if (error != 0) throw RuntimeError(file_.path() + ": cannot write " + file_.temp_path() + ": " + std::strerror(error));
  filled_ = 0;
  direct_ = false;
}

// The chunk just finished joins the list, and the whole file's CRC.
void DiskWriter::end_chunk() {
  const std::size_t length = written_ % crc_chunk_ == 0 ? crc_chunk_ : written_ % crc_chunk_;
  chunk_crcs_.push_back(chunk_crc_);
  crc_ = crc32_combine(crc_, chunk_crc_, length);
  chunk_crc_ = 0;
}

}  // namespace llmtrain::checkpoint
