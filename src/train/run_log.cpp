#include "train/run_log.h"

#include <cstdarg>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace llmtrain::train {
namespace {

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

RunLog::RunLog(const std::string& run_dir, int rank, bool to_stderr) : rank_(rank), to_stderr_(to_stderr) {
  std::filesystem::create_directories(run_dir + "/logs");
  char name[32];
  std::snprintf(name, sizeof name, "/logs/rank-%05d.log", rank);
  file_ = std::fopen((run_dir + name).c_str(), "a");  // a missing log file is not worth stopping a run
  heartbeat_ = std::thread(&RunLog::heartbeat_loop, this);
}

RunLog::~RunLog() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  heartbeat_.join();
  if (file_) std::fclose(file_);
}

void RunLog::line(const char* format, ...) {
  va_list args;
  va_start(args, format);
  vline(format, args);
  va_end(args);
}

void RunLog::vline(const char* format, va_list args) {
  char text[1024];
  std::vsnprintf(text, sizeof text, format, args);
  const std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);
  char stamp[64];
  std::strftime(stamp, sizeof stamp, "%Y-%m-%d %H:%M:%S", &local);
  std::lock_guard lock(mutex_);
  if (file_) {
    std::fprintf(file_, "[%s rank %d] %s\n", stamp, rank_, text);
    std::fflush(file_);
  }
  if (to_stderr_) {
    std::fprintf(stderr, "[%s rank %d] %s\n", stamp + 11, rank_, text);  // time of day on the terminal
    std::fflush(stderr);
  }
}

void RunLog::step_started(std::int64_t step) {
  step_ = step;
  step_started_ns_ = now_ns();
}

void RunLog::heartbeat_loop() {
  std::int64_t reported_step = -1, reported_at_ns = 0;
  std::unique_lock lock(mutex_);
  while (!wake_.wait_for(lock, std::chrono::seconds(1), [&] { return stopping_; })) {
    const std::int64_t started = step_started_ns_;
    if (started == 0) continue;
    const std::int64_t now = now_ns();
    const double running = double(now - started) / 1e9;
    const bool due = running > heartbeat_s && (reported_step != step_ || double(now - reported_at_ns) / 1e9 > heartbeat_s);
    if (!due) continue;
    reported_step = step_;
    reported_at_ns = now;
    lock.unlock();
    line("heartbeat: update %lld still running after %.0f s (a slow step, or a hung rank: see the other ranks' logs)",
         static_cast<long long>(reported_step), running);
    lock.lock();
  }
}

MemoryUse process_memory() {
  MemoryUse use;
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    std::istringstream fields(line);
    std::string key;
    std::int64_t kib = 0;
    fields >> key >> kib;
    if (key == "VmRSS:") use.current = kib * 1024;
    if (key == "VmHWM:") use.peak = kib * 1024;
  }
  return use;
}

}  // namespace llmtrain::train
