// The way a checkpoint file's bytes go to the disk: a temporary file (core/files.h: created
// exclusively, never through a link; renamed into place on commit, else removed), each chunk's
// CRC-32 taken as it is written, so there is no second pass over the file. Two ways:
//  - Direct (large files, where the file system allows O_DIRECT): the bytes are copied into one of
//    two aligned bounce buffers, checksummed there while they are in the cache, and written from it
//    by a second thread while the next buffer fills. The kernel neither copies them nor keeps them
//    in its page cache, so a save in the background costs the training threads little: no
//    write-back work, no page-cache churn (about a third of what buffered writes cost them).
//  - Buffered (small files, or where O_DIRECT is refused): large sequential write(2) calls, each
//    piece's write-back started at once so that the final fsync finds little left to do.
// A refusal of O_DIRECT (by fcntl, or by any direct write: EINVAL, EOPNOTSUPP, EPERM, ...) sends
// the rest buffered, the refused write included; a real I/O error (ENOSPC, EIO, ...) fails the save.
#pragma once

#include <cstddef>
#include <cstdint>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "core/files.h"

namespace llmtrain::checkpoint {

class DiskWriter {
 public:
  /// A writer of `path` (through a temporary name) in write(2) calls of at most `chunk` bytes,
  /// taking the CRC-32 of every `crc_chunk` bytes.
  DiskWriter(const std::string& path, std::size_t chunk, std::size_t crc_chunk);
  ~DiskWriter();
  DiskWriter(const DiskWriter&) = delete;
  DiskWriter& operator=(const DiskWriter&) = delete;

  /// Reserves the file's `total` bytes up front (a full disk fails here, RuntimeError, before
  /// anything is written) and chooses the way to the disk.
  void reserve(std::size_t total);
  /// Appends `n` bytes; RuntimeError naming the file on an I/O error.
  void write(const void* data, std::size_t n);
  /// Makes the file durable and renames it into place.
  void commit();

  /// The whole file's CRC-32 (as zlib's crc32), each crc_chunk's, and the bytes written.
  std::uint32_t crc() const { return crc_; }
  const std::vector<std::uint32_t>& chunk_crcs() const { return chunk_crcs_; }
  std::size_t bytes() const { return written_; }
  /// Bytes of this file that went to the disk with O_DIRECT.
  std::uint64_t direct_bytes() const { return direct_bytes_; }

 private:
  struct FreeAligned {
    void operator()(unsigned char* p) const;
  };
  using Aligned = std::unique_ptr<unsigned char[], FreeAligned>;

  void write_all(const unsigned char* bytes, std::size_t n);
  void start_direct();
  void send_buffer();
  void wait_in_flight();
  void finish_direct();
  void end_chunk();
  int take_fault();

  // What writing a bounce buffer came to: 0 or the errno that stopped it, and its bytes that went direct.
  struct Sent {
    int error = 0;
    std::uint64_t direct = 0;
  };

  AtomicFile file_;
  std::size_t chunk_;
  std::size_t crc_chunk_;
  std::uint32_t crc_ = 0;        // of the whole chunks so far (CRC-32 of nothing: 0)
  std::uint32_t chunk_crc_ = 0;  // of the chunk being written
  std::vector<std::uint32_t> chunk_crcs_;
  std::size_t written_ = 0;
  bool direct_ = false;
  Aligned buffers_[2];
  int current_ = 0;
  std::size_t filled_ = 0;
  std::uint64_t direct_bytes_ = 0;
  bool fault_taken_ = false;   // the test hook's fault (fail_first_direct_write_for_test) came
  std::future<Sent> in_flight_;  // the bounce buffer being written
};

/// Whether a failed direct write's `error` means "O_DIRECT not supported here" (then the bytes are
/// written again buffered), not a real I/O error (ENOSPC, EIO, EDQUOT, EFBIG, EROFS...: the save fails).
bool direct_refused(int error);

/// Bytes this process has written with O_DIRECT so far, all files together (for tests: which way ran).
std::uint64_t direct_bytes_written();

/// Test hook: from now on, the first direct write of each file fails with `error` (as a file
/// system refusing O_DIRECT, or failing, would make it); 0 turns it off. For tests only.
void fail_first_direct_write_for_test(int error);

}  // namespace llmtrain::checkpoint
