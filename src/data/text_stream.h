// The inputs of tokenize as a stream of blocks: read and decompressed a block at a time, each
// block processed on a pool of threads, then handed back in input order, with a bound on the
// blocks held at once (so memory depends on the block size and the threads, not on the inputs).
#pragma once

#include <cstdint>
#include <exception>
#include <functional>
#include <string>
#include <unordered_map>
#include <vector>

#include "data/text_inputs.h"

namespace llmtrain::data {

struct StreamBlock {
  std::size_t file = 0;   // index in the inputs
  std::size_t index = 0;  // within its file
  const std::string* name = nullptr;  // the file's name for errors ("<stdin>" for standard input)
  TextFormat format = TextFormat::text;
  std::int64_t first_line = 1;
  std::string text;  // whole JSON lines, or a piece of a plain text document (TextReader::next)
  // What the processing makes of the text (it may drop the text then):
  std::vector<std::uint32_t> tokens;
  std::unordered_map<std::string, std::int64_t> piece_counts;
  std::int64_t document_bytes = 0;
  std::exception_ptr error;
};

struct StreamOptions {
  std::vector<std::string> inputs;  // "-": standard input, in stdin_format
  std::size_t block_bytes = 1 << 20;
  int threads = 1;
  TextFormat stdin_format = TextFormat::jsonl;
};

/// Reads every input in blocks (several files at once, each file by one thread at a time) and
/// calls `process(block)` on `threads` threads, then `consume(block)` on the calling thread, for
/// every block in input order (files in the order given, then their blocks). At most
/// 2 x threads + 2 blocks are held at once. The first error in input order (reading, processing
/// or consuming) is thrown, after every thread has stopped. Returns the number of blocks.
std::int64_t stream_blocks(const StreamOptions& options, const std::function<void(StreamBlock&)>& process,
                           const std::function<void(StreamBlock&)>& consume);

}  // namespace llmtrain::data
