#include "train/checkpointer.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <vector>

#include "core/error.h"
#include "core/files.h"
#include "ops/buffer.h"

namespace llmtrain::train {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

// SIGTERM, SIGINT and SIGUSR1 ask the run to stop at the next update boundary (after a
// checkpoint); a second SIGINT ends the process at once.
std::atomic<int> stop_requests{0};
extern "C" void on_stop_signal(int signal) {
  if (signal == SIGINT && stop_requests.load() > 0) std::_Exit(128 + SIGINT);
  stop_requests.fetch_add(1);
}

// Checks that `saved` (the checkpoint's config) and `now` agree on every key that must match on
// resume; the message says what would change.
void check_resumable(const config::Config& saved, const config::Config& now, const std::string& dir) {
  const nlohmann::json saved_json = config::to_json(saved), now_json = config::to_json(now);
  for (const auto& [section, keys] : saved_json.items()) {
    for (const auto& [key, value] : keys.items()) {
      const std::string path = section + "." + key;
      if (config::may_change_on_resume(path)) continue;
      const nlohmann::json now_value = now_json.at(section).value(key, nlohmann::json());
      if (now_value == value) continue;
      if (section == "model") {
        throw InputError(path + ": the checkpoint " + dir + " has " + value.dump() + ", the config " +
                         now_value.dump() + "; use --resume never and a new --run-dir for another model");
      }
      throw InputError(path + ": the checkpoint " + dir + " was trained with " + value.dump() +
                       "; resuming needs the same data order");
    }
  }
}

std::vector<float> host_vector(const Tensor& t) {
  std::vector<float> out(std::size_t(t.numel()));
  ops::copy(Tensor(out.data(), DType::f32, Device::cpu, {t.numel()}), t);
  return out;
}

}  // namespace

// Installs the stop handlers for its lifetime and restores the previous ones after.
class StopSignals {
 public:
  StopSignals() {
    stop_requests = 0;
    struct sigaction action {};
    action.sa_handler = on_stop_signal;
    sigemptyset(&action.sa_mask);
    for (int i = 0; i < 3; ++i) sigaction(signals_[i], &action, &previous_[i]);
  }
  ~StopSignals() {
    for (int i = 0; i < 3; ++i) sigaction(signals_[i], &previous_[i], nullptr);
  }
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;
  bool raised() const { return stop_requests.load() > 0; }

 private:
  static constexpr int signals_[3] = {SIGTERM, SIGINT, SIGUSR1};
  struct sigaction previous_[3];
};

std::string checkpoint_root(const TrainOptions& options) {
  return options.config.checkpoint.dir.empty() ? options.run_dir + "/checkpoints" : options.config.checkpoint.dir;
}

std::optional<checkpoint::Found> find_resume_point(const TrainOptions& options, bool lead) {
  const bool has_metrics = path_exists(options.run_dir + "/metrics.jsonl");
  std::optional<checkpoint::Found> found;
  if (options.resume == "never") {
    if (has_metrics) {
      throw InputError(options.run_dir + ": already holds a run (metrics.jsonl); choose another --run-dir or --resume auto");
    }
  } else if (options.resume == "auto") {
    for (const auto& dir : checkpoint::complete_checkpoints(checkpoint_root(options))) {
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
  if (found) check_resumable(found->config, options.config, found->dir);
  return found;
}

Checkpointer::Checkpointer(const TrainOptions& options, dist::Communicator& world, Reporter& reporter)
    : config_(options.config),
      root_(checkpoint_root(options)),
      world_(world),
      reporter_(reporter),
      resolved_(config::to_json(options.config)),
      signals_(std::make_unique<StopSignals>()) {}

Checkpointer::~Checkpointer() = default;

bool Checkpointer::stop_requested() {
  std::int64_t stop = signals_->raised() ? 1 : 0;
  world_.all_reduce_max(&stop, 1);
  return stop != 0;
}

bool Checkpointer::due(std::int64_t step) const {
  return config_.checkpoint.every > 0 && step % config_.checkpoint.every == 0;
}

std::string Checkpointer::save(std::int64_t step, Trainer& trainer) {
  const data::SamplerState sampler = trainer.sampler_state();
  nlohmann::json state = {{"tokens_seen", trainer.tokens_seen()},
                          {"sampler", {{"epoch", sampler.epoch}, {"next_sample", sampler.next_sample}}},
                          {"world_size", world_.world_size()},
                          {"zero_stage", config_.dist.zero_stage},
                          {"config", resolved_}};
  const auto save_start = Clock::now();
  const model::Model& weights = trainer.host_weights();
  const AdamW& optimizer = trainer.optimizer();
  const std::vector<float> m = host_vector(optimizer.m()), v = host_vector(optimizer.v());
  const std::string dir = checkpoint::save(
      {root_, step, config_.checkpoint.keep_last, &weights, {optimizer.begin(), optimizer.end(), m.data(), v.data()},
       state},
      world_);
  if (reporter_.logging()) {
    std::uintmax_t bytes = 0;
    for (const auto& entry : fs::directory_iterator(dir)) bytes += entry.file_size();
    const double seconds = std::chrono::duration<double>(Clock::now() - save_start).count();
    reporter_.info("checkpoint %s: %.1f MB in %.2f s (%.0f MB/s)", dir.c_str(), double(bytes) / 1e6, seconds,
                   double(bytes) / 1e6 / std::max(seconds, 1e-9));
  }
  return dir;
}

}  // namespace llmtrain::train
