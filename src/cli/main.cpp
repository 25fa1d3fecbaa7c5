// llmtrain's entry point: parses the command line and turns errors into exit codes.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "cli/commands.h"
#include "llmtrain/build_info.h"
#include "llmtrain/git_revision.h"
#include "core/error.h"
#include "core/strings.h"
#include "dist/communicator.h"

namespace {

// Messages are one line: a library message with line breaks is folded, bytes that are not
// UTF-8 (user text echoed back) are shown escaped, and a message is cut at a few kilobytes.
std::string one_line(std::string text) {
  constexpr std::size_t max_bytes = 2000;
  std::replace(text.begin(), text.end(), '\n', ' ');
  while (!text.empty() && text.back() == ' ') text.pop_back();
  text = llmtrain::escape_text(text);
  if (text.size() > max_bytes) {
    std::size_t cut = max_bytes;
    while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) --cut;  // not inside a character
    text = text.substr(0, cut) + "... (message cut)";
  }
  return text;
}

// This process's rank as its launcher (mpirun or srun) gave it; 0 when started alone.
int launcher_rank() {
  for (const char* name : {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"}) {
    if (const char* value = std::getenv(name)) return std::atoi(value);
  }
  return 0;
}

// Under mpirun or srun every rank meets the same bad input; only the first reports it.
bool is_first_rank() { return launcher_rank() == 0; }

int report(const std::string& message, llmtrain::ExitCode code) {
  if (llmtrain::dist::leaving_alone()) {  // no other rank met it: this rank says it, whichever it is
    std::cerr << "llmtrain: error: rank " << launcher_rank() << ": " << one_line(message)
              << " (this rank alone; stopping the job)" << std::endl;
  } else if (code != llmtrain::ExitCode::bad_input || is_first_rank()) {
    std::cerr << "llmtrain: error: " << one_line(message) << std::endl;
  } else {
    // Every rank met the same bad input and the first one says it. A launcher ends the job when
    // the first rank exits with an error, so this one waits a moment: else its exit could end the
    // job (and the first rank) before that line is out.
    std::this_thread::sleep_for(std::chrono::seconds(2));
  }
  return static_cast<int>(code);
}

}  // namespace

int main(int argc, char** argv) {
  using llmtrain::ExitCode;
  CLI::App app{"llmtrain: a standalone trainer for GPT-2 and Llama style language models", "llmtrain"};
  app.set_version_flag("--version", std::string("llmtrain ") + llmtrain::build::version + " (" +
                                        llmtrain::build::git_revision + ")");
  app.require_subcommand(1);
  app.fallthrough(false);

  const std::vector<llmtrain::cli::Command> commands = {
      llmtrain::cli::add_info_command(app),
      llmtrain::cli::add_check_config_command(app),
      llmtrain::cli::add_tokenize_command(app),
      llmtrain::cli::add_train_command(app),
      llmtrain::cli::add_eval_command(app),
      llmtrain::cli::add_generate_command(app),
      llmtrain::cli::add_export_command(app),
      llmtrain::cli::add_plan_command(app),
      llmtrain::cli::add_inspect_command(app),
  };

  // CLI11 would only say "A subcommand is required" for a misspelt one.
  if (argc > 1 && argv[1][0] != '-') {
    std::vector<std::string> names;
    for (const auto* sub : app.get_subcommands({})) names.push_back(sub->get_name());
    if (std::find(names.begin(), names.end(), argv[1]) == names.end()) {
      const std::string near = llmtrain::closest_match(argv[1], names);
      return report("unknown subcommand '" + std::string(argv[1]) + "'" +
                        (near.empty() ? "" : "; did you mean '" + near + "'?") +
                        " (subcommands: " + llmtrain::join_quoted(names, ", ", "") + ")",
                    ExitCode::bad_input);
    }
  }

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) return app.exit(e);  // --help, --version
    return report(std::string(e.what()) + " (see 'llmtrain --help')", ExitCode::bad_input);
  }

  try {
    for (const auto& command : commands) {
      if (command.app->parsed()) return command.run();
    }
    return report("no subcommand given", ExitCode::bad_input);
  } catch (const llmtrain::Error& e) {
    return report(e.what(), e.code());
  } catch (const std::bad_alloc&) {
    return report("out of memory", ExitCode::runtime_failure);
  } catch (const std::exception& e) {
    return report(e.what(), ExitCode::runtime_failure);
  }
}
