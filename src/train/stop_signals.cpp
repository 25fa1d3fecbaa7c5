#include "train/stop_signals.h"

#include <atomic>
#include <csignal>
#include <cstdlib>

namespace llmtrain::train {
namespace {

constexpr int stop_signals[3] = {SIGTERM, SIGINT, SIGUSR1};

// SIGTERM, SIGINT and SIGUSR1 ask the run to stop at the next update boundary (after a
// checkpoint); a second SIGINT ends the process at once.
std::atomic<int> stop_requests{0};
extern "C" void on_stop_signal(int signal) {
  if (signal == SIGINT && stop_requests.load() > 0) std::_Exit(128 + SIGINT);
  stop_requests.fetch_add(1);
}

}  // namespace

StopSignals::StopSignals() {
  stop_requests = 0;
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  for (int i = 0; i < 3; ++i) sigaction(stop_signals[i], &action, &previous_[i]);
}

StopSignals::~StopSignals() {
  for (int i = 0; i < 3; ++i) sigaction(stop_signals[i], &previous_[i], nullptr);
}

bool StopSignals::raised() const { return stop_requests.load() > 0; }

}  // namespace llmtrain::train
