#include "data/tokenize_files.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <thread>

#include "core/error.h"
#include "core/files.h"
#include "data/shard_spool.h"
#include "data/text_stream.h"
#include "data/tokenizer.h"

namespace llmtrain::data {
namespace {

namespace fs = std::filesystem;

// train_NNNNNN.bin / val_NNNNNN.bin, as the spool names them.
bool is_shard_file(const fs::path& path) {
  const std::string name = path.filename().string();
  return (name.starts_with("train_") || name.starts_with("val_")) && name.ends_with(".bin");
}

// The documents of a block: JSON Lines' fields, or the block itself (a piece of a text document,
// its first piece starting the document).
template <typename Each>
void for_each_document(const StreamBlock& block, const std::string& jsonl_field, Each each) {
  if (block.format == TextFormat::jsonl) {
    std::vector<std::string> documents;
    json_documents(*block.name, block.text, block.first_line, jsonl_field, documents);
    for (const auto& d : documents) each(std::string_view(d), true);
  } else {
    each(std::string_view(block.text), block.index == 0);
  }
}

// Progress lines on stderr, at most one every 2 s.
class Progress {
 public:
  explicit Progress(bool on) : on_(on) {}
  void update(const char* what, std::int64_t bytes, std::int64_t tokens) {
    if (!on_ || seconds(last_) < 2.0) return;
    last_ = std::chrono::steady_clock::now();
    std::fprintf(stderr, "tokenize: %s %.1f MB (%.1f MB/s)", what, double(bytes) / 1e6, double(bytes) / 1e6 / seconds(start_));
    if (tokens >= 0) std::fprintf(stderr, ", %lld tokens", static_cast<long long>(tokens));
    std::fprintf(stderr, "\n");
  }

 private:
  static double seconds(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  bool on_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point last_ = start_;
};

}  // namespace

TokenizeReport tokenize_files(const TokenizeOptions& options) {
  const auto start_time = std::chrono::steady_clock::now();
  const auto seconds_since = [](auto t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  if (options.inputs.empty()) throw InputError("--input: at least one file is needed");
  if (std::count(options.inputs.begin(), options.inputs.end(), "-") > 1) {
    throw InputError("--input: standard input (-) can be read only once");
  }
  if (!(options.val_fraction >= 0.0 && options.val_fraction < 1.0)) {
    throw InputError("--val-fraction: expected a number in [0, 1), got " + std::to_string(options.val_fraction));
  }
  if (options.shard_tokens < 1 || options.shard_tokens > std::numeric_limits<std::int32_t>::max()) {
    throw InputError("--shard-tokens: expected an integer from 1 to 2147483647 (a shard's header counts in int32)");
  }

  // Refuse to mix with or silently replace earlier shards.
  require_output_folder(options.output_dir, "--output");
  if (is_directory(options.output_dir)) {
    for (const auto& entry : fs::directory_iterator(options.output_dir)) {
      if (is_shard_file(entry.path()) && !options.force) {
        throw InputError(options.output_dir + ": already holds shards (" + entry.path().filename().string() +
                         "); use --force to replace them");
      }
    }
  }

  TokenizeReport report;
  StreamOptions stream;
  stream.inputs = options.inputs;
  stream.block_bytes = options.block_bytes;
  stream.threads = std::max(1, options.threads > 0 ? options.threads : int(std::thread::hardware_concurrency()));
  stream.stdin_format = options.stdin_format;

  std::unique_ptr<Tokenizer> tokenizer;
  if (options.tokenizer.starts_with("bpe:")) {
    const std::string n = options.tokenizer.substr(4);
    char* end = nullptr;
    const unsigned long long size = std::strtoull(n.c_str(), &end, 10);
    if (n.empty() || *end != '\0' || size < 257 || size > (1ull << 31)) {
      throw InputError("--tokenizer " + options.tokenizer + ": expected bpe:VOCAB_SIZE with VOCAB_SIZE >= 257");
    }
    if (std::count(options.inputs.begin(), options.inputs.end(), "-") > 0) {
      throw InputError("--tokenizer " + options.tokenizer + ": training reads the inputs twice, which standard input "
                       "(--input -) cannot be; train on files, or use a trained tokenizer (gpt2:DIR)");
    }
    // A first pass counts the pre-tokenized pieces: the distinct ones are kept, not the text.
    std::unordered_map<std::string, std::int64_t> counts;
    std::int64_t bytes = 0;
    Progress progress(options.progress);
    stream_blocks(
        stream,
        [&](StreamBlock& block) {
          for_each_document(block, options.jsonl_field,
                            [&](std::string_view d, bool) { count_pieces(d, block.piece_counts); });
          block.document_bytes = std::int64_t(block.text.size());
          std::string().swap(block.text);
        },
        [&](StreamBlock& block) {
          if (counts.empty()) {
            counts = std::move(block.piece_counts);
          } else {
            for (auto& [piece, count] : block.piece_counts) counts[piece] += count;
          }
          bytes += block.document_bytes;
          progress.update("counting pieces:", bytes, -1);
        });
    if (options.progress) std::fprintf(stderr, "tokenize: training a BPE of %llu tokens\n", size);
    tokenizer = make_bpe_tokenizer(train_bpe_counts(counts, std::uint32_t(size)));
    if (tokenizer->vocab_size() < size) {
      std::fprintf(stderr, "tokenize: warning: the input supports only %u tokens, fewer than the %llu asked for\n",
                   tokenizer->vocab_size(), size);
    }
  } else {
    tokenizer = make_tokenizer(options.tokenizer);
  }
  report.vocab_size = tokenizer->vocab_size();
  const std::optional<std::uint32_t> eot = tokenizer->eot_token();

  // Encode blocks on the pool; the tokens go to the spool in input order as each block is done.
  ShardSpool spool(options.output_dir, options.shard_tokens, tokenizer->vocab_size() > 65536);
  Progress progress(options.progress);
  const auto encode_start = std::chrono::steady_clock::now();
  report.blocks = stream_blocks(
      stream,
      [&](StreamBlock& block) {
        for_each_document(block, options.jsonl_field, [&](std::string_view d, bool starts_document) {
          if (starts_document && eot) block.tokens.push_back(*eot);
          tokenizer->encode(d, block.tokens);
          block.document_bytes += std::int64_t(d.size());
        });
        std::string().swap(block.text);
      },
      [&](StreamBlock& block) {
        spool.append(block.tokens);
        report.bytes += block.document_bytes;
        progress.update("encoded", report.bytes, spool.tokens());
      });
  report.encode_seconds = seconds_since(encode_start);

  const std::int64_t total = spool.tokens();
  report.val_tokens = std::llround(double(total) * options.val_fraction);
  report.train_tokens = total - report.val_tokens;
  report.shards = spool.finish(report.train_tokens);
  save_tokenizer(*tokenizer, options.output_dir);
  report.seconds = seconds_since(start_time);
  return report;
}

}  // namespace llmtrain::data
