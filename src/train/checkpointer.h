// A run's checkpoints: where it resumes from, when it saves, and the stop signals that make it
// save and stop at the next update boundary (exit 75, so the job is resubmitted and resumes).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint.h"
#include "dist/communicator.h"
#include "train/reporter.h"
#include "train/trainer.h"

namespace llmtrain::train {

/// The run's checkpoint folder: checkpoint.dir, else RUN_DIR/checkpoints.
std::string checkpoint_root(const TrainOptions& options);

/// The checkpoint to continue from. --resume never: none (and the run folder must be new); auto:
/// the newest complete checkpoint that verifies, skipping damaged ones with a warning (printed by
/// the `lead` rank); PATH: that one. InputError when the checkpoint's config differs from this
/// run's in a key that must match on resume (config::may_change_on_resume).
std::optional<checkpoint::Found> find_resume_point(const TrainOptions& options, bool lead);

class StopSignals;

/// Owns the saving of a run: when a checkpoint is due (checkpoint.every, or a stop signal on any
/// rank), writing it (keeping checkpoint.keep_last) from the Trainer's state, and, for its
/// lifetime, the handlers of SIGTERM, SIGINT and SIGUSR1 (a second SIGINT ends the process at once).
class Checkpointer {
 public:
  Checkpointer(const TrainOptions& options, dist::Communicator& world, Reporter& reporter);
  ~Checkpointer();
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  /// Whether a stop signal reached any rank; every rank must call it at the same update boundary
  /// (a collective), and all get the same answer.
  bool stop_requested();
  /// Whether checkpoint.every asks for a checkpoint after update `step`.
  bool due(std::int64_t step) const;
  /// Writes the checkpoint of update `step` (a collective); returns its folder.
  std::string save(std::int64_t step, Trainer& trainer);

 private:
  const config::Config& config_;
  std::string root_;
  dist::Communicator& world_;
  Reporter& reporter_;
  nlohmann::json resolved_;  // the config, as saved in state.json
  std::unique_ptr<StopSignals> signals_;
};

}  // namespace llmtrain::train
