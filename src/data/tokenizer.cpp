#include "data/tokenizer.h"

#include <filesystem>
#include <fstream>

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

std::optional<std::uint32_t> recorded_eot_token(const std::string& dir) {
  const std::string path = dir + "/tokenizer.json";
  const nlohmann::json record = read_json_file(path, "the tokenizer.json that llmtrain tokenize writes next to the shards");
  if (!record.is_object() || !record.contains("eot_token")) return std::nullopt;
  const nlohmann::json& eot = record.at("eot_token");
  if (eot.is_null()) return std::nullopt;
  if (!eot.is_number_unsigned()) throw InputError(path + ": eot_token: expected a token id or null");
  return eot.get<std::uint32_t>();
}

}  // namespace llmtrain::data
