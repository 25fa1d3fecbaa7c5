// Tokenizers: bytes, and byte-level BPE in GPT-2's form (encoder.json + vocab.bpe).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace llmtrain::data {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  /// "byte" or "gpt2" (any encoder.json + vocab.bpe pair, trained ones included).
  virtual std::string kind() const = 0;
  virtual std::uint32_t vocab_size() const = 0;
  /// The end-of-text token that precedes each document, where the tokenizer has one.
  virtual std::optional<std::uint32_t> eot_token() const = 0;
  /// Appends the tokens of `text` (any bytes; invalid UTF-8 falls back to byte tokens). Thread-safe.
  virtual void encode(std::string_view text, std::vector<std::uint32_t>& out) const = 0;
  /// The bytes of one token (for streaming output).
  virtual std::string_view token_bytes(std::uint32_t token) const = 0;
  /// The BPE vocabulary behind a "gpt2" tokenizer; null for "byte".
  virtual const struct BpeVocabulary* bpe_vocabulary() const { return nullptr; }

  std::vector<std::uint32_t> encode(std::string_view text) const {
    std::vector<std::uint32_t> out;
    encode(text, out);
    return out;
  }
  std::string decode(std::span<const std::uint32_t> tokens) const;
};

/// 256 tokens, one per byte value; no end-of-text token.
std::unique_ptr<Tokenizer> make_byte_tokenizer();

/// Byte-level BPE: the tokens as raw bytes (id order) and the merges in priority order.
struct BpeVocabulary {
  std::vector<std::string> tokens;                          // id -> bytes
  std::vector<std::pair<std::uint32_t, std::uint32_t>> merges;  // rank -> (left id, right id)
  std::optional<std::uint32_t> eot;                         // id of "<|endoftext|>", if present
};

/// Reads DIR/encoder.json and DIR/vocab.bpe (GPT-2's files, or ones saved by save_bpe_files).
/// InputError naming the file and what is wrong.
BpeVocabulary read_bpe_files(const std::string& dir);

/// Writes `vocab` as DIR/encoder.json and DIR/vocab.bpe in GPT-2's format.
void save_bpe_files(const BpeVocabulary& vocab, const std::string& dir);

/// A GPT-2 style tokenizer over `vocab`: GPT-2's pre-tokenization pattern, then BPE merges.
std::unique_ptr<Tokenizer> make_bpe_tokenizer(BpeVocabulary vocab);

/// Trains a byte-level BPE of `vocab_size` tokens on `documents`: 256 byte tokens (in GPT-2's
/// order), then merges (most frequent adjacent pair within pre-tokenized pieces; ties go to the
/// lexicographically smallest pair of byte strings), then "<|endoftext|>" as the last token.
/// Stops early, with fewer tokens, when no pair is left to merge.
BpeVocabulary train_bpe(const std::vector<std::string_view>& documents, std::uint32_t vocab_size);
/// The same from the pieces' counts (count_pieces over every document): what a corpus read as a
/// stream keeps, the distinct pieces rather than the text.
BpeVocabulary train_bpe_counts(const std::unordered_map<std::string, std::int64_t>& piece_counts,
                               std::uint32_t vocab_size);
/// Adds the count of each of `text`'s pre-tokenization pieces to `counts`.
void count_pieces(std::string_view text, std::unordered_map<std::string, std::int64_t>& counts);

/// Splits `text` into GPT-2's pre-tokenization pieces (the exact pattern, Unicode letter and
/// number classes). Bytes that are not valid UTF-8 become pieces of their own. Thread-safe.
/// InputError in a build without PCRE2 (see have_pretokenizer).
void pretokenize(std::string_view text, std::vector<std::string_view>& pieces);

/// Whether this build has GPT-2's pre-tokenization (PCRE2), which BPE encoding and training need.
bool have_pretokenizer();

/// The tokenizer a spec names: "byte", "gpt2:DIR".
std::unique_ptr<Tokenizer> make_tokenizer(const std::string& spec);

/// Writes DIR/tokenizer.json (and, for BPE tokenizers, encoder.json + vocab.bpe) so that the
/// shards in DIR can be decoded later; load_tokenizer reads it back.
void save_tokenizer(const Tokenizer& tokenizer, const std::string& dir);
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& dir);
/// The end-of-text id DIR/tokenizer.json records (none: the tokenizer has none), without loading
/// the tokenizer itself: an id below the file's own vocab_size and below `model_vocab_size`.
/// InputError, naming the file and the key, if the file is missing or malformed or the id out of range.
std::optional<std::uint32_t> recorded_eot_token(const std::string& dir, std::int64_t model_vocab_size);

}  // namespace llmtrain::data
