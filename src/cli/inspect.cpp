// llmtrain inspect: what a checkpoint holds, and whether every file verifies.
#include <sys/stat.h>

#include <cstdio>
#include <filesystem>
#include <memory>

#include "checkpoint/checkpoint.h"
#include "checkpoint/safetensors.h"
#include "cli/commands.h"
#include "core/error.h"
#include "core/files.h"
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
            const std::string state_file = dir + "/state.json";
            const std::string state_text = read_regular_file(state_file, "the state.json of a checkpoint", std::uint64_t(1) << 30);
            const auto state = parse_json_text(state_text, state_file);
            checkpoint::validate_state(state, state_file);
            const config::ModelConfig m = config::parse_config(state.at("config").dump(), state_file).model;
            const bool complete = path_exists(dir + "/COMPLETE");
            // What is shown below comes from state.json: not from one whose bytes the commit did not record.
            if (complete) checkpoint::check_state_file(dir, state_text);
            const auto integer = [](const nlohmann::json& v) { return static_cast<long long>(v.get<std::int64_t>()); };
            std::printf("checkpoint %s%s\n", dir.c_str(), complete ? "" : "  (INCOMPLETE: no COMPLETE file)");
            std::printf("  step %lld, %lld tokens seen, world size %lld, ZeRO %lld, sampler epoch %lld next sample %lld\n",
                        integer(state.at("step")), integer(state.at("tokens_seen")), integer(state.at("world_size")),
                        integer(state.at("zero_stage")), integer(state.at("sampler").at("epoch")),
                        integer(state.at("sampler").at("next_sample")));
            std::printf("  model %s: %lld layers, d_model %lld, %lld heads, vocab %lld, context %lld\n",
                        config::to_string(m.arch).c_str(), static_cast<long long>(m.n_layer),
                        static_cast<long long>(m.d_model), static_cast<long long>(m.n_head),
                        static_cast<long long>(m.vocab_size), static_cast<long long>(m.context_length));
            bool all_ok = complete;
            std::string damaged = complete ? "" : " no COMPLETE file;";
            for (const auto& [file, info] : state.at("files").items()) {
              const std::string full = dir + "/" + file;
              std::string verdict = "ok";
              struct stat st {};
              if (::lstat(full.c_str(), &st) != 0) {
                verdict = "MISSING";
              } else if (!S_ISREG(st.st_mode)) {
                verdict = "NOT A REGULAR FILE";
              } else if (std::uint64_t(st.st_size) != info.at("bytes").get<std::uint64_t>()) {
                verdict = "SIZE MISMATCH";
              } else if (checkpoint::file_crc32(full) != info.at("crc32").get<std::uint64_t>()) {
                verdict = "CHECKSUM MISMATCH";
              }
              all_ok = all_ok && verdict == "ok";
              if (verdict != "ok") damaged += " " + file + " " + verdict + ";";
              std::printf("  %-26s %12s  crc32 %08llx  %s\n", file.c_str(),
                          format_bytes(double(info.at("bytes").get<std::int64_t>())).c_str(),
                          static_cast<unsigned long long>(info.at("crc32").get<std::uint64_t>()), verdict.c_str());
            }
            if (!all_ok) {
              std::fflush(stdout);
              damaged.pop_back();
              throw InputError(dir + ": this checkpoint is damaged:" + damaged);
            }
            std::printf("every file verifies\n");
            return 0;
          }};
}

}  // namespace llmtrain::cli
