#include "dist/file_work.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <exception>
#include <thread>

namespace llmtrain::dist {

double file_work_limit_s(double timeout_s, double bytes) {
  return std::max(10.0 * timeout_s, timeout_s + std::max(bytes, 0.0) / file_work_floor_bytes_per_s);
}

Patience::Patience(Communicator& comm, double limit_s) : comm_(comm), previous_(comm.patience_s()) {
  comm_.set_patience(limit_s);
}

Patience::~Patience() { comm_.set_patience(previous_); }

void wait_keeping_alive(Communicator& comm, const std::function<bool()>& done) {
  while (!done()) {
    comm.keep_alive();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

void run_keeping_alive(Communicator& comm, const std::function<void()>& work) {
  std::atomic<bool> finished{false};
  std::exception_ptr error;
  std::thread worker([&] {
    try {
      work();
    } catch (...) {
      error = std::current_exception();
    }
    finished.store(true);
  });
  wait_keeping_alive(comm, [&] { return finished.load(); });
  worker.join();
  if (error) std::rethrow_exception(error);
}

double test_delay_s(const char* name) {
  const char* text = std::getenv(name);
  if (!text) return 0.0;
  char* end = nullptr;
  const double seconds = std::strtod(text, &end);
  return end != text && seconds > 0 ? seconds : 0.0;
}

}  // namespace llmtrain::dist
