// Helpers shared by the CLI tests (cli_test.cpp, cli_plan_test.cpp, cli_train_test.cpp): the check
// of an input error's exit code and message, and token shards of a small corpus.
#pragma once

#include <string>

#include "catch_compat.h"
#include "process.h"

namespace llmtrain::test {

// Exit 2 with exactly one line on stderr, "llmtrain: error: ...", containing `expected`.
inline void check_input_error(const ProcessResult& r, const std::string& expected) {
  CAPTURE(r.err);
  CHECK(r.exit_code == 2);
  CHECK(r.err.rfind("llmtrain: error: ", 0) == 0);
  CHECK(r.err.find(expected) != std::string::npos);
  CHECK(r.err.find('\n') == r.err.size() - 1);  // one line
  CHECK(r.out.empty());
}

// Token shards (byte tokenizer) of a small repeated English text, in DIR/shards; returns that folder.
inline std::string fox_shards(const TempDir& dir) {
  std::string text;
  for (int i = 0; i < 400; ++i) text += "the quick brown fox jumps over the lazy dog " + std::to_string(i % 7) + "\n";
  const std::string shards = dir.path() + "/shards";
  REQUIRE(run_llmtrain({"tokenize", "--input", dir.write("corpus.txt", text), "--output", shards}).exit_code == 0);
  return shards;
}

}  // namespace llmtrain::test
