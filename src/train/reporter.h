// What a training run reports, and where: progress lines (train/run_log.h), RUN_DIR/config.json,
// RUN_DIR/metrics.jsonl (one JSON object per line, flushed) and TensorBoard scalars.
#pragma once

#include <chrono>
#include <cstdint>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint.h"
#include "dist/communicator.h"
#include "train/options.h"
#include "train/run_log.h"
#include "train/step_result.h"
#include "train/tensorboard.h"

namespace llmtrain::train {

/// Appends one JSON object per line and flushes, so a killed run keeps every line it logged.
class MetricsLog {
 public:
  explicit MetricsLog(const std::string& path);
  void write(const nlohmann::json& line);

 private:
  std::string path_;
  std::ofstream out_;
};

/// Rewrites metrics.jsonl at `path` keeping only the lines of steps up to `last_step` (nothing to
/// do when the file does not exist); lines cut short by a crash are dropped.
void keep_metrics_up_to(const std::string& path, std::int64_t last_step);

/// How a save held up training: the time the training thread spent in it (at the step boundary
/// and, on the CPU, waiting in the next update for the staging copy; the whole write when
/// synchronous), the part of that spent waiting for the previous save to finish, and how long the
/// copy into the staging buffer took (made by the background thread on the CPU).
struct SaveStall {
  double stall_s = 0.0;
  double waited_s = 0.0;
  double copy_s = 0.0;
  bool background = false;
};

/// What the start-up lines say of the run's training state (the Trainer's figures).
struct RunShape {
  std::int64_t first_step = 1;     // the first update this run makes
  std::int64_t num_params = 0;     // the whole model's
  std::int64_t train_samples = 0;  // of data.train
  std::int64_t micro_steps = 1;    // per update (a pipeline's micro-batches)
  std::size_t state_bytes = 0;     // weights, gradients and optimizer state this rank holds
  std::string attention;           // the attention kernels model.attention resolved to, and why
  std::string init_note;           // what model.init_from cost this rank (Trainer::init_note)
  std::vector<std::string> task_notes;  // what each of train.eval_tasks costs (Trainer::task_notes)
};

/// Owns the run's reports: this rank's log (RunLog: its own file, and stderr on rank 0), and on
/// rank 0 the run folder's config.json, metrics.jsonl and TensorBoard events. Turns an update's
/// figures into tokens/s, MFU and memory use; keeps the run's clock.
class Reporter {
 public:
  /// Rank 0 writes RUN_DIR/config.json and keeps metrics.jsonl up to `first_step` - 1 (lines past
  /// a resumed step are logged again as those steps are redone); after a barrier on `world`,
  /// every rank opens its log.
  Reporter(const TrainOptions& options, dist::Communicator& world, std::int64_t first_step);

  /// Whether progress lines are on (every rank logs to its file; rank 0 also to stderr).
  bool logging() const { return logging_; }
  /// One progress line, printf-style, when logging() (else nothing).
  void info(const char* format, ...) __attribute__((format(printf, 2, 3)));

  /// The communicators, the resume point, the attention kernels chosen and the shape of the run.
  void run_started(const dist::Communicators& comms, const RunShape& run, const checkpoint::Found* resume);
  /// Starts the clock of elapsed_s, ETA and the run's duration.
  void start_clock();
  /// Seconds since start_clock().
  double elapsed() const;
  /// Update `step` has begun (the heartbeat watches it).
  void step_started(std::int64_t step);
  /// A finished update: its metrics line, TensorBoard scalars and (every log_every) progress line.
  void update(std::int64_t step, const StepResult& result);
  /// An update skipped by the NaN guard.
  void skipped(std::int64_t step, std::int64_t bad_in_a_row);
  /// A validation: val_loss and each named set's val_loss/NAME, in the log line, metrics.jsonl and
  /// TensorBoard; each task's scores there too, and its predictions in
  /// RUN_DIR/tasks/NAME/step_SSSSSSSS.json (eval --task --json's form).
  void validation(std::int64_t step, const Validation& validation);
  /// A checkpoint made complete: a progress line and a metrics line with its size, write time and
  /// throughput (all ranks' bytes over the slowest rank's time) and the stall it caused.
  void checkpoint_saved(std::int64_t step, const checkpoint::Committed& saved, const SaveStall& stall);
  /// The time spent in each op (after a run with --profile-ops), of `seconds` in all.
  void op_profile(double seconds);

 private:
  const config::Config& config_;
  Device device_;
  std::string device_note_;  // which device --device auto picked, and why
  int world_size_;
  bool logging_;
  std::unique_ptr<MetricsLog> metrics_;             // rank 0 only
  std::unique_ptr<TensorBoardWriter> tensorboard_;  // rank 0 only
  std::string run_dir_;
  std::unique_ptr<RunLog> log_;
  std::chrono::steady_clock::time_point start_;
  std::int64_t device_peak_ = 0;  // of the GPU's memory in use, as sampled after updates
  std::size_t state_bytes_ = 0;   // weights, gradients and optimizer state this rank holds (RunShape::state_bytes)
};

}  // namespace llmtrain::train
