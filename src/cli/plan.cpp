// llmtrain plan: parameter count and memory per rank, before a job is launched.
#include <cstdio>
#include <memory>
#include <string>

#include "cli/commands.h"
#include "config/config.h"
#include "core/error.h"
#include "core/strings.h"
#include "dist/mesh.h"
#include "train/plan.h"

namespace llmtrain::cli {
namespace {

// "80GB", "141GiB", "512MB" -> bytes.
std::int64_t parse_memory(const std::string& text) {
  std::size_t end = 0;
  double value = 0;
  try {
    value = std::stod(text, &end);
  } catch (const std::exception&) {
    end = 0;
  }
  const std::string unit = text.substr(end);
  double scale = 0;
  if (unit == "GB") scale = 1e9;
  if (unit == "GiB") scale = 1024.0 * 1024 * 1024;
  if (unit == "MB") scale = 1e6;
  if (unit == "MiB") scale = 1024.0 * 1024;
  if (end == 0 || scale == 0 || value <= 0) {
    throw InputError("--device-memory " + text + ": expected a size such as 80GB, 141GB or 24GiB");
  }
  return static_cast<std::int64_t>(value * scale);
}

std::string with_commas(std::int64_t n) {
  std::string digits = std::to_string(n), out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

}  // namespace

Command add_plan_command(CLI::App& parent) {
  struct Options {
    std::string config_path, device_memory = "80GB";
    std::vector<std::string> sets;
    int world_size = 1;
  };
  auto o = std::make_shared<Options>();
  CLI::App* app = parent.add_subcommand("plan", "Parameter count and memory per rank for a config");
  app->add_option("--config", o->config_path, "JSON config file")->required();
  app->add_option("--world-size", o->world_size, "Ranks (GPUs) of the job")->capture_default_str()->check(CLI::PositiveNumber);
  app->add_option("--set", o->sets, "Override a key by its dotted path")->type_name("KEY=VALUE")->allow_extra_args(false);
  app->add_option("--device-memory", o->device_memory, "Memory of one device, for the largest micro-batch")
      ->capture_default_str();

  return {app, [o] {
            std::vector<config::Override> overrides;
            for (const auto& s : o->sets) overrides.push_back({s});
            const config::Config c = config::load_config(o->config_path, overrides);
            const std::int64_t memory = parse_memory(o->device_memory);
            const dist::Mesh mesh =
                dist::Mesh::of(o->world_size, int(c.dist.tensor_parallel), int(c.dist.pipeline_parallel));
            const std::int64_t accum = config::grad_accum_steps(c, mesh.data);
            const auto& m = c.model;
            std::printf("plan: %s at world size %d\n", o->config_path.c_str(), o->world_size);
            std::printf("mesh: %s\n", mesh.describe().c_str());
            if (mesh.tensor * mesh.pipeline > 1) {
              std::printf("mesh: the figures below keep the whole model on every rank (tensor and pipeline splits "
                          "are not counted yet, and train refuses them)\n");
            }
            std::printf("parameters: %s (%s: %lld layers, d_model %lld, %lld heads, ffn %lld, vocab %lld, context %lld)\n",
                        with_commas(train::parameter_count(m)).c_str(), config::to_string(m.arch).c_str(),
                        static_cast<long long>(m.n_layer), static_cast<long long>(m.d_model),
                        static_cast<long long>(m.n_head), static_cast<long long>(m.ffn_hidden),
                        static_cast<long long>(m.vocab_size), static_cast<long long>(m.context_length));
            std::printf("batch: micro-batch %lld x %lld tokens, %lld micro-step(s) per update of %lld sequences\n",
                        static_cast<long long>(c.train.micro_batch_size), static_cast<long long>(m.context_length),
                        static_cast<long long>(accum), static_cast<long long>(c.train.global_batch_size));
            std::printf("activations: recompute %s; training FLOPs per token %.4g (6 N + 12 L H Q T)\n",
                        config::to_string(c.train.recompute).c_str(), train::flops_per_token(m));
            std::printf("%-13s %12s %12s %12s %12s %12s %16s\n", "per rank", "weights", "gradients", "optimizer",
                        "activations", "total", "max micro-batch");
            for (const bool bf16 : {false, true}) {
              for (const int zero : {0, 1, 2}) {
                const auto p = train::plan_memory(c, mesh.data, zero, bf16, c.train.micro_batch_size);
                const std::int64_t fixed = p.weights + p.gradients + p.optimizer;
                const std::int64_t per_sequence = train::activation_bytes_per_sequence(m, bf16, c.train.recompute);
                const std::int64_t largest = fixed < memory ? (memory - fixed) / per_sequence : 0;
                char label[32];
                std::snprintf(label, sizeof label, "%s ZeRO %d", bf16 ? "bf16" : "fp32", zero);
                std::printf("%-13s %12s %12s %12s %12s %12s %16lld\n", label, format_bytes(double(p.weights)).c_str(),
                            format_bytes(double(p.gradients)).c_str(), format_bytes(double(p.optimizer)).c_str(),
                            format_bytes(double(p.activations)).c_str(), format_bytes(double(p.total())).c_str(),
                            static_cast<long long>(largest));
              }
            }
            std::printf("max micro-batch: sequences that fit in %s (%s) next to the weights, gradients and optimizer state\n",
                        o->device_memory.c_str(), format_bytes(double(memory)).c_str());
            return 0;
          }};
}

}  // namespace llmtrain::cli
