// Each subcommand registers its options on the parent app and returns how to run it.
#pragma once

#include <functional>

#include <CLI/CLI.hpp>

namespace llmtrain::cli {

struct Command {
  CLI::App* app;            // the parsed subcommand
  std::function<int()> run;  // returns the exit code; throws llmtrain::Error on failure
};

Command add_info_command(CLI::App& parent);
Command add_check_config_command(CLI::App& parent);
Command add_tokenize_command(CLI::App& parent);
Command add_train_command(CLI::App& parent);
Command add_generate_command(CLI::App& parent);
Command add_eval_command(CLI::App& parent);
Command add_export_command(CLI::App& parent);
Command add_plan_command(CLI::App& parent);
Command add_inspect_command(CLI::App& parent);

}  // namespace llmtrain::cli
