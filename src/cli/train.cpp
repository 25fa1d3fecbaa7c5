// llmtrain train: run a config.
#include <cstdio>
#include <filesystem>
#include <memory>

#include "cli/commands.h"
#include "config/config.h"
#include "core/error.h"
#include "train/run.h"

namespace llmtrain::cli {

Command add_train_command(CLI::App& parent) {
  struct Options {
    std::string config_path;
    std::vector<std::string> sets;
    std::string run_dir;
    std::string device = "auto";
    bool profile_ops = false;
    std::string resume = "auto";
  };
  auto options = std::make_shared<Options>();
  CLI::App* app = parent.add_subcommand("train", "Train a model as a config describes");
  app->add_option("--config", options->config_path, "JSON config file")->required();
  app->add_option("--set", options->sets, "Override a key by its dotted path: --set train.max_steps=100")
      ->type_name("KEY=VALUE")
      ->allow_extra_args(false);
  app->add_option("--run-dir", options->run_dir, "Run folder (default: runs/<config name>)");
  app->add_option("--device", options->device, "auto | cpu | cuda (auto: cuda when this build has CUDA and every rank of a node has a visible GPU of its own, else cpu; the log says which and why)")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  app->add_option("--resume", options->resume,
                  "auto: continue from the newest complete checkpoint of the run, if any | never | a checkpoint path")
      ->capture_default_str();
  app->add_flag("--profile-ops", options->profile_ops, "Print the time spent in each op at the end");

  return {app, [options] {
            std::vector<config::Override> overrides;
            for (const auto& s : options->sets) overrides.push_back({s});
            train::TrainOptions o;
            o.config = config::load_config(options->config_path, overrides);
            o.run_dir = options->run_dir.empty()
                            ? "runs/" + std::filesystem::path(options->config_path).stem().string()
                            : options->run_dir;
            o.device = options->device == "cuda" ? Device::cuda : Device::cpu;
            o.device_auto = options->device == "auto";
            o.profile_ops = options->profile_ops;
            o.resume = options->resume;
            const train::TrainSummary s = train::run_training(o);
            if (s.preempted) {
              if (s.lead) std::fprintf(stderr, "llmtrain: stopped by a signal; checkpoint %s written; run the same command to resume\n", s.last_checkpoint.c_str());
              return static_cast<int>(ExitCode::preempted);
            }
            if (!s.lead) return 0;  // rank 0 reports for the job
            std::printf("train: %lld steps in %.1f s; final loss %.4f", static_cast<long long>(s.steps), s.seconds,
                        s.final_loss);
            if (s.final_val_loss >= 0) std::printf(", val_loss %.4f", s.final_val_loss);
            std::printf("; checkpoint %s\n", s.last_checkpoint.c_str());
            return 0;
          }};
}

}  // namespace llmtrain::cli
