// llmtrain inspect: what a checkpoint holds, and whether every file verifies.
#include <cstdio>
#include <filesystem>
#include <memory>

#include "checkpoint/checkpoint.h"
#include "checkpoint/safetensors.h"
#include "cli/commands.h"
#include "core/error.h"
#include "core/json_file.h"
#include "core/strings.h"

namespace llmtrain::cli {

Command add_inspect_command(CLI::App& parent) {
  auto path = std::make_shared<std::string>();
  CLI::App* app = parent.add_subcommand("inspect", "Show a checkpoint: step, config, files and their checksums");
  app->add_option("--checkpoint", *path, "Checkpoint folder, checkpoints folder or run folder")->required();

  return {app, [path] {
            // Not checkpoint::find(), which stops at the first damaged file: inspect reports every file.
            const std::string dir = checkpoint::resolve_dir(*path);
            const auto state = read_json_file(dir + "/state.json", "the state.json of a checkpoint");
            const bool complete = std::filesystem::exists(dir + "/COMPLETE");
            const auto& m = state.at("config").at("model");
            std::printf("checkpoint %s%s\n", dir.c_str(), complete ? "" : "  (INCOMPLETE: no COMPLETE file)");
            std::printf("  step %lld, %lld tokens seen, world size %lld, ZeRO %lld, sampler epoch %lld next sample %lld\n",
                        static_cast<long long>(state.value("step", 0)), static_cast<long long>(state.value("tokens_seen", 0)),
                        static_cast<long long>(state.value("world_size", 0)), static_cast<long long>(state.value("zero_stage", 0)),
                        static_cast<long long>(state.at("sampler").value("epoch", 0)),
                        static_cast<long long>(state.at("sampler").value("next_sample", 0)));
            std::printf("  model %s: %s layers, d_model %s, %s heads, vocab %s, context %s\n", m.at("arch").get<std::string>().c_str(),
                        m.at("n_layer").dump().c_str(), m.at("d_model").dump().c_str(), m.at("n_head").dump().c_str(),
                        m.at("vocab_size").dump().c_str(), m.at("context_length").dump().c_str());
            bool all_ok = complete;
            for (const auto& [file, info] : state.at("files").items()) {
              const std::string full = dir + "/" + file;
              std::string verdict = "ok";
              if (!std::filesystem::exists(full)) {
                verdict = "MISSING";
              } else if (checkpoint::file_crc32(full) != info.value("crc32", std::uint64_t{0})) {
                verdict = "CHECKSUM MISMATCH";
              }
              all_ok = all_ok && verdict == "ok";
              std::printf("  %-26s %12s  crc32 %08llx  %s\n", file.c_str(), format_bytes(double(info.value("bytes", 0))).c_str(),
                          static_cast<unsigned long long>(info.value("crc32", std::uint64_t{0})), verdict.c_str());
            }
            std::printf("%s\n", all_ok ? "every file verifies" : "this checkpoint is damaged");
            return all_ok ? 0 : static_cast<int>(ExitCode::bad_input);
          }};
}

}  // namespace llmtrain::cli
