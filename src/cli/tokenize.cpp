// llmtrain tokenize: text and JSON Lines files (plain, gzip or Zstandard) -> train/val token shards.
#include <cstdio>
#include <map>
#include <memory>

#include "cli/commands.h"
#include "cli/option_checks.h"
#include "data/tokenize_files.h"

namespace llmtrain::cli {

Command add_tokenize_command(CLI::App& parent) {
  auto options = std::make_shared<data::TokenizeOptions>();
  CLI::App* app = parent.add_subcommand("tokenize", "Turn text files into train and val token shards");
  app->add_option("--input", options->inputs,
                  "Input files, read in parallel, documents kept in the order given: text (each file one document) "
                  "or JSON Lines (a .jsonl name: each line one document), either compressed as .gz or .zst; "
                  "- reads standard input (see --stdin-format)")
      ->required()
      ->check(CLI::ExistingFile | CLI::IsMember({"-"}));
  app->add_option("--stdin-format", options->stdin_format,
                  "What --input - reads: jsonl (each line a JSON object, one document) or text (one document)")
      ->transform(CLI::CheckedTransformer(std::map<std::string, data::TextFormat>{{"jsonl", data::TextFormat::jsonl},
                                                                                 {"text", data::TextFormat::text}}))
      ->default_str("jsonl");
  app->add_option("--jsonl-field", options->jsonl_field, "JSON Lines: the string field holding each line's document")
      ->capture_default_str();
  app->add_option("--output", options->output_dir, "Folder for the shards and the tokenizer files")->required();
  app->add_option("--tokenizer", options->tokenizer, "byte | gpt2:DIR (encoder.json + vocab.bpe) | bpe:VOCAB_SIZE (trained here)")
      ->capture_default_str();
  app->add_option("--val-fraction", options->val_fraction, "Fraction of the tokens (the last ones) kept for validation")
      ->capture_default_str();
  app->add_option("--shard-tokens", options->shard_tokens, "Tokens per shard file")->capture_default_str();
  app->add_option("--threads", options->threads, "Encoding threads (0: one per hardware thread)")->capture_default_str();
  app->add_option("--block-bytes", options->block_bytes,
                  "Text read, parsed and encoded at a time; memory holds about 2 x threads + 2 blocks")
      ->check(integer_in<std::int64_t>(1, std::int64_t(1) << 30))
      ->capture_default_str();
  app->add_flag("--force", options->force, "Replace shards already in the output folder");

  return {app, [options] {
            const data::TokenizeReport r = data::tokenize_files(*options);
            std::printf("tokenize: %.2f MB -> %lld train + %lld val tokens (vocab %u) in %zu shard(s) in %s; "
                        "%lld block(s), %.2f s in all, reading and encoding %.1f MB/s\n",
                        double(r.bytes) / 1e6, static_cast<long long>(r.train_tokens),
                        static_cast<long long>(r.val_tokens), r.vocab_size, r.shards.size(),
                        options->output_dir.c_str(), static_cast<long long>(r.blocks), r.seconds,
                        double(r.bytes) / 1e6 / std::max(r.encode_seconds, 1e-9));
            return 0;
          }};
}

}  // namespace llmtrain::cli
