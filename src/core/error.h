// Errors carry the process exit code they stand for; only main() turns them into one.
#pragma once

#include <stdexcept>
#include <string>

namespace llmtrain {

/// Exit codes of the llmtrain binary (DESIGN.md, "Command line").
enum class ExitCode : int {
  ok = 0,
  runtime_failure = 1,
  bad_input = 2,   // bad usage, config, data or checkpoint
  preempted = 75,  // stopped by a signal after a checkpoint was written
  ranks_lost = 76,  // a collective or transfer timed out: ranks dead, hung or cut off (src/dist)
};

/// Base of every error llmtrain throws on purpose. The message is one line, without the
/// "llmtrain: error:" prefix, and names what was wrong and where.
class Error : public std::runtime_error {
 public:
  Error(const std::string& message, ExitCode code) : std::runtime_error(message), code_(code) {}
  ExitCode code() const noexcept { return code_; }

 private:
  ExitCode code_;
};

/// Bad command line, config, data or checkpoint: exit 2, nothing on disk is touched.
class InputError : public Error {
 public:
  explicit InputError(const std::string& message) : Error(message, ExitCode::bad_input) {}
};

/// Something failed while running (I/O, device, communication): exit 1.
class RuntimeError : public Error {
 public:
  explicit RuntimeError(const std::string& message) : Error(message, ExitCode::runtime_failure) {}
};

/// A collective or transfer did not finish in time, or a peer is gone: ranks dead, hung or cut off.
/// Exit 76 (ExitCode::ranks_lost), which launchers read to restart the job. The MPI communicator
/// stops the whole job itself with this status (it must, while other ranks wait in MPI); a
/// communicator whose other ranks time out on their own (NCCL) throws this instead.
class RanksLostError : public Error {
 public:
  explicit RanksLostError(const std::string& message) : Error(message, ExitCode::ranks_lost) {}
};

}  // namespace llmtrain
