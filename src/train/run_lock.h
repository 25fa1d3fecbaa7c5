// One writer per run folder: the process that trains into RUN_DIR holds an fcntl lock on
// RUN_DIR/run.lock for its lifetime, with its host, pid and start time written in the file, and a
// heartbeat (a timestamp it rewrites every run_lock_heartbeat_s from a thread of its own). Where
// the kernel keeps locks (local file systems), it drops the lock when the holder dies (kill -9
// included), so a stale file never blocks. On shared file systems (NFSv4, Lustre, GPFS) a lock
// held by a node that died lingers until its lease expires, and some mounts keep no locks at all
// (ENOLCK, ENOSYS): there the heartbeat decides. A lock of another host whose heartbeat is older
// than run_lock_stale_s is taken over (its host is gone); a lock of this host, while its pid lives.
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "dist/communicator.h"

namespace llmtrain::train {

/// How often the holder rewrites its heartbeat in the lock file.
inline constexpr int run_lock_heartbeat_s = 3;
/// A heartbeat older than this means the holder is gone: three periods missed, and a margin for
/// clocks a little apart across hosts and a file system slow to show the write.
inline constexpr int run_lock_stale_s = 3 * run_lock_heartbeat_s + 3;

class RunLock {
 public:
  explicit RunLock(std::string run_dir) : run_dir_(std::move(run_dir)) {}
  ~RunLock();
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;

  /// Takes the lock when the lock file exists already, creating and changing nothing; InputError
  /// naming the holder's host, pid and start time, and the lock's age, when another process holds it.
  void take_existing();
  /// Takes the lock (making the folder and the file as needed), then writes this process's host,
  /// pid and start time into the file, and starts the heartbeat; InputError naming the holder as above.
  void claim();

 private:
  bool lock(bool create);
  void write_note(bool released);

  std::string run_dir_;
  int fd_ = -1;
  bool heartbeat_only_ = false;  // held by the heartbeat alone (no kernel lock: none, or a stale holder's)
  std::string self_;             // "host H, pid P, started T"
  long long started_ = 0;        // when this process took the lock (Unix seconds)
  std::mutex mutex_;
  std::condition_variable stop_;
  bool stopping_ = false;
  std::thread heartbeat_;
};

/// Rank 0 takes the run folder's lock if the folder has one, before anything is loaded (every rank
/// throws alike, InputError, when another run holds it); claim_run_folder() takes it for good
/// once the run is about to write. Null on the other ranks.
std::unique_ptr<RunLock> lock_run_folder(const std::string& run_dir, dist::Communicator& world);
/// Rank 0 claims the folder (see RunLock::claim); every rank throws alike when it cannot.
void claim_run_folder(RunLock* lock, dist::Communicator& world);

}  // namespace llmtrain::train
