#include "train/trainer.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <optional>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint.h"
#include "core/error.h"
#include "data/shard.h"
#include "dist/nccl_communicator.h"
#include "ops/ops.h"
#include "ops/profile.h"
#include "train/adamw.h"
#include "train/grad_sync.h"
#include "train/plan.h"
#include "train/run_log.h"
#include "train/tensorboard.h"
#include "train/schedule.h"

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

// Appends one JSON object per line and flushes, so a killed run keeps every line it logged.
class MetricsLog {
 public:
  explicit MetricsLog(const std::string& path) : path_(path), out_(path, std::ios::app) {
    if (!out_) throw RuntimeError(path + ": cannot open for writing");
  }
  void write(const nlohmann::json& line) {
    out_ << line.dump() << '\n';
    out_.flush();
    if (!out_) throw RuntimeError(path_ + ": write failed (disk full?)");
  }

 private:
  std::string path_;
  std::ofstream out_;
};

// The checkpoint to continue from: --resume never: none (and the run folder must be new);
// auto: the newest complete checkpoint that verifies, skipping damaged ones with a warning; PATH:
// that one, or exit 2 naming what is wrong.
std::optional<checkpoint::Found> find_resume_point(const TrainOptions& options, const std::string& root, bool lead) {
  const bool has_metrics = fs::exists(options.run_dir + "/metrics.jsonl");
  std::optional<checkpoint::Found> found;
  if (options.resume == "never") {
    if (has_metrics) {
      throw InputError(options.run_dir + ": already holds a run (metrics.jsonl); choose another --run-dir or --resume auto");
    }
  } else if (options.resume == "auto") {
    for (const auto& dir : checkpoint::complete_checkpoints(root)) {
      try {
        found = checkpoint::find(dir);
        break;
      } catch (const InputError& e) {
        if (lead) std::fprintf(stderr, "train: warning: skipping damaged checkpoint: %s\n", e.what());
      }
    }
  } else {
    found = checkpoint::find(options.resume);
  }
  if (!found) return found;
  // The run must continue the same model on the same data order.
  const config::Config& saved = found->config;
  const config::Config& now = options.config;
  const auto saved_model = config::to_json(saved)["model"], now_model = config::to_json(now)["model"];
  for (const auto& [key, value] : saved_model.items()) {
    // Where the weights came from and which attention kernels run do not change the model.
    if (key != "init_from" && key != "attention" && now_model[key] != value) {
      throw InputError("model." + key + ": the checkpoint " + found->dir + " has " + value.dump() + ", the config " +
                       now_model[key].dump() + "; use --resume never and a new --run-dir for another model");
    }
  }
  if (saved.train.global_batch_size != now.train.global_batch_size) {
    throw InputError("train.global_batch_size: the checkpoint " + found->dir + " was trained with " +
                     std::to_string(saved.train.global_batch_size) + "; resuming needs the same data order");
  }
  return found;
}

// Rewrites metrics.jsonl keeping only the lines of steps up to `last_step` (all of them when the
// file does not exist: nothing to do).
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
  std::ofstream out(path + ".tmp", std::ios::trunc);
  out << kept;
  out.close();
  if (!out) throw RuntimeError(path + ": cannot rewrite");
  fs::rename(path + ".tmp", path);
}

// SIGTERM, SIGINT and SIGUSR1 ask the run to stop at the next update boundary (after a
// checkpoint); a second SIGINT ends the process at once.
std::atomic<int> stop_requests{0};
extern "C" void on_stop_signal(int signal) {
  if (signal == SIGINT && stop_requests.load() > 0) std::_Exit(128 + SIGINT);
  stop_requests.fetch_add(1);
}

class SignalWatch {
 public:
  SignalWatch() {
    stop_requests = 0;
    struct sigaction action {};
    action.sa_handler = on_stop_signal;
    sigemptyset(&action.sa_mask);
    for (int i = 0; i < 3; ++i) sigaction(signals_[i], &action, &previous_[i]);
  }
  ~SignalWatch() {
    for (int i = 0; i < 3; ++i) sigaction(signals_[i], &previous_[i], nullptr);
  }
  SignalWatch(const SignalWatch&) = delete;
  SignalWatch& operator=(const SignalWatch&) = delete;
  bool raised() const { return stop_requests.load() > 0; }

 private:
  static constexpr int signals_[3] = {SIGTERM, SIGINT, SIGUSR1};
  struct sigaction previous_[3];
};

}  // namespace

double evaluate(model::Model& model, const data::TokenDataset& data, const config::Config& config,
                std::int64_t batches, dist::Communicator* comm) {
  const auto& t = config.train;
  const int T = int(config.model.context_length), B = int(t.micro_batch_size);
  const int W = comm ? comm->world_size() : 1, rank = comm ? comm->rank() : 0;
  data::DistributedSampler sampler({data.num_samples(), t.global_batch_size, B, W, rank, false, 0});
  batches = std::min(batches, sampler.updates_per_epoch());
  std::vector<std::int64_t> indices(static_cast<std::size_t>(B));
  std::vector<std::int32_t> inputs(std::size_t(B) * T), targets(inputs.size());
  double sum = 0.0;
  std::int64_t count = 0;
  for (std::int64_t k = 0; k < batches; ++k) {
    for (std::int64_t m = 0; m < sampler.micro_steps(); ++m) {
      sampler.micro_batch(m, indices);
      for (int b = 0; b < B; ++b) data.read_sample(indices[b], inputs.data() + b * T, targets.data() + b * T);
      sum += model.forward(inputs.data(), targets.data(), B, T, 0.0f);
      count += std::int64_t(B) * T;
    }
    sampler.advance();
  }
  double totals[2] = {sum, double(count)};
  if (comm) comm->all_reduce_sum(totals, 2);
  return totals[0] / totals[1];
}

TrainSummary run_training(const TrainOptions& options) {
  const config::Config& config = options.config;
  const auto& tc = config.train;
  const auto& oc = config.optim;
  const Device device = options.device;
  if (device == Device::cuda) {
    std::string why;
    if (!ops::cuda_available(&why)) throw InputError("--device cuda: no usable CUDA device: " + why);
  }
  if (config.data.train.empty()) throw InputError("data.train: no training data given");
  const std::string checkpoint_root =
      config.checkpoint.dir.empty() ? options.run_dir + "/checkpoints" : config.checkpoint.dir;
  const std::unique_ptr<dist::Communicator> comm = dist::make_communicator(false, config.dist.timeout_s);
  const int rank = comm->rank(), W = comm->world_size();
  const bool lead = rank == 0;  // the rank that prints and writes run files
  const bool progress = options.progress && lead;
  // On GPUs: one per process (by local rank), and NCCL for the gradients and ZeRO's shards; the
  // host communicator keeps the small collectives (losses, checksums, barriers).
  std::unique_ptr<dist::Communicator> device_comm;
  if (device == Device::cuda) {
    const int gpu = ops::use_cuda_device(comm->local_rank());
    if (W > 1) {
#if LLMTRAIN_HAVE_CUDA
      device_comm = dist::make_nccl_communicator(*comm, gpu, config.dist.timeout_s);
#else
      (void)gpu;
#endif
    }
  }
  dist::Communicator& grad_comm = device_comm ? *device_comm : *comm;
  const std::optional<checkpoint::Found> resume = find_resume_point(options, checkpoint_root, lead);

  // Data first: a bad shard stops the run before anything is written.
  const int T = int(config.model.context_length), B = int(tc.micro_batch_size);
  const auto vocab = std::uint32_t(config.model.vocab_size);
  const data::TokenDataset train_data(data::expand_paths(config.data.train, "data.train"), T, vocab);
  std::unique_ptr<data::TokenDataset> val_data;
  if (!config.data.val.empty()) {
    val_data = std::make_unique<data::TokenDataset>(data::expand_paths(config.data.val, "data.val"), T, vocab);
    if (val_data->num_samples() < tc.global_batch_size) {
      throw InputError("data.val: " + std::to_string(val_data->num_samples()) +
                       " samples, fewer than one global batch (" + std::to_string(tc.global_batch_size) + ")");
    }
  }
  const std::int64_t accum = config::grad_accum_steps(config, W);
  const data::SamplerOptions sampler_options{train_data.num_samples(), tc.global_batch_size, B, W, rank,
                                             config.data.shuffle, std::uint64_t(config.data.seed)};
  data::SamplerState sampler_state;
  std::int64_t first_step = 1, tokens_seen = 0;
  if (resume) {
    const auto& state = resume->state;
    sampler_state = {state.at("sampler").at("epoch").get<std::int64_t>(),
                     state.at("sampler").at("next_sample").get<std::int64_t>()};
    first_step = state.at("step").get<std::int64_t>() + 1;
    tokens_seen = state.at("tokens_seen").get<std::int64_t>();
  }
  data::BatchLoader loader(train_data, sampler_options, sampler_state);

  const auto model_owner = model::make_model(config.model, device, tc.recompute,
                                             model::precision_dtype(tc.precision));
  model::Model& model = *model_owner;
  // Weights are initialised, read and written on the CPU: on a GPU through a host copy.
  const auto host_owner = device == Device::cpu ? nullptr : model::make_model(config.model, Device::cpu);
  model::Model& host = host_owner ? *host_owner : model;
  if (resume) {
    checkpoint::load_weights(*resume, host);
  } else if (config.model.init_from.empty()) {
    host.init_weights(std::uint64_t(tc.seed));
  } else {
    checkpoint::import_hf(config.model.init_from, host);
  }
  const std::int64_t P = model.num_params();
  comm->broadcast(host.params().as<float>(), P, 0);  // identical weights on every rank
  if (host_owner) ops::copy(model.params(), host.params());
  // (One GPU process has nothing to shard, and no device communicator.)
  GradientSync sync(grad_comm, model.grads().as<float>(), P, config.dist.bucket_mb,
                    device == Device::cuda && W == 1 ? 0 : int(config.dist.zero_stage), device);
  AdamW optimizer(sync.begin(), sync.end(), device);
  const std::int64_t shard = sync.end() - sync.begin();
  const auto host_vector = [](const Tensor& t) {
    std::vector<float> out(std::size_t(t.numel()));
    ops::copy(Tensor(out.data(), DType::f32, Device::cpu, {t.numel()}), t);
    return out;
  };
  if (resume) {
    std::vector<float> m(static_cast<std::size_t>(shard)), v(static_cast<std::size_t>(shard));
    checkpoint::load_optimizer(*resume, sync.begin(), sync.end(), m.data(), v.data());
    ops::copy(optimizer.m(), Tensor(m.data(), DType::f32, Device::cpu, {shard}));
    ops::copy(optimizer.v(), Tensor(v.data(), DType::f32, Device::cpu, {shard}));
  }

  const nlohmann::json resolved = config::to_json(config);
  std::unique_ptr<MetricsLog> metrics;
  std::unique_ptr<TensorBoardWriter> tensorboard;
  if (lead) {
    fs::create_directories(options.run_dir);
    std::ofstream out(options.run_dir + "/config.json");
    out << resolved.dump(2) << "\n";
    if (!out) throw RuntimeError(options.run_dir + "/config.json: cannot write");
    // Lines past the resumed step are logged again as those steps are redone.
    keep_metrics_up_to(options.run_dir + "/metrics.jsonl", first_step - 1);
    metrics = std::make_unique<MetricsLog>(options.run_dir + "/metrics.jsonl");
    tensorboard = std::make_unique<TensorBoardWriter>(options.run_dir + "/tb");
  }
  comm->barrier();  // the run folder exists before every rank opens its log in it
  RunLog log(options.run_dir, rank, progress);
  const bool logging = options.progress;  // every rank logs to its file; rank 0 also to stderr
  if (logging) log.line("dist: %s communicator, %d rank(s), this is rank %d (local rank %d)", comm->name().c_str(), W, rank, comm->local_rank());
  if (logging && resume) {
    log.line("train: resuming from %s (step %lld)", resume->dir.c_str(),
                 static_cast<long long>(first_step - 1));
  }
  if (logging) {
    log.line(
                 "train: %lld parameters, %lld train samples of %d tokens, %d rank(s) x %lld micro-step(s) of %d "
                 "per update, ZeRO %lld",
                 static_cast<long long>(P), static_cast<long long>(train_data.num_samples()), T, W,
                 static_cast<long long>(accum), B, static_cast<long long>(config.dist.zero_stage));
  }

  TrainSummary summary;
  const auto save = [&](std::int64_t step) {
    nlohmann::json state = {{"tokens_seen", tokens_seen},
                            {"sampler", {{"epoch", sampler_state.epoch}, {"next_sample", sampler_state.next_sample}}},
                            {"world_size", W},
                            {"zero_stage", config.dist.zero_stage},
                            {"config", resolved}};
    const auto save_start = Clock::now();
    if (host_owner) ops::copy(host.params(), model.params());
    const std::vector<float> m = host_vector(optimizer.m()), v = host_vector(optimizer.v());
    summary.last_checkpoint = checkpoint::save(
        {checkpoint_root, step, config.checkpoint.keep_last, &host, {optimizer.begin(), optimizer.end(), m.data(), v.data()},
         state},
        *comm);
    if (logging) {
      std::uintmax_t bytes = 0;
      for (const auto& entry : fs::directory_iterator(summary.last_checkpoint)) bytes += entry.file_size();
      const double seconds = std::chrono::duration<double>(Clock::now() - save_start).count();
      log.line("checkpoint %s: %.1f MB in %.2f s (%.0f MB/s)", summary.last_checkpoint.c_str(),
                   double(bytes) / 1e6, seconds, double(bytes) / 1e6 / std::max(seconds, 1e-9));
    }
  };

  ops::enable_profiling(options.profile_ops);
  const auto start = Clock::now();
  const double tokens_per_step = double(tc.global_batch_size) * T;
  const SignalWatch signals;
  std::int64_t bad_in_a_row = 0, device_peak = 0;
  for (std::int64_t step = first_step; step <= tc.max_steps; ++step) {
    const auto step_start = Clock::now();
    log.step_started(step);
    model.zero_grads();
    double loss_sum = 0.0;
    for (std::int64_t m = 0; m < accum; ++m) {
      const data::MicroBatch batch = loader.next();
      // d(mean loss over the whole update)/dlogits: each micro-step adds 1 / (G T) per position.
      loss_sum += model.forward(batch.inputs.data(), batch.targets.data(), B, T, float(1.0 / tokens_per_step));
      if (m + 1 < accum) {
        model.backward();  // no communication before the last micro-step
      } else {
        model.backward([&](std::int64_t ready) { sync.on_ready(ready); });
      }
      sampler_state = batch.after;
    }
    sync.finish();
    // Loss and gradient norm over all ranks; each rank's shard (ZeRO) or the whole buffer (0).
    const Tensor grads(const_cast<float*>(sync.grads()), DType::f32, device, {shard});
    double sums[2] = {loss_sum, ops::sum_squares(grads)};
    if (config.dist.zero_stage == 0) {
      comm->all_reduce_sum(sums, 1);
    } else {
      comm->all_reduce_sum(sums, 2);
    }
    const double loss = sums[0] / tokens_per_step;
    const double grad_norm = std::sqrt(sums[1]);
    const double lr = learning_rate(oc, tc.max_steps, step);
    tokens_seen += std::int64_t(tokens_per_step);
    // NaN guard: a non-finite loss or gradient norm skips the update (the same on every rank,
    // since both are reduced over all ranks).
    if (!std::isfinite(loss) || !std::isfinite(grad_norm)) {
      ++bad_in_a_row;
      if (metrics) metrics->write({{"step", step}, {"skipped", true}, {"bad_steps_in_a_row", bad_in_a_row}});
      if (logging) {
        log.line("step %lld/%lld | non-finite loss or gradient norm: update skipped (%lld in a row)",
                     static_cast<long long>(step), static_cast<long long>(tc.max_steps),
                     static_cast<long long>(bad_in_a_row));
      }
      if (bad_in_a_row >= tc.max_bad_steps) {
        throw RuntimeError(std::to_string(bad_in_a_row) + " updates in a row had a non-finite loss or gradient norm "
                           "(train.max_bad_steps); stopping at step " + std::to_string(step) +
                           ": lower optim.lr or check the data");
      }
      continue;
    }
    bad_in_a_row = 0;
    optimizer.update(model, grads, grad_norm, oc, tc.grad_clip, lr, step);
    sync.gather_params(model.params().as<float>());
    if (W > 1 && config.dist.replica_check_every > 0 && step % config.dist.replica_check_every == 0) {
      if (host_owner) ops::copy(host.params(), model.params());
      check_replicas(*comm, host.params().as<float>(), P, step);
    }
    const double step_seconds = std::chrono::duration<double>(Clock::now() - step_start).count();
    const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
    const double tokens_per_s = tokens_per_step / step_seconds;
    // MFU against the configured per-device peak (none is known for CPUs: then null).
    const nlohmann::json mfu = tc.peak_tflops > 0
                                   ? nlohmann::json(tokens_per_s * flops_per_token(config.model) / (tc.peak_tflops * 1e12 * W))
                                   : nlohmann::json(nullptr);
    // Memory: of the process on the CPU backend; of the GPU (its peak sampled here) on CUDA.
    MemoryUse memory = process_memory();
    if (device == Device::cuda) {
      const ops::DeviceMemoryUse gpu = ops::device_memory_use();
      device_peak = std::max(device_peak, gpu.device_used);
      memory = {gpu.device_used, device_peak};
    }
    if (metrics) {
      metrics->write({{"step", step}, {"loss", loss}, {"lr", lr}, {"grad_norm", grad_norm},
                      {"tokens_per_s", tokens_per_s}, {"mfu", mfu}, {"elapsed_s", elapsed},
                      {"memory_bytes", memory.current}, {"peak_memory_bytes", memory.peak}});
      tensorboard->scalar("loss", loss, step);
      tensorboard->scalar("lr", lr, step);
      tensorboard->scalar("grad_norm", grad_norm, step);
      tensorboard->scalar("tokens_per_s", tokens_per_s, step);
      if (!mfu.is_null()) tensorboard->scalar("mfu", mfu.get<double>(), step);
      tensorboard->scalar("memory_gb", double(memory.current) / 1e9, step);
    }
    summary.final_loss = loss;
    if (logging && (step % tc.log_every == 0 || step == 1 || step == tc.max_steps)) {
      const double eta = elapsed / double(step) * double(tc.max_steps - step);
      char mfu_text[32] = "";
      if (!mfu.is_null()) std::snprintf(mfu_text, sizeof mfu_text, " | mfu %.1f%%", 100.0 * mfu.get<double>());
      log.line("step %lld/%lld | loss %.4f | lr %.2e | norm %.3f | %s tok/s%s | mem %.2f GB (peak %.2f) | %s elapsed, ETA %s",
               static_cast<long long>(step), static_cast<long long>(tc.max_steps), loss, lr, grad_norm,
               format_rate(tokens_per_s).c_str(), mfu_text, double(memory.current) / 1e9, double(memory.peak) / 1e9,
               format_duration(elapsed).c_str(), format_duration(eta).c_str());
    }
    const bool last = step == tc.max_steps;
    if (val_data && ((tc.eval_every > 0 && step % tc.eval_every == 0) || last)) {
      const double val_loss = evaluate(model, *val_data, config, tc.eval_batches, comm.get());
      if (metrics) {
        metrics->write({{"step", step}, {"val_loss", val_loss}});
        tensorboard->scalar("val_loss", val_loss, step);
      }
      summary.final_val_loss = val_loss;
      if (logging) {
        log.line("step %lld/%lld | val_loss %.4f", static_cast<long long>(step),
                     static_cast<long long>(tc.max_steps), val_loss);
      }
    }
    // A stop signal on any rank: all agree at this update boundary, save and stop.
    std::int64_t stop = signals.raised() ? 1 : 0;
    comm->all_reduce_max(&stop, 1);
    if ((config.checkpoint.every > 0 && step % config.checkpoint.every == 0) || last || stop) save(step);
    summary.steps = step;
    if (stop && !last) {
      summary.preempted = true;
      if (logging) log.line("train: stopped by a signal after step %lld; checkpoint written",
                                 static_cast<long long>(step));
      break;
    }
  }
  summary.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  summary.lead = lead;
  if (options.profile_ops) {
    double total = 0.0;
    for (const auto& op : ops::profile_report()) total += op.seconds;
    log.line("op time (%.2f s in ops of %.2f s in all):", total, summary.seconds);
    for (const auto& op : ops::profile_report()) {
      log.line("  %-20s %8lld calls %9.3f s %5.1f%%", op.name.c_str(), static_cast<long long>(op.calls),
                   op.seconds, 100.0 * op.seconds / summary.seconds);
    }
    ops::enable_profiling(false);
  }
  return summary;
}

}  // namespace llmtrain::train
