// One writer per run folder: the process that trains into RUN_DIR holds an fcntl lock on
// RUN_DIR/run.lock for its lifetime, with its host, pid and start time written in the file. The
// kernel drops the lock when the holder dies (kill -9 included), so a stale file never blocks.
#pragma once

#include <memory>
#include <string>

#include "dist/communicator.h"

namespace llmtrain::train {

class RunLock {
 public:
  explicit RunLock(std::string run_dir) : run_dir_(std::move(run_dir)) {}
  ~RunLock();
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;

  /// Takes the lock when the lock file exists already, creating and changing nothing; InputError
  /// naming the holder's host, pid and start time when another process holds it.
  void take_existing();
  /// Takes the lock (making the folder and the file as needed), then writes this process's host,
  /// pid and start time into the file; InputError naming the holder as above.
  void claim();

 private:
  bool lock(bool create);

  std::string run_dir_;
  int fd_ = -1;
};

/// Rank 0 takes the run folder's lock if the folder has one, before anything is loaded (every rank
/// throws alike, InputError, when another run holds it); claim_run_folder() takes it for good
/// once the run is about to write. Null on the other ranks.
std::unique_ptr<RunLock> lock_run_folder(const std::string& run_dir, dist::Communicator& world);
/// Rank 0 claims the folder (see RunLock::claim); every rank throws alike when it cannot.
void claim_run_folder(RunLock* lock, dist::Communicator& world);

}  // namespace llmtrain::train
