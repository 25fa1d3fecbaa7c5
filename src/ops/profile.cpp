#include "ops/profile.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>

#if LLMTRAIN_HAVE_CUDA
#include "device/runtime.h"
#endif

namespace llmtrain::ops {
namespace {

struct Profile {
  std::atomic<bool> on{false};
  std::mutex mutex;
  std::map<std::string, OpTime> ops;
};

Profile& profile() {
  static Profile p;
  return p;
}

}  // namespace

void enable_profiling(bool on) {
  Profile& p = profile();
  std::lock_guard lock(p.mutex);
  p.ops.clear();
  p.on = on;
}

bool profiling_enabled() { return profile().on; }

std::vector<OpTime> profile_report() {
  Profile& p = profile();
  std::lock_guard lock(p.mutex);
  std::vector<OpTime> out;
  for (const auto& [name, time] : p.ops) out.push_back(time);
  std::sort(out.begin(), out.end(), [](const OpTime& a, const OpTime& b) { return a.seconds > b.seconds; });
  return out;
}

namespace {

// CUDA ops only enqueue work: while profiling, wait for the device around each op so that its
// time is the kernels' (once device buffers exist, i.e. the CUDA backend is in use).
void wait_for_device() {
#if LLMTRAIN_HAVE_CUDA
  if (device::buffer_memory().peak > 0) device::synchronize();
#endif
}

}  // namespace

OpTimer::OpTimer(const char* name) : name_(profile().on ? name : nullptr) {
  if (!name_) return;
  wait_for_device();
  start_ = std::chrono::steady_clock::now();
}

OpTimer::~OpTimer() {
  if (!name_) return;
  wait_for_device();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  Profile& p = profile();
  std::lock_guard lock(p.mutex);
  OpTime& t = p.ops[name_];
  t.name = name_;
  t.calls += 1;
  t.seconds += seconds;
}

}  // namespace llmtrain::ops
