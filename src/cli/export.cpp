// llmtrain export: a checkpoint as Hugging Face transformers files.
#include <cstdio>
#include <memory>

#include "checkpoint/checkpoint.h"
#include "cli/commands.h"

namespace llmtrain::cli {

Command add_export_command(CLI::App& parent) {
  struct Options {
    std::string checkpoint, output, format = "hf";
  };
  auto o = std::make_shared<Options>();
  CLI::App* app = parent.add_subcommand("export", "Write a checkpoint's weights for other tools");
  app->add_option("--checkpoint", o->checkpoint, "Checkpoint folder, checkpoints folder or run folder")->required();
  app->add_option("--output", o->output, "Folder for model.safetensors and config.json")->required();
  app->add_option("--format", o->format, "hf: Hugging Face transformers (GPT2LMHeadModel)")
      ->check(CLI::IsMember({"hf"}))
      ->capture_default_str();

  return {app, [o] {
            const checkpoint::Found found = checkpoint::find(o->checkpoint);
            const auto loaded = checkpoint::load_model(found);
            model::Model& model = *loaded;
            checkpoint::export_hf(model, o->output);
            std::printf("export: %s -> %s/model.safetensors, %s/config.json (%s)\n", found.dir.c_str(),
                        o->output.c_str(), o->output.c_str(), checkpoint::hf_architecture(model.config()).c_str());
            return 0;
          }};
}

}  // namespace llmtrain::cli
