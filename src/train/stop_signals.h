// The stop signals of a training run: SIGTERM, SIGINT and SIGUSR1 ask it to stop at the next
// update boundary, after a checkpoint (exit 75, so the job is resubmitted and resumes); a second
// SIGINT ends the process at once.
#pragma once

#include <signal.h>

namespace llmtrain::train {

/// Installs the stop handlers for its lifetime and restores the previous ones after. One at a
/// time: the handlers count into one process-wide flag, cleared when it is made.
class StopSignals {
 public:
  StopSignals();
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;
  /// Whether a stop signal came since it was made.
  bool raised() const;

 private:
  struct sigaction previous_[3];
};

}  // namespace llmtrain::train
