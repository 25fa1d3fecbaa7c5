// llmtrain export: a checkpoint as Hugging Face transformers files, or as an ONNX graph.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <memory>

#include "checkpoint/checkpoint.h"
#include "checkpoint/onnx_export.h"
#include "cli/commands.h"
#include "cli/option_checks.h"
#include "core/error.h"
#include "core/files.h"
#include "data/shard.h"

namespace llmtrain::cli {
namespace {

namespace fs = std::filesystem;

// Copies the tokenizer files recorded next to the run's training shards (tokenize writes them
// there) into dir; returns how many. A run whose shards are gone exports without them.
int copy_tokenizer_files(const config::Config& config, const std::string& dir) {
  std::vector<std::string> shards;
  try {
    shards = data::expand_paths(config.data.train.paths(), "data.train");
  } catch (const Error&) {
    return 0;
  }
  if (shards.empty()) return 0;
  const fs::path from = fs::path(shards.front()).parent_path();
  int copied = 0;
  for (const char* name : {"tokenizer.json", "encoder.json", "vocab.bpe"}) {
    if (!path_exists((from / name).string())) continue;
    write_file_atomic((fs::path(dir) / name).string(), read_regular_file((from / name).string(), "a tokenizer file"));
    ++copied;
  }
  return copied;
}

}  // namespace

Command add_export_command(CLI::App& parent) {
  struct Options {
    std::string checkpoint, output, format = "hf", dtype = "fp32";
    double shard_gb = 5.0;
    bool no_cache = false, external_data = false;
  };
  auto o = std::make_shared<Options>();
  CLI::App* app = parent.add_subcommand("export", "Write a checkpoint's weights for other tools");
  app->add_option("--checkpoint", o->checkpoint, "Checkpoint folder, checkpoints folder or run folder")->required();
  app->add_option("--output", o->output, "Folder for the exported files")->required();
  app->add_option("--format", o->format,
                  "hf: Hugging Face transformers (model.safetensors, config.json); onnx: model.onnx for ONNX Runtime")
      ->check(CLI::IsMember({"hf", "onnx"}))
      ->capture_default_str();
  app->add_option("--dtype", o->dtype,
                  "Weights stored as fp32, or bf16 (hf) or fp16 (onnx; its computation stays fp32)")
      ->check(CLI::IsMember({"fp32", "fp16", "bf16"}))
      ->capture_default_str();
  app->add_option("--shard-gb", o->shard_gb,
                  "hf: the most GB of weights per file; more are written as Hugging Face's shards "
                  "(model-0000K-of-0000N.safetensors and model.safetensors.index.json)")
      ->check(number_in<double>(0.0, std::numeric_limits<double>::max(), true))
      ->capture_default_str();
  app->add_flag("--no-cache", o->no_cache, "onnx: no past_key_values inputs nor present outputs");
  app->add_flag("--external-data", o->external_data,
                "onnx: weights in model.onnx.data even below 2 GB (always past 2 GB)");

  return {app, [o] {
            if (o->format == "onnx" && !checkpoint::onnx_available()) {
              throw InputError("export --format onnx: this build has no ONNX support; install libonnx-dev and "
                               "libprotobuf-dev (scripts/setup.sh) and rebuild");
            }
            if (o->format != "onnx" && (o->no_cache || o->external_data || o->dtype == "fp16")) {
              throw InputError("export: --dtype fp16, --no-cache and --external-data apply to --format onnx only");
            }
            if (o->format == "onnx" && o->dtype == "bf16") {
              throw InputError("export: --dtype bf16 applies to --format hf only (onnx: fp32 or fp16)");
            }
            const auto start = std::chrono::steady_clock::now();
            require_output_folder(o->output, "--output");
            const checkpoint::Found found = checkpoint::find(o->checkpoint);
            // The export must not overwrite what it reads: the step folder, or a folder between it
            // and the path named (a run folder holds a config.json, as an export does).
            if (same_or_inside(o->output, found.dir) ||
                (same_or_inside(found.dir, o->output) && same_or_inside(o->output, o->checkpoint))) {
              throw InputError("--output: " + o->output + " overlaps the checkpoint " + found.dir +
                               " that it exports; choose a folder outside it");
            }
            if (found.config.model.moe.enabled && o->format != "hf") {
              throw InputError("model.moe: export --format " + o->format +
                               " of Mixture-of-Experts models is not built yet (train, eval and generate work)");
            }
            if (o->format == "hf") {
              // Tensor by tensor from the checkpoint's files: the model is never built.
              checkpoint::HfExportOptions options;
              options.bf16 = o->dtype == "bf16";
              options.shard_bytes = std::max<std::int64_t>(1, std::int64_t(o->shard_gb * 1e9));
              const checkpoint::HfExported done = checkpoint::export_hf_streamed(found, o->output, options);
              const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
              std::printf("export: %s -> %s/%s%s, config.json (%s); %s, %.1f MB, %.1f s\n", found.dir.c_str(),
                          o->output.c_str(), done.files.front().c_str(),
                          done.files.size() > 1 ? (" ... " + done.files.back() + " + model.safetensors.index.json").c_str()
                                                : "",
                          checkpoint::hf_architecture(found.config.model).c_str(), o->dtype.c_str(),
                          double(done.bytes) / 1e6, seconds);
              return 0;
            }
            const auto loaded = checkpoint::load_model(found);
            model::Model& model = *loaded;
            checkpoint::OnnxOptions options;
            options.fp16 = o->dtype == "fp16";
            options.kv_cache = !o->no_cache;
            options.external_data = o->external_data;
            options.release_weights = true;  // the model is not used after this
            const auto result = checkpoint::export_onnx(model, o->output, options);
            checkpoint::write_hf_config(model.config(), o->output);
            const int tokenizer_files = copy_tokenizer_files(found.config, o->output);
            const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
            std::printf("export: %s -> %s/model.onnx%s (opset 17, %d nodes, %.1f MB of %s weights, %s), config.json, "
                        "%d tokenizer file(s); %.1f s\n",
                        found.dir.c_str(), o->output.c_str(), result.external_data ? " + model.onnx.data" : "",
                        result.nodes, double(result.weight_bytes) / 1e6, o->dtype.c_str(),
                        options.kv_cache ? "with KV cache" : "no cache", tokenizer_files, seconds);
            return 0;
          }};
}

}  // namespace llmtrain::cli
