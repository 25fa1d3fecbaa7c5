#include "train/run.h"

#include <cstdio>
#include <memory>
#include <optional>

#include "core/error.h"
#include "core/files.h"
#include "ops/buffer.h"
#include "ops/profile.h"
#include "train/checkpointer.h"
#include "train/reporter.h"
#include "train/resume.h"
#include "train/run_lock.h"
#include "train/trainer.h"

namespace llmtrain::train {
namespace {

// The figures of the start-up lines.
RunShape run_shape(const Trainer& trainer) {
  return {trainer.first_step(),   trainer.num_params(),  trainer.train_samples(),
          trainer.micro_steps(),  trainer.state_bytes(), trainer.attention().describe(),
          trainer.init_note(),    trainer.task_notes()};
}

}  // namespace

void resolve_device(TrainOptions& options, dist::Communicator& world) {
  if (!options.device_auto) return;
  options.device_auto = false;
  std::string why_none;
  const int devices = ops::cuda_device_count(&why_none);
  // Every rank of a node needs a GPU of its own (NCCL refuses two ranks on one device), and all
  // ranks must agree: one rank short of a GPU puts the whole job on the CPU.
  std::int64_t short_of_gpu = devices > world.local_rank() ? 0 : 1;
  world.all_reduce_max(&short_of_gpu, 1);
  if (!short_of_gpu) {
    options.device = Device::cuda;
    options.device_note = "device auto: cuda (this build has CUDA and " + std::to_string(devices) +
                          " device(s) visible, one per rank of this node)";
  } else {
    options.device = Device::cpu;
    options.device_note = devices == 0 ? "device auto: cpu (no CUDA device: " + why_none + ")"
                          : devices <= world.local_rank()
                              ? "device auto: cpu (" + std::to_string(devices) + " CUDA device(s) for local rank " +
                                    std::to_string(world.local_rank()) + ": every rank of a node needs its own)"
                              : "device auto: cpu (another rank has no CUDA device of its own)";
  }
}

TrainSummary run_training(const TrainOptions& requested) {
  TrainOptions options = requested;  // --device auto is resolved with the ranks below
  const config::Config& config = options.config;
  const auto& tc = config.train;
  if (options.device == Device::cuda) {
    std::string why;
    if (!ops::cuda_available(&why)) throw InputError("--device cuda: no usable CUDA device: " + why);
  }
  if (config.data.train.empty()) throw InputError("data.train: no training data given");
  // Before any data is loaded or model built: the run's folders must be folders.
  require_output_folder(options.run_dir, "--run-dir");
  if (!config.checkpoint.dir.empty()) require_output_folder(config.checkpoint.dir, "checkpoint.dir");
  // Pipelines: on CPU ranks, with ZeRO 0-2 (what is not built yet is refused here).
  if (config.dist.pipeline_parallel > 1) {
    const std::string what = "dist.pipeline_parallel = " + std::to_string(config.dist.pipeline_parallel);
    if (config.dist.zero_stage == 3) throw InputError(what + ": not with dist.zero_stage 3 (use ZeRO 0, 1 or 2)");
  }
  const dist::Communicators comms = dist::make_communicators(
      [&options](dist::Communicator& world) {
        resolve_device(options, world);
        return options.device;
      },
      config.dist.timeout_s, [&config](int world) { return dist::Mesh::of(world, config.dist); });
  dist::Communicator& world = *comms.world;
  TrainSummary summary;
  summary.lead = world.rank() == 0;
  const std::unique_ptr<RunLock> run_lock = lock_run_folder(options.run_dir, world);  // one writer per run folder
  std::optional<checkpoint::Found> resume = find_resume_point(options, summary.lead);
  std::unique_ptr<Trainer> built;
  while (!built) {
    try {
      built = std::make_unique<Trainer>(options, comms, resume ? &*resume : nullptr);
    } catch (const checkpoint::DamagedCheckpoint& e) {
      // Damage is found as the ranks read their parts (every rank agrees on it): --resume auto
      // goes on with the next older complete checkpoint.
      if (!resume || options.resume != "auto") throw;
      if (summary.lead) std::fprintf(stderr, "train: warning: skipping damaged checkpoint: %s\n", e.what());
      resume = find_resume_point(options, summary.lead, resume->dir);
    }
  }
  Trainer& trainer = *built;
  claim_run_folder(run_lock.get(), world);  // from here on the run writes into its folder
  Reporter reporter(options, world, trainer.first_step());
  reporter.run_started(comms, run_shape(trainer), resume ? &*resume : nullptr);
  Checkpointer checkpointer(options, world, reporter, trainer);  // watches stop signals from here on

  ops::enable_profiling(options.profile_ops);
  reporter.start_clock();
  for (std::int64_t step = trainer.first_step(); step <= tc.max_steps; ++step) {
    reporter.step_started(step);
    const StepResult result = trainer.step(step);
    if (result.skipped) {
      reporter.skipped(step, result.bad_in_a_row);
      if (result.bad_in_a_row >= tc.max_bad_steps) {
        checkpointer.flush();  // every rank stops here alike: a save being written is completed
        throw RuntimeError(std::to_string(result.bad_in_a_row) + " updates in a row had a non-finite loss or gradient norm "
                           "(train.max_bad_steps); stopping at step " + std::to_string(step) +
                           ": lower optim.lr or check the data");
      }
      continue;
    }
    reporter.update(step, result);
    summary.final_loss = result.loss;
    const bool last = step == tc.max_steps;
    if ((tc.eval_every > 0 && step % tc.eval_every == 0) || last) {
      if (const std::optional<Validation> validation = trainer.validate()) {
        reporter.validation(step, *validation);
        if (validation->has_loss) summary.final_val_loss = validation->val_loss;
      }
    }
    // A stop signal on any rank: all agree at this update boundary, save and stop.
    const bool stop = checkpointer.stop_requested();
    if (checkpointer.due(step) || last || stop) summary.last_checkpoint = checkpointer.save(step, trainer);
    summary.steps = step;
    if (stop && !last) {
      checkpointer.flush();
      summary.preempted = true;
      reporter.info("train: stopped by a signal after step %lld; checkpoint written", static_cast<long long>(step));
      break;
    }
  }
  checkpointer.flush();
  summary.seconds = reporter.elapsed();
  if (options.profile_ops) {
    reporter.op_profile(summary.seconds);
    ops::enable_profiling(false);
  }
  return summary;
}

}  // namespace llmtrain::train
