// The training loop: data, model, AdamW, schedule, validation, metrics, checkpoints.
#pragma once

#include <cstdint>
#include <string>

#include "config/config.h"
#include "data/dataset.h"
#include "dist/communicator.h"
#include "model/model.h"

namespace llmtrain::train {

struct TrainOptions {
  config::Config config;
  std::string run_dir;
  Device device = Device::cpu;
  bool progress = true;        // progress lines on stderr
  bool profile_ops = false;    // print the time spent in each op at the end
  std::string resume = "auto";  // auto | never | a checkpoint path
};

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

/// Mean loss over `batches` global batches of `data` in order (no shuffling), micro-batches of
/// the config's micro_batch_size; at most as many batches as the data holds. With `comm`, each
/// rank evaluates its part of every batch and all get the mean over all.
double evaluate(model::Model& model, const data::TokenDataset& data, const config::Config& config,
                std::int64_t batches, dist::Communicator* comm = nullptr);

}  // namespace llmtrain::train
