// A training run from start to end: run_training composes the Trainer (train/trainer.h), the
// Reporter (train/reporter.h) and the Checkpointer (train/checkpointer.h).
#pragma once

#include <cstdint>
#include <string>

#include "dist/communicator.h"
#include "train/options.h"

namespace llmtrain::train {

/// --device auto: CUDA when this build has it and every rank of each node can have a device of
/// its own, else the CPU (all ranks agree through `world`); device_note says which and why.
/// Options without device_auto are left as they are.
void resolve_device(TrainOptions& options, dist::Communicator& world);

struct TrainSummary {
  std::int64_t steps = 0;
  double final_loss = 0;      // of the last update's batch
  double final_val_loss = -1;  // of the last validation, -1 when none ran
  double seconds = 0;
  std::string last_checkpoint;
  bool lead = true;        // this process is rank 0 (the one that reports)
  bool preempted = false;  // stopped by a signal after writing a checkpoint (exit 75)
};

/// Trains as the config says, writing RUN_DIR/config.json, metrics.jsonl and checkpoints.
/// InputError (exit 2) for bad data or a run folder that already holds a run.
TrainSummary run_training(const TrainOptions& options);

}  // namespace llmtrain::train
