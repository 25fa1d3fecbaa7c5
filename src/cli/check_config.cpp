// llmtrain check-config: validate a config (with --set overrides) and print it resolved.
#include <iostream>
#include <memory>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "config/config.h"

namespace llmtrain::cli {

Command add_check_config_command(CLI::App& parent) {
  struct Options {
    std::string config_path;
    std::vector<std::string> sets;
  };
  auto options = std::make_shared<Options>();
  CLI::App* app = parent.add_subcommand(
      "check-config", "Validate a config and print it resolved (defaults filled in) as JSON");
  app->add_option("--config", options->config_path, "JSON config file")->required();
  app->add_option("--set", options->sets, "Override a key by its dotted path: --set model.n_layer=2")
      ->type_name("KEY=VALUE")
      ->allow_extra_args(false);  // one KEY=VALUE per --set

  return {app, [options] {
            std::vector<config::Override> overrides;
            for (const auto& s : options->sets) overrides.push_back({s});
            const config::Config c = config::load_config(options->config_path, overrides);
            std::cout << config::to_json(c).dump(2) << std::endl;
            return 0;
          }};
}

}  // namespace llmtrain::cli
