// llmtrain tokenize: text files in, train and val token shards (and the tokenizer) out.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "data/text_inputs.h"

namespace llmtrain::data {

struct TokenizeOptions {
  std::vector<std::string> inputs;  // each file is one document, each line of a .jsonl one (data/text_inputs.h);
                                    // "-": standard input, in stdin_format
  TextFormat stdin_format = TextFormat::jsonl;
  std::string jsonl_field = "text";  // JSON Lines: the field that holds a line's document
  std::string output_dir;
  std::string tokenizer = "byte";   // byte | gpt2:DIR | bpe:VOCAB_SIZE
  double val_fraction = 0.1;        // the last this fraction of the token stream is validation data
  std::int64_t shard_tokens = 100'000'000;
  int threads = 0;                  // 0: one per hardware thread
  bool force = false;               // replace shards already in output_dir
  bool progress = true;             // progress lines on stderr for long inputs
  std::size_t block_bytes = 1 << 20;  // text read, parsed and encoded at a time (memory: about
                                      // 2 x threads + 2 blocks of text and their tokens)
};

struct TokenizeReport {
  std::int64_t bytes = 0;     // of the documents' text
  std::int64_t blocks = 0;    // blocks of input encoded
  std::int64_t train_tokens = 0;
  std::int64_t val_tokens = 0;
  std::vector<std::string> shards;
  std::uint32_t vocab_size = 0;
  double seconds = 0;         // the whole run
  double encode_seconds = 0;  // encoding alone (no file I/O, no tokenizer loading or training)
};

/// Streams the inputs (TextReader: plain text, JSON Lines, gzip or Zstandard compressed, several
/// files at once and blocks of one file on `threads` threads), encodes every document (preceded
/// by the end-of-text token where the tokenizer has one) in input order, writes the tokens to
/// shards as they come, then splits the token stream into train and val shards and writes
/// DIR/tokenizer.json. Memory does not grow with the inputs (bpe:N keeps the distinct pieces of
/// the text, read in a first pass). InputError for unreadable or malformed inputs, a bad
/// tokenizer spec, or existing shards without `force`; no shard is left in DIR then (the
/// shards being written live in a private folder until every input is read).
TokenizeReport tokenize_files(const TokenizeOptions& options);

}  // namespace llmtrain::data
