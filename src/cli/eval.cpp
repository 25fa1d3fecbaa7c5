// llmtrain eval: validation loss of a checkpoint.
#include <cstdio>
#include <memory>

#include "checkpoint/checkpoint.h"
#include "cli/commands.h"
#include "core/error.h"
#include "data/dataset.h"
#include "data/shard.h"
#include "train/trainer.h"

namespace llmtrain::cli {

Command add_eval_command(CLI::App& parent) {
  struct Options {
    std::string checkpoint, data;
    std::int64_t batches = 0;
  };
  auto o = std::make_shared<Options>();
  CLI::App* app = parent.add_subcommand("eval", "Validation loss of a checkpoint");
  app->add_option("--checkpoint", o->checkpoint, "Checkpoint folder, checkpoints folder or run folder")->required();
  app->add_option("--data", o->data, "Token shards (path or glob; default: the run's data.val)");
  app->add_option("--batches", o->batches, "Global batches to evaluate (default: the run's train.eval_batches)")
      ->check(CLI::PositiveNumber);

  return {app, [o] {
            const checkpoint::Found found = checkpoint::find(o->checkpoint);
            const config::Config& config = found.config;
            const std::vector<std::string> patterns = o->data.empty() ? config.data.val : std::vector{o->data};
            if (patterns.empty()) throw InputError("--data: the run has no data.val; name the shards to evaluate");
            const data::TokenDataset data(data::expand_paths(patterns, o->data.empty() ? "data.val" : "--data"),
                                          config.model.context_length, std::uint32_t(config.model.vocab_size));
            if (data.num_samples() < config.train.global_batch_size) {
              throw InputError("--data: " + std::to_string(data.num_samples()) +
                               " samples, fewer than one global batch (" +
                               std::to_string(config.train.global_batch_size) + ")");
            }
            const auto loaded = checkpoint::load_model(found);
            model::Model& model = *loaded;
            const std::int64_t batches = o->batches > 0 ? o->batches : config.train.eval_batches;
            const double loss = train::evaluate(model, data, config, batches);
            std::printf("eval: %s step %lld: val_loss %.4f\n", found.dir.c_str(),
                        static_cast<long long>(found.state.value("step", std::int64_t{0})), loss);
            return 0;
          }};
}

}  // namespace llmtrain::cli
