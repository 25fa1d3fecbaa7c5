// What a run reports: every line goes to the rank's own log file, RUN_DIR/logs/rank-NNNNN.log,
// and (rank 0 only, unless quiet) to stderr, each prefixed with the time and the rank. A
// heartbeat thread says so when an update takes unusually long, so a hung job is visible.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>
#include <thread>

namespace llmtrain::train {

class RunLog {
 public:
  /// `to_stderr`: this rank also prints (rank 0 with progress on).
  RunLog(const std::string& run_dir, int rank, bool to_stderr);
  ~RunLog();
  RunLog(const RunLog&) = delete;
  RunLog& operator=(const RunLog&) = delete;

  /// One line, printf-style, without the trailing newline.
  void line(const char* format, ...) __attribute__((format(printf, 2, 3)));
  /// The same with the arguments as a va_list.
  void vline(const char* format, va_list args) __attribute__((format(printf, 2, 0)));

  /// Marks the start of update `step`: from then on, every `heartbeat_s` without a new call the
  /// heartbeat thread logs that the update is still running.
  void step_started(std::int64_t step);

 private:
  void heartbeat_loop();

  int rank_;
  bool to_stderr_;
  std::FILE* file_ = nullptr;
  std::mutex mutex_;

  static constexpr double heartbeat_s = 60.0;
  std::atomic<std::int64_t> step_{0};
  std::atomic<std::int64_t> step_started_ns_{0};
  std::condition_variable wake_;
  bool stopping_ = false;
  std::thread heartbeat_;
};

/// Resident memory of this process now and at its peak, in bytes (Linux /proc; 0 if unknown).
struct MemoryUse {
  std::int64_t current = 0, peak = 0;
};
MemoryUse process_memory();

}  // namespace llmtrain::train
