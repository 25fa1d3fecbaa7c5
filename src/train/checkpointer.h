// A run's saves: when a checkpoint is due, writing it (in the background where memory allows),
// and the stop signals (train/stop_signals.h) that make it save and stop at the next update
// boundary. Where a run resumes from: train/resume.h.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint.h"
#include "core/tensor.h"
#include "data/sampler.h"
#include "dist/communicator.h"
#include "model/model.h"
#include "ops/buffer.h"
#include "optim/optimizer.h"
#include "parallel/tensor_parallel_comm.h"
#include "train/options.h"
#include "train/reporter.h"
#include "train/stop_signals.h"

namespace llmtrain::train {

/// What a checkpoint takes from training, as the Checkpointer sees it: the position in the data,
/// the weights and the optimizer state, and where each part sits in the whole model. The Trainer
/// provides it; the Checkpointer knows nothing else of the Trainer.
class CheckpointSource {
 public:
  virtual ~CheckpointSource() = default;

  /// Tokens trained on so far, and where the sampler stands (the next update's samples).
  virtual std::int64_t tokens_seen() const = 0;
  virtual data::SamplerState sampler_state() const = 0;
  /// The whole model's parameter count (every rank's parts together).
  virtual std::int64_t num_params() const = 0;
  /// The whole model's parameter list (names, shapes, flat offsets of the one-rank layout).
  virtual const model::Model& logical_model() const = 0;
  /// The device the model trains on.
  virtual Device device() const = 0;
  /// This rank's fp32 master weights of the runs the optimizer updates, laid out as its state
  /// tensors (on the model's device).
  virtual Tensor master() const = 0;
  /// The optimizer, whose state() a checkpoint saves by name (local arrays on the model's device).
  virtual const optim::Optimizer& optimizer() const = 0;
  /// Where this rank's optimizer state sits in the whole model's flat buffer (the parts a
  /// checkpoint takes from this rank: a replicated parameter's from tensor rank 0 only).
  virtual std::vector<parallel::Placed> optimizer_placement() const = 0;
  /// Whether this rank writes an optimizer file (the first rank of a data-parallel group, or
  /// every rank when ZeRO shards the state).
  virtual bool writes_optimizer() const = 0;
  /// Called in each update before the weights and optimizer state change (a background
  /// checkpoint may still be copying them); empty: nothing to wait for.
  virtual void set_before_update(std::function<void()> hook) = 0;
};

/// Owns the saving of a run: when a checkpoint is due (checkpoint.every, or a stop signal on any
/// rank), writing it (keeping checkpoint.keep_last) from training's state (CheckpointSource), and, for its
/// lifetime, the handlers of SIGTERM, SIGINT and SIGUSR1 (a second SIGINT ends the process at once).
///
/// With checkpoint.async (and the memory for it) each rank's part of a save is copied into a host
/// staging buffer kept between saves: from a GPU at the step boundary (into pinned memory); on the
/// CPU by the background thread while the next update's forward and backward passes run, that
/// update waiting for the copy only before it changes the weights. The same thread then writes
/// the files. No MPI call is made from that thread: at a later update
/// boundary (stop_requested()) the ranks find that every writer has finished, agree, and rank 0
/// marks the checkpoint COMPLETE and moves `latest`. A save that comes while the previous one is
/// still being written waits for it; flush() (end of training, a stop signal) waits for the last.
class Checkpointer {
 public:
  Checkpointer(const TrainOptions& options, dist::Communicator& world, Reporter& reporter, CheckpointSource& source);
  /// On the way out of an error, a save still being written is waited for (up to the commit's
  /// patience for slow writers) and, at world size 1, committed; with more ranks, or when its
  /// writer does not finish in time (it is then abandoned, never joined), it stays incomplete and
  /// the previous checkpoint remains `latest`. Nothing here throws or ends the process: the error
  /// that stopped the run is the one reported.
  ~Checkpointer();
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  /// Whether a stop signal reached any rank; every rank must call it at the same update boundary
  /// (a collective), and all get the same answer. It also commits a background save once every
  /// rank has written its files.
  bool stop_requested();
  /// Whether checkpoint.every asks for a checkpoint after update `step`.
  bool due(std::int64_t step) const;
  /// Starts (async) or writes (sync) the checkpoint of update `step` (a collective); returns its
  /// folder, complete once flush() or a later stop_requested() has committed it.
  std::string save(std::int64_t step, CheckpointSource& source);
  /// Waits for the save being written, if any, and commits it (a collective).
  void flush();

 private:
  struct Pending;
  void finish(const char* why);
  bool settle(Pending& p) noexcept;
  void wait_for_copy();
  void remove_pruned();

  const config::Config& config_;
  std::string root_;
  dist::Communicator& world_;
  Reporter& reporter_;
  nlohmann::json resolved_;  // the config, as saved in state.json
  nlohmann::json data_;      // data.train's sources as read (train/data_record.h), saved there too
  std::unique_ptr<StopSignals> signals_;
  bool async_ = false;
  double file_work_limit_s_ = 0.0;   // the commit's patience for slow writers (dist/file_work.h)
  bool stages_ = false;              // async: this rank writes its part (not another rank of its replicas)
  CheckpointSource* source_ = nullptr;  // async: whose updates wait for the staging copy
  ops::Buffer staging_;              // async: the weights and optimizer state of the ranges this rank writes
  std::shared_ptr<Pending> pending_;  // the save being written in the background (shared with its writer)
  bool abandoned_ = false;           // a writer was detached on an error path (settle)
  std::thread pruner_;               // rank 0: deletes the checkpoints beyond keep_last
};

}  // namespace llmtrain::train
