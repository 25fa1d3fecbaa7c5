#include "data/tokenize_files.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <fstream>
#include <sstream>
#include <thread>

#include "core/error.h"
#include "core/files.h"
#include "data/shard.h"
#include "data/text_inputs.h"
#include "data/tokenizer.h"

namespace llmtrain::data {
namespace {

namespace fs = std::filesystem;

// train_NNNNNN.bin / val_NNNNNN.bin, as write_shards names them.
bool is_shard_file(const fs::path& path) {
  const std::string name = path.filename().string();
  return (name.starts_with("train_") || name.starts_with("val_")) && name.ends_with(".bin");
}

// Splits `text` into pieces of about `target` bytes, cutting only right after a newline that is
// followed by a printable ASCII character: GPT-2's pattern always ends a piece there (no
// alternative matches across "\n" into a non-space), so the chunks encode independently to the
// same tokens as the whole.
std::vector<std::string_view> split_for_threads(std::string_view text, std::size_t target) {
  std::vector<std::string_view> chunks;
  std::size_t start = 0;
  while (text.size() - start > target) {
    std::size_t cut = start + target;
    while (cut < text.size() && !(text[cut - 1] == '\n' && text[cut] > ' ' && text[cut] < 0x7F)) ++cut;
    if (cut >= text.size()) break;
    chunks.push_back(text.substr(start, cut - start));
    start = cut;
  }
  chunks.push_back(text.substr(start));
  return chunks;
}

std::vector<std::string> write_shards(const std::string& dir, const char* split,
                                      std::span<const std::uint32_t> tokens, std::int64_t per_shard, bool wide) {
  std::vector<std::string> paths;
  for (std::size_t first = 0, index = 0; first < tokens.size(); first += std::size_t(per_shard), ++index) {
    char name[64];
    std::snprintf(name, sizeof name, "/%s_%06zu.bin", split, index);
    paths.push_back(dir + name);
    write_shard(paths.back(), tokens.subspan(first, std::min<std::size_t>(std::size_t(per_shard), tokens.size() - first)), wide);
  }
  return paths;
}

}  // namespace

TokenizeReport tokenize_files(const TokenizeOptions& options) {
  const auto start_time = std::chrono::steady_clock::now();
  const auto seconds_since = [](auto t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  if (options.inputs.empty()) throw InputError("--input: at least one file is needed");
  if (!(options.val_fraction >= 0.0 && options.val_fraction < 1.0)) {
    throw InputError("--val-fraction: expected a number in [0, 1), got " + std::to_string(options.val_fraction));
  }
  if (options.shard_tokens < 1 || options.shard_tokens > std::numeric_limits<std::int32_t>::max()) {
    throw InputError("--shard-tokens: expected an integer from 1 to 2147483647 (a shard's header counts in int32)");
  }

  // Refuse to mix with or silently replace earlier shards. Nothing is created before the inputs
  // and the tokenizer have been read.
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
  const int threads = std::max(1, options.threads > 0 ? options.threads : int(std::thread::hardware_concurrency()));
  // Every input read (decompressed, its JSON Lines parsed) on the pool, documents in input order.
  const std::vector<std::string> documents = read_all_documents(options.inputs, options.jsonl_field, threads);
  for (const auto& document : documents) report.bytes += std::int64_t(document.size());

  std::unique_ptr<Tokenizer> tokenizer;
  if (options.tokenizer.starts_with("bpe:")) {
    const std::string n = options.tokenizer.substr(4);
    char* end = nullptr;
    const unsigned long long size = std::strtoull(n.c_str(), &end, 10);
    if (n.empty() || *end != '\0' || size < 257 || size > (1ull << 31)) {
      throw InputError("--tokenizer " + options.tokenizer + ": expected bpe:VOCAB_SIZE with VOCAB_SIZE >= 257");
    }
    if (options.progress) std::fprintf(stderr, "tokenize: training a BPE of %llu tokens\n", size);
    tokenizer = make_bpe_tokenizer(train_bpe({documents.begin(), documents.end()}, std::uint32_t(size)));
    if (tokenizer->vocab_size() < size) {
      std::fprintf(stderr, "tokenize: warning: the input supports only %u tokens, fewer than the %llu asked for\n",
                   tokenizer->vocab_size(), size);
    }
  } else {
    tokenizer = make_tokenizer(options.tokenizer);
  }
  report.vocab_size = tokenizer->vocab_size();

  // Encode chunks of every document on a pool of threads pulling from a shared counter.
  struct Chunk {
    std::size_t document;
    std::string_view text;
    std::vector<std::uint32_t> tokens;
  };
  std::vector<Chunk> chunks;
  for (std::size_t d = 0; d < documents.size(); ++d) {
    for (const auto piece : split_for_threads(documents[d], 1 << 20)) chunks.push_back({d, piece, {}});
  }
  std::atomic<std::size_t> next_chunk{0};
  std::atomic<std::int64_t> bytes_done{0};
  std::exception_ptr error;
  std::mutex error_mutex;
  const auto work = [&] {
    try {
      for (std::size_t i; (i = next_chunk.fetch_add(1)) < chunks.size();) {
        tokenizer->encode(chunks[i].text, chunks[i].tokens);
        bytes_done += std::int64_t(chunks[i].text.size());
      }
    } catch (...) {
      std::lock_guard lock(error_mutex);
      error = std::current_exception();
      next_chunk = chunks.size();
    }
  };
  const auto encode_start = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back(work);
  auto last_report = std::chrono::steady_clock::now();
  while (bytes_done < report.bytes && !error) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (options.progress && seconds_since(last_report) > 2.0) {
      last_report = std::chrono::steady_clock::now();
      std::fprintf(stderr, "tokenize: %.1f of %.1f MB encoded (%.1f MB/s)\n", double(bytes_done) / 1e6,
                   double(report.bytes) / 1e6, double(bytes_done) / 1e6 / seconds_since(start_time));
    }
  }
  for (auto& t : pool) t.join();
  if (error) std::rethrow_exception(error);
  report.encode_seconds = seconds_since(encode_start);

  std::vector<std::uint32_t> stream;
  for (std::size_t c = 0; c < chunks.size(); ++c) {
    const bool document_start = c == 0 || chunks[c].document != chunks[c - 1].document;
    if (document_start && tokenizer->eot_token()) stream.push_back(*tokenizer->eot_token());
    stream.insert(stream.end(), chunks[c].tokens.begin(), chunks[c].tokens.end());
  }
  report.val_tokens = std::llround(double(stream.size()) * options.val_fraction);
  report.train_tokens = std::int64_t(stream.size()) - report.val_tokens;

  // Remove shards of an earlier run (only reached with --force), then write the new ones.
  fs::create_directories(options.output_dir);
  for (const auto& entry : fs::directory_iterator(options.output_dir)) {
    if (is_shard_file(entry.path())) fs::remove(entry.path());
  }
  const bool wide = tokenizer->vocab_size() > 65536;
  const std::span<const std::uint32_t> all(stream);
  report.shards = write_shards(options.output_dir, "train", all.first(std::size_t(report.train_tokens)),
                               options.shard_tokens, wide);
  const auto val = write_shards(options.output_dir, "val", all.last(std::size_t(report.val_tokens)),
                                options.shard_tokens, wide);
  report.shards.insert(report.shards.end(), val.begin(), val.end());
  save_tokenizer(*tokenizer, options.output_dir);
  report.seconds = seconds_since(start_time);
  return report;
}

}  // namespace llmtrain::data
