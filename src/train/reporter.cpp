#include "train/reporter.h"

#include <omp.h>

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "core/error.h"
#include "core/files.h"
#include "core/strings.h"
#include "ops/buffer.h"
#include "ops/profile.h"
#include "parallel/pipeline_schedule.h"
#include "parallel/pipeline_stages.h"
#include "plan/memory_plan.h"

namespace llmtrain::train {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

std::string format_duration(double seconds) {
  const auto s = static_cast<long long>(seconds + 0.5);
  char text[32];
  if (s >= 3600) {
    std::snprintf(text, sizeof text, "%lld:%02lld:%02lld", s / 3600, (s / 60) % 60, s % 60);
  } else {
    std::snprintf(text, sizeof text, "%lld:%02lld", s / 60, s % 60);
  }
  return text;
}

std::string format_rate(double per_second) {
  char text[32];
  if (per_second >= 1e6) {
    std::snprintf(text, sizeof text, "%.2fM", per_second / 1e6);
  } else if (per_second >= 1e3) {
    std::snprintf(text, sizeof text, "%.1fk", per_second / 1e3);
  } else {
    std::snprintf(text, sizeof text, "%.0f", per_second);
  }
  return text;
}

}  // namespace

MetricsLog::MetricsLog(const std::string& path) : path_(path), out_(path, std::ios::app) {
  if (!out_) throw RuntimeError(path + ": cannot open for writing");
}

void MetricsLog::write(const nlohmann::json& line) {
  out_ << line.dump() << '\n';
  out_.flush();
  if (!out_) throw RuntimeError(path_ + ": write failed (disk full?)");
}

void keep_metrics_up_to(const std::string& path, std::int64_t last_step) {
  if (!fs::exists(path)) return;
  std::ifstream in(path);
  std::string kept, line;
  while (std::getline(in, line)) {
    try {
      if (nlohmann::json::parse(line).value("step", std::int64_t{0}) <= last_step) kept += line + "\n";
    } catch (const nlohmann::json::exception&) {
      // a line cut short by a crash: dropped
    }
  }
  in.close();
  write_file_atomic(path, kept);
}

Reporter::Reporter(const TrainOptions& options, dist::Communicator& world, std::int64_t first_step)
    : config_(options.config), device_(options.device), device_note_(options.device_note), world_size_(world.world_size()), logging_(options.progress),
      run_dir_(options.run_dir) {
  const bool lead = world.rank() == 0;  // the rank that prints and writes run files
  if (lead) {
    fs::create_directories(options.run_dir);
    write_file_atomic(options.run_dir + "/config.json", config::to_json(config_).dump(2) + "\n");
    keep_metrics_up_to(options.run_dir + "/metrics.jsonl", first_step - 1);
    metrics_ = std::make_unique<MetricsLog>(options.run_dir + "/metrics.jsonl");
    tensorboard_ = std::make_unique<TensorBoardWriter>(options.run_dir + "/tb");
  }
  world.barrier();  // the run folder exists before every rank opens its log in it
  log_ = std::make_unique<RunLog>(options.run_dir, world.rank(), options.progress && lead);
}

void Reporter::info(const char* format, ...) {
  if (!logging_) return;
  va_list args;
  va_start(args, format);
  log_->vline(format, args);
  va_end(args);
}

void Reporter::run_started(const dist::Communicators& comms, const RunShape& run, const checkpoint::Found* resume) {
  const dist::Communicator& world = *comms.world;
  info("dist: %s communicator, %d rank(s), this is rank %d (local rank %d), %d CPU threads", world.name().c_str(),
       world.world_size(), world.rank(), world.local_rank(), omp_get_max_threads());
  info("dist: mesh %s", comms.mesh.describe().c_str());
  if (const int stages = comms.mesh.size(dist::Axis::pipeline); stages > 1) {
    info("pipeline: %d stages, %s schedule, %lld micro-batches per update (bubble %.0f%% by its model); %s",
         stages, config::to_string(config_.dist.pipeline_schedule).c_str(), static_cast<long long>(run.micro_steps),
         100.0 * parallel::bubble_fraction(config_.dist, int(run.micro_steps)),
         parallel::describe_split(config_.model, parallel::split_layers(config_), stages).c_str());
  }
  if (!device_note_.empty()) info("train: %s", device_note_.c_str());
  if (resume) {
    info("train: resuming from %s (step %lld)", resume->dir.c_str(), static_cast<long long>(run.first_step - 1));
  }
  if (!run.init_note.empty()) info("train: model.init_from: rank %d %s", world.rank(), run.init_note.c_str());
  for (const std::string& note : run.task_notes) info("train: %s", note.c_str());
  info("%s", run.attention.c_str());
  if (!config_.train.deterministic) {
    info("train: deterministic false: on a GPU the bf16 tensor-core flash attention backward (head size 64 or "
         "128) takes its single pass, dQ summed by atomics in an order that varies run to run (not bitwise "
         "reproducible)");
  }
  info("train: %lld parameters, %lld train samples of %d tokens, %d data-parallel rank(s) x %lld micro-step(s) "
       "of %d per update, ZeRO %lld",
       static_cast<long long>(run.num_params), static_cast<long long>(run.train_samples),
       int(config_.model.context_length), comms.readers(), static_cast<long long>(run.micro_steps),
       int(config_.train.micro_batch_size), static_cast<long long>(config_.dist.zero_stage));
  state_bytes_ = run.state_bytes;
  info("train: this rank holds %s of weights, gradients and optimizer state%s", format_bytes(double(state_bytes_)).c_str(),
       config_.dist.zero_stage == 3 ? (config_.dist.reshard_after_forward
                                           ? " (ZeRO 3: its shards and the slots units are gathered into)"
                                           : " (ZeRO 3: its shards, a slot for every layer and the ends' slots)")
                                    : "");
}

void Reporter::checkpoint_saved(std::int64_t step, const checkpoint::Committed& saved, const SaveStall& stall) {
  const double mb = double(saved.bytes) / 1e6;
  const double rate = mb / std::max(saved.write_seconds, 1e-9);
  const std::string name = fs::path(saved.dir).filename().string();
  if (stall.background) {
    info("checkpoint %s: %.1f MB written in %.2f s (%.0f MB/s) in the background; training stalled %.4f s "
         "(%.4f s of it waiting for the previous save); the staging copy took %.3f s",
         saved.dir.c_str(), mb, saved.write_seconds, rate, stall.stall_s, stall.waited_s, stall.copy_s);
  } else {
    info("checkpoint %s: %.1f MB written in %.2f s (%.0f MB/s); training stalled %.4f s (synchronous save)",
         saved.dir.c_str(), mb, saved.write_seconds, rate, stall.stall_s);
  }
  if (metrics_) {
    metrics_->write({{"step", step}, {"checkpoint", name}, {"checkpoint_bytes", saved.bytes},
                     {"checkpoint_write_s", saved.write_seconds}, {"checkpoint_mb_per_s", rate},
                     {"checkpoint_stall_s", stall.stall_s}, {"checkpoint_waited_s", stall.waited_s},
                     {"checkpoint_copy_s", stall.copy_s},
                     {"checkpoint_background", stall.background}});
  }
}

void Reporter::start_clock() { start_ = Clock::now(); }

double Reporter::elapsed() const { return std::chrono::duration<double>(Clock::now() - start_).count(); }

void Reporter::step_started(std::int64_t step) { log_->step_started(step); }

void Reporter::update(std::int64_t step, const StepResult& result) {
  const auto& tc = config_.train;
  const double elapsed_s = elapsed();
  const double tokens_per_s = double(tc.global_batch_size) * double(config_.model.context_length) / result.seconds;
  // MFU against the configured per-device peak (none is known for CPUs: then null).
  const nlohmann::json mfu =
      tc.peak_tflops > 0
          ? nlohmann::json(tokens_per_s * plan::flops_per_token(config_.model) / (tc.peak_tflops * 1e12 * world_size_))
          : nlohmann::json(nullptr);
  // Memory: of the process on the CPU backend; of the GPU (its peak sampled here) on CUDA.
  MemoryUse memory = process_memory();
  if (device_ == Device::cuda) {
    const ops::DeviceMemoryUse gpu = ops::device_memory_use();
    device_peak_ = std::max(device_peak_, gpu.device_used);
    memory = {gpu.device_used, device_peak_};
  }
  if (metrics_) {
    // Each mesh axis's collectives in this update, kind -> [calls, bytes sent], and their bytes.
    const auto by_kind = [](const dist::Traffic& sent) {
      nlohmann::json out = nlohmann::json::object();
      for (int k = 0; k < dist::Traffic::kinds; ++k) {
        if (sent.calls[k] > 0) out[dist::Traffic::name(dist::Traffic::Kind(k))] = {sent.calls[k], sent.bytes[k]};
      }
      return out;
    };
    nlohmann::json line = {{"step", step}, {"loss", result.loss}, {"lr", result.lr}, {"grad_norm", result.grad_norm},
                       {"tokens_per_s", tokens_per_s}, {"mfu", mfu}, {"elapsed_s", elapsed_s},
                       {"memory_bytes", memory.current}, {"peak_memory_bytes", memory.peak},
                       {"state_bytes", state_bytes_}, {"pipeline_wait_s", result.pipeline_wait_s}};
    double comm_wait_s = 0;
    for (const dist::AxisRow& row : dist::mesh_axes) {
      const dist::Traffic& sent = result.sent[row.axis];
      line[std::string(row.metrics_prefix) + "collectives"] = by_kind(sent);
      line[std::string(row.metrics_prefix) + "sent_bytes"] = sent.total_bytes();
      if (row.in_comm_wait) comm_wait_s += sent.wait_s;
      // Each model-parallel axis's share of it on its own (the data axis's is the rest).
      if (row.in_comm_wait && row.axis != dist::Axis::data) line[std::string(row.metrics_prefix) + "comm_wait_s"] = sent.wait_s;
    }
    line["comm_wait_s"] = comm_wait_s;
    for (std::size_t k = 0; k < result.source_tokens.size(); ++k) {  // a mixture's tokens per source
      line["tokens_seen/" + config_.data.train.name(k)] = result.source_tokens[k];
    }
    const std::pair<const char*, double> moe[] = {{"aux_loss", result.aux_loss}, {"z_loss", result.z_loss},
                                                  {"load_imbalance", result.load_imbalance},
                                                  {"dropped_frac", result.dropped_frac}};
    if (result.moe) {
      for (const auto& [name, value] : moe) line[name] = value;
    }
    metrics_->write(line);
    if (result.moe) {
      for (const auto& [name, value] : moe) tensorboard_->scalar(name, value, step);
    }
    tensorboard_->scalar("loss", result.loss, step);
    tensorboard_->scalar("lr", result.lr, step);
    tensorboard_->scalar("grad_norm", result.grad_norm, step);
    tensorboard_->scalar("tokens_per_s", tokens_per_s, step);
    if (!mfu.is_null()) tensorboard_->scalar("mfu", mfu.get<double>(), step);
    tensorboard_->scalar("memory_gb", double(memory.current) / 1e9, step);
    for (std::size_t k = 0; k < result.source_tokens.size(); ++k) {
      tensorboard_->scalar("tokens_seen/" + config_.data.train.name(k), double(result.source_tokens[k]), step);
    }
  }
  if (logging_ && (step % tc.log_every == 0 || step == 1 || step == tc.max_steps)) {
    const double eta = elapsed_s / double(step) * double(tc.max_steps - step);
    char mfu_text[160] = "";
    if (!mfu.is_null()) std::snprintf(mfu_text, sizeof mfu_text, " | mfu %.1f%%", 100.0 * mfu.get<double>());
    if (config_.dist.pipeline_parallel > 1) {  // rank 0's stage: the time it waited for the others
      const std::size_t used = std::strlen(mfu_text);
      std::snprintf(mfu_text + used, sizeof mfu_text - used, " | bubble %.0f%%",
                    100.0 * result.pipeline_wait_s / std::max(result.seconds, 1e-9));
    }
    if (result.moe) {  // the router's statistics after the norm
      const std::size_t used = std::strlen(mfu_text);
      std::snprintf(mfu_text + used, sizeof mfu_text - used, " | aux %.4f | z %.3f | imbalance %.2f | dropped %.3f",
                    result.aux_loss, result.z_loss, result.load_imbalance, result.dropped_frac);
    }
    log_->line("step %lld/%lld | loss %.4f | lr %.2e | norm %.3f | %s tok/s%s | mem %.2f GB (peak %.2f, state %s) | "
               "%s elapsed, ETA %s",
               static_cast<long long>(step), static_cast<long long>(tc.max_steps), result.loss, result.lr,
               result.grad_norm, format_rate(tokens_per_s).c_str(), mfu_text, double(memory.current) / 1e9,
               double(memory.peak) / 1e9, format_bytes(double(state_bytes_)).c_str(), format_duration(elapsed_s).c_str(),
               format_duration(eta).c_str());
  }
}

void Reporter::skipped(std::int64_t step, std::int64_t bad_in_a_row) {
  if (metrics_) metrics_->write({{"step", step}, {"skipped", true}, {"bad_steps_in_a_row", bad_in_a_row}});
  info("step %lld/%lld | non-finite loss or gradient norm: update skipped (%lld in a row)",
       static_cast<long long>(step), static_cast<long long>(config_.train.max_steps),
       static_cast<long long>(bad_in_a_row));
}

void Reporter::validation(std::int64_t step, const Validation& validation) {
  // (name, value) in the order the line shows them: val_loss, each set's, each task score.
  std::vector<std::pair<std::string, double>> figures;
  if (validation.has_loss) figures.emplace_back("val_loss", validation.val_loss);
  for (const auto& [name, loss] : validation.sets) figures.emplace_back("val_loss/" + name, loss);
  figures.insert(figures.end(), validation.scores.begin(), validation.scores.end());
  std::string text;
  for (const auto& [name, value] : figures) {
    char part[160];
    std::snprintf(part, sizeof part, " | %s %.4f", name.c_str(), value);
    text += part;
  }
  if (metrics_) {
    nlohmann::json line = {{"step", step}};
    for (const auto& [name, value] : figures) {
      line[name] = value;
      tensorboard_->scalar(name, value, step);
    }
    metrics_->write(line);
    for (const auto& [name, result] : validation.tasks) {
      char file[32];
      std::snprintf(file, sizeof file, "/step_%08lld.json", static_cast<long long>(step));
      const std::string dir = run_dir_ + "/tasks/" + name;
      fs::create_directories(dir);
      write_file_atomic(dir + file, to_json(result).dump() + "\n");
    }
  }
  info("step %lld/%lld%s", static_cast<long long>(step), static_cast<long long>(config_.train.max_steps),
       text.c_str());
}

void Reporter::op_profile(double seconds) {
  double total = 0.0;
  for (const auto& op : ops::profile_report()) total += op.seconds;
  log_->line("op time (%.2f s in ops of %.2f s in all):", total, seconds);
  for (const auto& op : ops::profile_report()) {
    log_->line("  %-20s %8lld calls %9.3f s %5.1f%%", op.name.c_str(), static_cast<long long>(op.calls), op.seconds,
               100.0 * op.seconds / seconds);
  }
}

}  // namespace llmtrain::train
