// llmtrain generate: sample text from a checkpoint, streamed as it is produced.
#include <cstdio>
#include <filesystem>
#include <memory>

#include "checkpoint/checkpoint.h"
#include "cli/commands.h"
#include "cli/option_checks.h"
#include "core/error.h"
#include "data/shard.h"
#include "data/tokenizer.h"
#include "model/model.h"
#include "model/sampling.h"

namespace llmtrain::cli {
namespace {

// The tokenizer recorded next to the run's training shards, unless one is named.
std::unique_ptr<data::Tokenizer> tokenizer_for(const config::Config& config, const std::string& dir) {
  if (!dir.empty()) return data::load_tokenizer(dir);
  const auto shards = data::expand_paths(config.data.train.paths(), "data.train (to find the tokenizer; or give --tokenizer DIR)");
  return data::load_tokenizer(std::filesystem::path(shards.front()).parent_path().string());
}

}  // namespace

Command add_generate_command(CLI::App& parent) {
  struct Options {
    std::string checkpoint, prompt, tokenizer, device = "auto";
    int max_new_tokens = 200;
    float temperature = 1.0f, top_p = 1.0f;
    int top_k = 0;
    std::uint64_t seed = 0;
  };
  auto o = std::make_shared<Options>();
  CLI::App* app = parent.add_subcommand("generate", "Sample text from a checkpoint");
  app->add_option("--checkpoint", o->checkpoint, "Checkpoint folder, checkpoints folder or run folder")->required();
  app->add_option("--prompt", o->prompt, "Text to continue (default: the end-of-text token, or a newline)");
  app->add_option("--max-new-tokens", o->max_new_tokens, "Tokens to generate")->capture_default_str()->check(integer_in<int>(0));
  app->add_option("--temperature", o->temperature, "Softmax temperature; 0: greedy")->capture_default_str()->check(number_in<float>(0.0));
  app->add_option("--top-k", o->top_k, "Sample among the k most likely tokens (0: all)")->capture_default_str()->check(integer_in<int>(0));
  app->add_option("--top-p", o->top_p, "Nucleus sampling: the smallest set with this probability")
      ->capture_default_str()
      ->check(number_in<float>(0.0, 1.0));
  app->add_option("--seed", o->seed, "Random seed: the same seed gives the same text")->capture_default_str();
  app->add_option("--tokenizer", o->tokenizer, "Folder with tokenizer.json (default: next to the training shards)");
  app->add_option("--device", o->device, "auto | cpu | cuda")->check(CLI::IsMember({"auto", "cpu", "cuda"}));

  return {app, [o] {
            if (o->device == "cuda") throw InputError("--device cuda: generation runs on the CPU backend only so far");
            const checkpoint::Found found = checkpoint::find(o->checkpoint);
            const auto tokenizer = tokenizer_for(found.config, o->tokenizer);
            if (tokenizer->vocab_size() > std::uint32_t(found.config.model.vocab_size)) {
              throw InputError("tokenizer has " + std::to_string(tokenizer->vocab_size()) +
                               " tokens, more than the model's model.vocab_size");
            }
            const auto loaded = checkpoint::load_model(found);
            model::Model& model = *loaded;

            std::vector<std::uint32_t> tokens;
            if (!o->prompt.empty()) {
              tokens = tokenizer->encode(o->prompt);
            } else if (tokenizer->eot_token()) {
              tokens.push_back(*tokenizer->eot_token());
            } else {
              tokens = tokenizer->encode("\n");
            }
            const int context = int(found.config.model.context_length);
            if (int(tokens.size()) >= context) {
              throw InputError("--prompt: " + std::to_string(tokens.size()) + " tokens, the model's context is " +
                               std::to_string(context));
            }
            // Only ids the tokenizer can spell are sampled (the model's vocabulary may be padded).
            const int V = int(tokenizer->vocab_size());
            const model::SamplingOptions sampling{o->temperature, o->top_k, o->top_p};
            std::uint64_t rng = o->seed;
            std::fputs(o->prompt.c_str(), stdout);
            // Past the context, the cache is rebuilt from the last half of the context (each new
            // token still costs one position; a rebuild costs context/2 once per context/2 tokens).
            Tensor logits;
            int pos = 0;
            const auto feed = [&](std::size_t first) {
              for (pos = 0; first + std::size_t(pos) < tokens.size(); ++pos) {
                logits = model.decode_step(std::int32_t(tokens[first + std::size_t(pos)]), pos);
              }
            };
            feed(0);
            for (int produced = 0; produced < o->max_new_tokens; ++produced) {
              const std::int32_t next = model::sample_token(logits.as<float>(), V, sampling, rng);
              const auto text = tokenizer->token_bytes(std::uint32_t(next));
              std::fwrite(text.data(), 1, text.size(), stdout);
              std::fflush(stdout);
              tokens.push_back(std::uint32_t(next));
              if (pos == context) {
                feed(tokens.size() - std::size_t(context / 2));
              } else {
                logits = model.decode_step(next, pos++);
              }
            }
            std::fputc('\n', stdout);
            return 0;
          }};
}

}  // namespace llmtrain::cli
