// Where a run's checkpoints live and which one it continues from.
#pragma once

#include <optional>
#include <string>

#include "checkpoint/checkpoint.h"
#include "train/options.h"

namespace llmtrain::train {

/// The run's checkpoint folder: checkpoint.dir, else RUN_DIR/checkpoints.
std::string checkpoint_root(const TrainOptions& options);

/// The checkpoint to continue from. --resume never: none (and the run folder must be new); auto:
/// the newest complete checkpoint that verifies, skipping damaged ones with a warning (printed by
/// the `lead` rank); PATH: that one. InputError when the checkpoint's config differs from this
/// run's in a key that must match on resume (config::may_change_on_resume). With `older_than` (auto
/// only: a step folder found damaged while it was loaded), the newest complete one older than it.
std::optional<checkpoint::Found> find_resume_point(const TrainOptions& options, bool lead,
                                                   const std::string& older_than = "");

}  // namespace llmtrain::train
