// Optional per-op wall-clock accounting (for benchmarks): off unless enabled; when off, an
// OpTimer costs one branch. On the CUDA backend it waits for the device before and after each op,
// which makes the ops' times exact but the run slower: profile runs are not speed runs.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace llmtrain::ops {

struct OpTime {
  std::string name;
  std::int64_t calls = 0;
  double seconds = 0;
};

/// Starts (and clears) or stops the accounting.
void enable_profiling(bool on);
bool profiling_enabled();
/// The time per op since profiling was enabled, most expensive first.
std::vector<OpTime> profile_report();

/// Adds the lifetime of this object to op `name` while profiling is enabled.
class OpTimer {
 public:
  explicit OpTimer(const char* name);
  ~OpTimer();
  OpTimer(const OpTimer&) = delete;
  OpTimer& operator=(const OpTimer&) = delete;

 private:
  const char* name_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace llmtrain::ops
