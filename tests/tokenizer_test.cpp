// Tokenizers: hand-checked BPE on a hand-made vocabulary, hand-checked BPE training, round trips,
// and (where the GPT-2 files are present) the ids of an independent GPT-2 encoder.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <random>
#include <sstream>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "catch_compat.h"
#include "core/crc32.h"
#include "core/error.h"
#include "data/shard.h"
#include "data/tokenize_files.h"
#include "data/tokenizer.h"
#include "process.h"

using namespace llmtrain;
using namespace llmtrain::data;

namespace {

// GPT-2's byte order: bytes '!'..'~', 0xA1..0xAC, 0xAE..0xFF are ids 0..187 in that order; the
// other 68 bytes follow in byte order (so ' ' = 188 + 32 = 220, as in GPT-2).
std::uint32_t gpt2_byte_id(unsigned char b) {
  if (b >= '!' && b <= '~') return b - '!';
  if (b >= 0xA1 && b <= 0xAC) return 94 + (b - 0xA1);
  if (b >= 0xAE) return 106 + (b - 0xAE);
  return 188 + (b <= 32 ? b : b <= 0xA0 ? b - 94 : 68 - 1);  // 0..32, 127..160, 173
}

// A hand-made vocabulary: 256 bytes, then "he", "ll", "hell", " w", then <|endoftext|>.
BpeVocabulary hand_vocabulary() {
  BpeVocabulary v;
  v.tokens.resize(256);
  for (int b = 0; b < 256; ++b) v.tokens[gpt2_byte_id(std::uint8_t(b))] = std::string(1, char(b));
  const auto add = [&](const std::string& a, const std::string& b) {
    const auto id_of = [&](const std::string& s) {
      return std::uint32_t(std::find(v.tokens.begin(), v.tokens.end(), s) - v.tokens.begin());
    };
    v.merges.emplace_back(id_of(a), id_of(b));
    v.tokens.push_back(a + b);
  };
  add("h", "e");
  add("l", "l");
  add("he", "ll");
  add(" ", "w");
  v.eot = std::uint32_t(v.tokens.size());
  v.tokens.push_back("<|endoftext|>");
  return v;
}

// BPE encoding and training need GPT-2's pre-tokenization, which a build without PCRE2 lacks.
#define SKIP_WITHOUT_PCRE2() \
  if (!have_pretokenizer()) LLMTRAIN_SKIP("this build has no PCRE2 (GPT-2 pre-tokenization)")

std::string random_bytes(std::mt19937& rng, std::size_t n) {
  std::string s(n, '\0');
  for (auto& c : s) c = char(rng() & 0xFF);
  return s;
}

std::string random_utf8(std::mt19937& rng, std::size_t n) {
  static const char* pieces[] = {"a", "Z", " ", "  ", "\n", "\t", "7", "42", "'s", "'ll", "!", "é", "ß", "日本",
                                 "😀", "\xC2\xA0", "Ω", "١٢", "—", "..."};
  std::string s;
  for (std::size_t i = 0; i < n; ++i) s += pieces[rng() % std::size(pieces)];
  return s;
}

}  // namespace

TEST_CASE("the byte order matches GPT-2's", "[tokenizer]") {
  CHECK(gpt2_byte_id(' ') == 220);
  CHECK(gpt2_byte_id('\n') == 198);
  CHECK(gpt2_byte_id('!') == 0);
  CHECK(gpt2_byte_id(0xAD) == 255);
}

TEST_CASE("GPT-2 pre-tokenization splits as the reference pattern does", "[tokenizer]") {
  SKIP_WITHOUT_PCRE2();
  const auto split = [](std::string_view text) {
    std::vector<std::string_view> pieces;
    pretokenize(text, pieces);
    return std::vector<std::string>(pieces.begin(), pieces.end());
  };
  using V = std::vector<std::string>;
  CHECK(split("Hello world") == V{"Hello", " world"});
  CHECK(split(" hello  world\n\n  x") == V{" hello", " ", " world", "\n\n ", " x"});
  CHECK(split("I'm 123 you'll") == V{"I", "'m", " 123", " you", "'ll"});
  CHECK(split("naïve café") == V{"naïve", " café"});            // \p{L} beyond ASCII
  CHECK(split("abc123def") == V{"abc", "123", "def"});
  CHECK(split("x١٢٣") == V{"x", "١٢٣"});                          // \p{N}: Arabic-Indic digits
  CHECK(split("hi!!  ?") == V{"hi", "!!", " ", " ?"});
  CHECK(split("a\xFF\xFE b") == V{"a", "\xFF\xFE", " b"});        // invalid UTF-8 kept as its own piece
  CHECK(split("") == V{});
}

TEST_CASE("BPE on a hand-made vocabulary gives the hand-worked tokens", "[tokenizer]") {
  SKIP_WITHOUT_PCRE2();
  const auto tok = make_bpe_tokenizer(hand_vocabulary());
  CHECK(tok->vocab_size() == 261);
  CHECK(tok->eot_token() == 260u);
  // "hello" -> h e l l o -> (he) l l o -> (he)(ll) o -> (hell) o
  // " well" -> ' ' w e l l -> ' ' w e (ll) -> ( w) e (ll)
  CHECK(tok->encode("hello well") == std::vector<std::uint32_t>{258, gpt2_byte_id('o'), 259, gpt2_byte_id('e'), 257});
  // Lowest rank first: "hhe" has (h,h) unknown and (h,e) rank 0.
  CHECK(tok->encode("hhe") == std::vector<std::uint32_t>{gpt2_byte_id('h'), 256});
  CHECK(tok->decode(tok->encode("hello well")) == "hello well");
}

TEST_CASE("decode(encode(x)) == x for random bytes and random UTF-8", "[tokenizer]") {
  SKIP_WITHOUT_PCRE2();
  std::mt19937 rng(1234);
  const auto bytes = make_byte_tokenizer();
  const auto bpe = make_bpe_tokenizer(hand_vocabulary());
  for (int trial = 0; trial < 200; ++trial) {
    const std::string raw = random_bytes(rng, rng() % 300);
    const std::string text = random_utf8(rng, rng() % 100);
    REQUIRE(bytes->decode(bytes->encode(raw)) == raw);
    REQUIRE(bytes->encode(raw).size() == raw.size());
    REQUIRE(bpe->decode(bpe->encode(raw)) == raw);
    REQUIRE(bpe->decode(bpe->encode(text)) == text);
  }
}

TEST_CASE("BPE training makes the hand-worked merges and reads back through gpt2:DIR", "[tokenizer]") {
  SKIP_WITHOUT_PCRE2();
  // The classic example: "aaabdaaabac". Pair counts: aa 4, ab 2, ... -> merge (a, a).
  // Then (aa, a) 2 and (a, b) 2 tie: the smaller byte pair ("a", "b") wins. Then (aa, ab) 2.
  const BpeVocabulary v = train_bpe({"aaabdaaabac"}, 256 + 3 + 1);
  REQUIRE(v.tokens.size() == 260);
  CHECK(v.tokens[256] == "aa");
  CHECK(v.tokens[257] == "ab");
  CHECK(v.tokens[258] == "aaab");
  CHECK(v.merges[2] == std::pair<std::uint32_t, std::uint32_t>{256, 257});
  CHECK(v.eot == 259u);
  CHECK(v.tokens[259] == "<|endoftext|>");

  // Asking for more than the text supports stops early; the end-of-text token stays last.
  const BpeVocabulary small = train_bpe({"abab"}, 1000);
  CHECK(small.tokens.size() == 256 + 2 + 1);  // (a, b), then (ab, ab)
  CHECK(small.tokens[257] == "abab");

  test::TempDir dir;
  save_bpe_files(v, dir.path());
  const BpeVocabulary back = read_bpe_files(dir.path());
  CHECK(back.tokens == v.tokens);
  CHECK(back.merges == v.merges);
  CHECK(back.eot == v.eot);
  const auto trained = make_bpe_tokenizer(v);
  const auto loaded = make_tokenizer("gpt2:" + dir.path());
  CHECK(loaded->encode("aaabdaaabac") == std::vector<std::uint32_t>{258, gpt2_byte_id('d'), 258, gpt2_byte_id('a'), gpt2_byte_id('c')});
  CHECK(loaded->encode("aaab aab") == trained->encode("aaab aab"));
}

TEST_CASE("without PCRE2 the BPE tokenizers are an input error that says so; bytes still work", "[tokenizer]") {
  const auto message = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const InputError& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  const auto bpe = make_bpe_tokenizer(hand_vocabulary());
  if (have_pretokenizer()) {
    CHECK(bpe->encode("hello").size() == 2);
  } else {
    CHECK(message([&] { bpe->encode("hello"); }).find("this build has no PCRE2") == 0);
    CHECK(message([] { train_bpe({"abab"}, 300); }).find("this build has no PCRE2") == 0);
  }
  CHECK(make_tokenizer("byte")->encode("hi") == std::vector<std::uint32_t>{'h', 'i'});
}

TEST_CASE("bad tokenizer files are input errors naming the file", "[tokenizer]") {
  test::TempDir dir;
  const auto message = [](const std::string& spec) {
    try {
      make_tokenizer(spec);
    } catch (const InputError& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  CHECK(message("gpt2:" + dir.path()).find(dir.path() + "/encoder.json: cannot open") == 0);
  CHECK(message("sentencepiece").find("--tokenizer sentencepiece: expected byte, gpt2:DIR or bpe:VOCAB_SIZE") == 0);
  save_bpe_files(hand_vocabulary(), dir.path());
  dir.write("vocab.bpe", "#version: 0.2\nh e\nq zz\n");
  CHECK(message("gpt2:" + dir.path()) == dir.path() + "/vocab.bpe:3: merge of tokens that encoder.json does not have");
  dir.write("encoder.json", "{\"a\": 0, \"b\": 0}");
  CHECK(message("gpt2:" + dir.path()).find("is used twice") != std::string::npos);
}

TEST_CASE("tokenize writes train and val shards, each document after end-of-text", "[tokenizer]") {
  SKIP_WITHOUT_PCRE2();
  test::TempDir dir;
  const auto a = dir.write("a.txt", "hello well");
  const auto b = dir.write("b.txt", "hhe");
  const auto vocab_dir = dir.path() + "/vocab";
  std::filesystem::create_directories(vocab_dir);
  save_bpe_files(hand_vocabulary(), vocab_dir);

  TokenizeOptions o;
  o.inputs = {a, b};
  o.output_dir = dir.path() + "/out";
  o.tokenizer = "gpt2:" + vocab_dir;
  o.val_fraction = 0.25;
  o.shard_tokens = 3;
  o.progress = false;
  const TokenizeReport r = tokenize_files(o);
  // [eot, hell, o, " w", e, ll] [eot, h, he]: 9 tokens, the last 25% (2) to val.
  CHECK(r.train_tokens == 7);
  CHECK(r.val_tokens == 2);
  CHECK(r.shards.size() == 3 + 1);
  std::vector<std::int32_t> got(3);
  ShardFile(o.output_dir + "/train_000000.bin").read_tokens(0, 3, 261, got.data());
  CHECK(got == std::vector<std::int32_t>{260, 258, std::int32_t(gpt2_byte_id('o'))});
  std::vector<std::int32_t> val(2);
  ShardFile(o.output_dir + "/val_000000.bin").read_tokens(0, 2, 261, val.data());
  CHECK(val == std::vector<std::int32_t>{std::int32_t(gpt2_byte_id('h')), 256});
  // The tokenizer is recorded next to the shards and decodes them.
  const auto recorded = load_tokenizer(o.output_dir);
  CHECK(recorded->decode(std::vector<std::uint32_t>{258, gpt2_byte_id('o')}) == "hello");

  // Existing shards are never replaced silently.
  CHECK_THROWS_AS(tokenize_files(o), InputError);
  o.force = true;
  o.tokenizer = "byte";
  o.val_fraction = 0;
  const TokenizeReport bytes = tokenize_files(o);
  CHECK(bytes.train_tokens == 13);  // no end-of-text token for bytes
  CHECK(!std::filesystem::exists(o.output_dir + "/val_000000.bin"));
  CHECK(load_tokenizer(o.output_dir)->kind() == "byte");
}

TEST_CASE("tinyshakespeare with GPT-2's vocabulary gives the reference ids", "[tokenizer][shared-data]") {
  SKIP_WITHOUT_PCRE2();
  const std::string shared = LLMTRAIN_SOURCE_DIR "/../shared/data";
  if (!std::filesystem::exists(shared + "/gpt2/encoder.json") || !std::filesystem::exists(shared + "/tinyshakespeare.txt")) {
    LLMTRAIN_SKIP("../shared/data (GPT-2 vocabulary, tinyshakespeare.txt) not present");
  }
  const auto tok = make_tokenizer("gpt2:" + shared + "/gpt2");
  CHECK(tok->vocab_size() == 50257);
  CHECK(tok->eot_token() == 50256u);
  // Ids from scripts/gpt2_reference_tokens.py, an independent Python encoder.
  using V = std::vector<std::uint32_t>;
  CHECK(tok->encode("Hello world") == V{15496, 995});
  CHECK(tok->encode(" hello  world\n\n  x") == V{23748, 220, 995, 628, 220, 2124});
  CHECK(tok->encode("I'm 123 you'll") == V{40, 1101, 17031, 345, 1183});
  CHECK(tok->encode("naïve café 日本語 😀") == V{2616, 38776, 40304, 10545, 245, 98, 17312, 105, 45739, 252, 30325, 222});
  CHECK(tok->encode("<|endoftext|>") == V{27, 91, 437, 1659, 5239, 91, 29});  // ordinary text

  std::ifstream in(shared + "/tinyshakespeare.txt", std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  const auto ids = tok->encode(text.str());
  std::ifstream golden_file(LLMTRAIN_SOURCE_DIR "/tests/data/tinyshakespeare_gpt2.json");
  const auto golden = nlohmann::json::parse(golden_file);
  CHECK(ids.size() == 338025);
  REQUIRE(ids.size() == golden["tokens"].get<std::size_t>());
  std::uint64_t sum = 0;
  for (const auto t : ids) sum += t;
  CHECK(sum == golden["sum"].get<std::uint64_t>());
  // The reference's CRC-32 is over the ids as little-endian uint32.
  const auto crc = crc32(ids.data(), ids.size() * sizeof(ids[0]));
  CHECK(crc == golden["crc32"].get<std::uint64_t>());
  CHECK(V(ids.begin(), ids.begin() + 64) == golden["first"].get<V>());
  CHECK(V(ids.end() - 16, ids.end()) == golden["last"].get<V>());
  CHECK(tok->decode(ids) == text.str());
}

namespace {

// An independent reference for BPE encoding: the plain rule, on byte strings. Find the adjacent
// pair of lowest rank, merge it everywhere left to right, repeat. Quadratic, so short inputs only.
class ReferenceBpe {
 public:
  explicit ReferenceBpe(const BpeVocabulary& v) {
    for (std::uint32_t id = 0; id < v.tokens.size(); ++id) {
      if (!(v.eot && *v.eot == id)) id_.emplace(v.tokens[id], id);
    }
    for (std::uint32_t r = 0; r < v.merges.size(); ++r) {
      rank_.emplace(v.tokens[v.merges[r].first] + '\0' + v.tokens[v.merges[r].second], r);
    }
  }

  std::vector<std::uint32_t> encode(std::string_view text) const {
    std::vector<std::string_view> pieces;
    pretokenize(text, pieces);
    std::vector<std::uint32_t> ids;
    for (const auto piece : pieces) {
      std::vector<std::string> parts;
      for (const char c : piece) parts.emplace_back(1, c);
      while (true) {
        std::size_t best = std::numeric_limits<std::size_t>::max();
        for (std::size_t i = 0; i + 1 < parts.size(); ++i) {
          const auto it = rank_.find(parts[i] + '\0' + parts[i + 1]);
          if (it != rank_.end()) best = std::min(best, it->second);
        }
        if (best == std::numeric_limits<std::size_t>::max()) break;
        std::vector<std::string> merged;
        for (std::size_t i = 0; i < parts.size(); ++i) {
          const auto it = i + 1 < parts.size() ? rank_.find(parts[i] + '\0' + parts[i + 1]) : rank_.end();
          if (it != rank_.end() && it->second == best) {
            merged.push_back(parts[i] + parts[i + 1]);
            ++i;
          } else {
            merged.push_back(parts[i]);
          }
        }
        parts = std::move(merged);
      }
      for (const auto& p : parts) ids.push_back(id_.at(p));
    }
    return ids;
  }

 private:
  std::unordered_map<std::string, std::uint32_t> id_;       // first id of each byte string
  std::unordered_map<std::string, std::size_t> rank_;       // "left\0right" -> first rank
};

// A random vocabulary over `alphabet`: `count` merges of random pairs of known tokens, listed in a
// shuffled order, so that a merge may rank before the merges that build its parts. A merge list
// in training order never does that, but any vocab.bpe file is accepted.
BpeVocabulary random_vocabulary(std::mt19937& rng, const std::string& alphabet, int count, bool shuffle) {
  BpeVocabulary v = hand_vocabulary();
  v.tokens.pop_back();  // <|endoftext|> goes last again below
  v.merges.clear();
  v.tokens.resize(256);
  std::vector<std::string> known;
  for (const char c : alphabet) known.emplace_back(1, c);
  const auto id_of = [&](const std::string& s) {
    return std::uint32_t(std::find(v.tokens.begin(), v.tokens.end(), s) - v.tokens.begin());
  };
  for (int tries = 0; int(v.merges.size()) < count && tries < 100 * count; ++tries) {
    const std::string a = known[rng() % known.size()], b = known[rng() % known.size()];
    if (a.size() + b.size() > 8 || id_of(a + b) < v.tokens.size()) continue;
    v.merges.emplace_back(id_of(a), id_of(b));
    v.tokens.push_back(a + b);
    known.push_back(a + b);
  }
  if (shuffle) std::shuffle(v.merges.begin(), v.merges.end(), rng);
  v.eot = std::uint32_t(v.tokens.size());
  v.tokens.push_back("<|endoftext|>");
  return v;
}

std::string random_text(std::mt19937& rng, const std::string& alphabet, std::size_t n) {
  std::string s(n, ' ');
  for (auto& c : s) c = alphabet[rng() % alphabet.size()];
  return s;
}

}  // namespace

TEST_CASE("BPE encoding equals the plain reference rule on random vocabularies and inputs", "[tokenizer]") {
  SKIP_WITHOUT_PCRE2();
  std::mt19937 rng(2024);
  int compared = 0;
  for (int vocab_trial = 0; vocab_trial < 40; ++vocab_trial) {
    const std::string alphabet = vocab_trial % 2 ? "ab" : "abc x";
    const BpeVocabulary v = random_vocabulary(rng, alphabet, 5 + int(rng() % 40), vocab_trial % 4 < 2);
    const auto tok = make_bpe_tokenizer(v);
    const ReferenceBpe reference(v);
    for (int trial = 0; trial < 25; ++trial) {
      std::string text;
      switch (trial % 5) {
        case 0: text = random_text(rng, alphabet, rng() % 40); break;
        case 1: text = random_text(rng, alphabet, 300 + rng() % 700); break;      // long words
        case 2: text = std::string(1 + rng() % 500, alphabet[rng() % alphabet.size()]); break;  // one letter
        case 3: {  // a short pattern repeated: many equal pairs, merges that overlap
          const std::string unit = random_text(rng, "ab", 1 + rng() % 4);
          for (std::size_t i = 0, n = 1 + rng() % 200; i < n; ++i) text += unit;
          break;
        }
        default: text = random_text(rng, alphabet, rng() % 40) + random_utf8(rng, rng() % 20); break;
      }
      INFO("vocabulary " << vocab_trial << ", text \"" << text << "\"");
      REQUIRE(tok->encode(text) == reference.encode(text));
      ++compared;
    }
  }
  CHECK(compared == 1000);

  // Hand-worked case of a merge list out of training order: "ab"+"a" ranks before "a"+"b".
  // "abab": the lowest rank present is (a, b) -> ab ab, everywhere, before (ab, a) can apply;
  // merging (ab, a) as soon as it appears would give "aba" "b" instead.
  BpeVocabulary v = hand_vocabulary();
  v.tokens.pop_back();
  v.merges.clear();
  v.tokens.resize(256);
  v.tokens.push_back("ab");   // 256
  v.tokens.push_back("aba");  // 257
  v.merges = {{256, gpt2_byte_id('a')}, {gpt2_byte_id('a'), gpt2_byte_id('b')}};
  v.eot = 258;
  v.tokens.push_back("<|endoftext|>");
  CHECK(make_bpe_tokenizer(v)->encode("abab") == std::vector<std::uint32_t>{256, 256});
  CHECK(make_bpe_tokenizer(v)->encode("aba") == std::vector<std::uint32_t>{257});
}

TEST_CASE("BPE encoding equals the plain reference rule on a trained vocabulary and on long runs", "[tokenizer]") {
  SKIP_WITHOUT_PCRE2();
  std::mt19937 rng(7);
  std::string corpus;
  for (int i = 0; i < 300; ++i) corpus += random_text(rng, "abcde", 1 + rng() % 12) + " ";
  const BpeVocabulary v = train_bpe({corpus}, 256 + 200 + 1);
  const auto tok = make_bpe_tokenizer(v);
  const ReferenceBpe reference(v);
  for (int trial = 0; trial < 40; ++trial) {
    const std::string text = trial % 2 ? random_text(rng, "abcde", 2000) : random_text(rng, "abcde  ", 500);
    REQUIRE(tok->encode(text) == reference.encode(text));
  }
  // A 4 MB run without a break: linear time (the old rescan took minutes), and it decodes back.
  const std::string run = random_text(rng, "abcde", 4 << 20);
  const auto ids = tok->encode(run);
  CHECK(ids.size() < run.size() / 2);
  CHECK(tok->decode(ids) == run);
}

TEST_CASE("GPT-2's vocabulary: the encoder equals the plain reference rule on long words", "[tokenizer][shared-data]") {
  SKIP_WITHOUT_PCRE2();
  const std::string shared = LLMTRAIN_SOURCE_DIR "/../shared/data";
  if (!std::filesystem::exists(shared + "/gpt2/encoder.json")) LLMTRAIN_SKIP("../shared/data/gpt2 not present");
  const BpeVocabulary v = read_bpe_files(shared + "/gpt2");
  const auto tok = make_bpe_tokenizer(v);
  const ReferenceBpe reference(v);
  std::mt19937 rng(99);
  const std::vector<std::string> alphabets = {"abcdefghijklmnopqrstuvwxyz", "etaoinshr", "ab", "0123456789", "!?.,;:-",
                                              "ABCDEFGHIJKLMNOPQRSTUVWXYZabc"};
  for (const auto& alphabet : alphabets) {
    for (const std::size_t n : {std::size_t(100), std::size_t(3000)}) {
      const std::string text = random_text(rng, alphabet, n);
      INFO("alphabet " << alphabet << ", " << n << " bytes");
      REQUIRE(tok->encode(text) == reference.encode(text));
    }
  }
}
