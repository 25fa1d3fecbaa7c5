// GPT-2's pre-tokenization with PCRE2 (JIT-compiled, Unicode properties), as OpenAI's encoder
// and tiktoken's "gpt2" encoding split text before BPE. A build without PCRE2 (LLMTRAIN_HAVE_PCRE2
// unset: a GPU node with only the CUDA toolkit) has no BPE tokenizers: an approximation of the
// Unicode classes would give other token ids without saying so.
#include <memory>
#include <string>

#include "core/error.h"
#include "data/tokenizer.h"

#if LLMTRAIN_HAVE_PCRE2
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

namespace llmtrain::data {
namespace {

constexpr const char* gpt2_pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

struct CompiledPattern {
  pcre2_code* code = nullptr;
  bool jit = false;

  CompiledPattern() {
    int error = 0;
    PCRE2_SIZE offset = 0;
    // UCP: \s and friends follow Unicode, as Python's `regex` does. MATCH_INVALID_UTF: bytes that
    // are not UTF-8 never match and are stepped over instead of failing the whole match.
    code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(gpt2_pattern), PCRE2_ZERO_TERMINATED,
                         PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &error, &offset, nullptr);
    if (!code) throw RuntimeError("cannot compile the GPT-2 pre-tokenization pattern");
    jit = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
  }
  ~CompiledPattern() { pcre2_code_free(code); }
};

const CompiledPattern& pattern() {
  static const CompiledPattern compiled;
  return compiled;
}

struct MatchDataDeleter {
  void operator()(pcre2_match_data* m) const { pcre2_match_data_free(m); }
};

}  // namespace

void pretokenize(std::string_view text, std::vector<std::string_view>& pieces) {
  const CompiledPattern& p = pattern();
  thread_local std::unique_ptr<pcre2_match_data, MatchDataDeleter> match(pcre2_match_data_create(1, nullptr));
  const auto subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  std::size_t offset = 0;
  while (offset < text.size()) {
    const int rc = p.jit ? pcre2_jit_match(p.code, subject, text.size(), offset, 0, match.get(), nullptr)
                         : pcre2_match(p.code, subject, text.size(), offset, 0, match.get(), nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) throw RuntimeError("pre-tokenization failed with PCRE2 error " + std::to_string(rc));
    const PCRE2_SIZE* range = pcre2_get_ovector_pointer(match.get());
    if (range[0] > offset) pieces.push_back(text.substr(offset, range[0] - offset));  // invalid UTF-8
    if (range[1] == range[0]) break;  // cannot happen: every alternative consumes a character
    pieces.push_back(text.substr(range[0], range[1] - range[0]));
    offset = range[1];
  }
  if (offset < text.size()) pieces.push_back(text.substr(offset));
}

bool have_pretokenizer() { return true; }

}  // namespace llmtrain::data

#else  // no PCRE2

namespace llmtrain::data {

void pretokenize(std::string_view, std::vector<std::string_view>&) {
  throw InputError("this build has no PCRE2, which GPT-2's pre-tokenization needs: the BPE tokenizers "
                   "(gpt2:DIR, bpe:N) are unavailable; use --tokenizer byte, or install libpcre2-dev and rebuild");
}

bool have_pretokenizer() { return false; }

}  // namespace llmtrain::data

#endif
