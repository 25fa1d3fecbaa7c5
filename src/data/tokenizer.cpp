#include "data/tokenizer.h"

#include <filesystem>
#include <fstream>
#include <limits>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/json_file.h"

namespace llmtrain::data {
namespace {

class ByteTokenizer final : public Tokenizer {
 public:
  ByteTokenizer() {
    for (int b = 0; b < 256; ++b) bytes_[b] = char(b);
  }
  std::string kind() const override { return "byte"; }
  std::uint32_t vocab_size() const override { return 256; }
  std::optional<std::uint32_t> eot_token() const override { return std::nullopt; }
  void encode(std::string_view text, std::vector<std::uint32_t>& out) const override {
    for (const unsigned char c : text) out.push_back(c);
  }
  std::string_view token_bytes(std::uint32_t token) const override {
    if (token >= 256) throw RuntimeError("byte tokenizer: token " + std::to_string(token) + " is not a byte");
    return std::string_view(&bytes_[token], 1);
  }

 private:
  char bytes_[256];
};

}  // namespace

std::string Tokenizer::decode(std::span<const std::uint32_t> tokens) const {
  std::string text;
  for (const auto t : tokens) text += token_bytes(t);
  return text;
}

std::unique_ptr<Tokenizer> make_byte_tokenizer() { return std::make_unique<ByteTokenizer>(); }

std::unique_ptr<Tokenizer> make_tokenizer(const std::string& spec) {
  if (spec == "byte") return make_byte_tokenizer();
  if (spec.starts_with("gpt2:") && spec.size() > 5) return make_bpe_tokenizer(read_bpe_files(spec.substr(5)));
  throw InputError("--tokenizer " + spec + ": expected byte, gpt2:DIR or bpe:VOCAB_SIZE");
}

void save_tokenizer(const Tokenizer& tokenizer, const std::string& dir) {
  nlohmann::json record = {{"kind", tokenizer.kind()}, {"vocab_size", tokenizer.vocab_size()}};
  record["eot_token"] = tokenizer.eot_token() ? nlohmann::json(*tokenizer.eot_token()) : nlohmann::json(nullptr);
  if (const BpeVocabulary* vocab = tokenizer.bpe_vocabulary()) {
    save_bpe_files(*vocab, dir);
    record["files"] = {"encoder.json", "vocab.bpe"};
  }
  write_file_atomic(dir + "/tokenizer.json", record.dump(2) + "\n");
}

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& dir) {
  const std::string path = dir + "/tokenizer.json";
  const nlohmann::json record = read_json_file(path, "the tokenizer.json that llmtrain tokenize writes next to the shards");
  if (!record.is_object() || !record.contains("kind") || !record.at("kind").is_string()) {
    throw InputError(path + ": kind: expected \"byte\" or \"gpt2\"");
  }
  const std::string kind = record.at("kind").get<std::string>();
  if (kind == "byte") return make_byte_tokenizer();
  if (kind == "gpt2") return make_bpe_tokenizer(read_bpe_files(dir));
  throw InputError(path + ": kind: expected \"byte\" or \"gpt2\", got " + json_excerpt(kind));
}

std::optional<std::uint32_t> recorded_eot_token(const std::string& dir, std::int64_t model_vocab_size) {
  const std::string path = dir + "/tokenizer.json";
  const nlohmann::json record = read_json_file(path, "the tokenizer.json that llmtrain tokenize writes next to the shards");
  const auto eot = json_optional_key(record, "eot_token", path);
  if (!eot) return std::nullopt;
  // The id must name a token of the tokenizer and a row of the model: one past either would mark
  // no document boundary at all, and one cut to 32 bits would mark the wrong token.
  std::int64_t below = model_vocab_size;
  std::string bound = "model.vocab_size " + std::to_string(model_vocab_size);
  if (const auto recorded = json_optional_key(record, "vocab_size", path)) {
    const std::int64_t vocab = json_integer(*recorded, path + ": vocab_size", 1, std::numeric_limits<std::int32_t>::max());
    if (vocab < below) {
      below = vocab;
      bound = "its vocab_size " + std::to_string(vocab);
    }
  }
  return std::uint32_t(json_integer(*eot, path + ": eot_token (below " + bound + ")", 0, below - 1));
}

}  // namespace llmtrain::data
