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
  /// Takes the lock of `run_dir` (creating the folder and the file as needed); InputError naming
  /// the holder's host, pid and start time when another process holds it, the file unchanged.
  explicit RunLock(const std::string& run_dir);
  ~RunLock();
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;

 private:
  int fd_ = -1;
};

/// Rank 0 takes the run folder's lock; every rank learns whether it did, and all throw alike
/// (InputError, exit 2) when another run holds it. Null on the other ranks.
std::unique_ptr<RunLock> lock_run_folder(const std::string& run_dir, dist::Communicator& world);

}  // namespace llmtrain::train
