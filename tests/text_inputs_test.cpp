// tokenize's inputs: JSON Lines, gzip and Zstandard give the tokens of the text they hold, many
// files read in parallel keep their order, and bad inputs stop with one line naming file and line.
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "catch_compat.h"
#include "data/text_inputs.h"
#include "process.h"

using llmtrain::test::run_llmtrain;
using llmtrain::test::TempDir;

namespace {

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// The tokens of every train shard in DIR (byte tokenizer, uint16 after the 1024-byte header).
std::vector<std::uint16_t> train_tokens(const std::string& dir) {
  std::vector<std::string> shards;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().filename().string().starts_with("train_")) shards.push_back(entry.path().string());
  }
  std::sort(shards.begin(), shards.end());
  std::vector<std::uint16_t> tokens;
  for (const auto& shard : shards) {
    const std::string bytes = read_bytes(shard);
    REQUIRE(bytes.size() >= 1024);
    for (std::size_t at = 1024; at + 1 < bytes.size(); at += 2) {
      tokens.push_back(std::uint16_t(std::uint8_t(bytes[at]) | std::uint8_t(bytes[at + 1]) << 8));
    }
  }
  return tokens;
}

// The byte tokenizer's tokens of `text`: its bytes.
std::vector<std::uint16_t> bytes_of(const std::string& text) {
  std::vector<std::uint16_t> out;
  for (const char c : text) out.push_back(static_cast<unsigned char>(c));
  return out;
}

// Runs a shell command (gzip, zstd); false when it failed (the tool missing, say).
bool shell(const std::string& command) { return std::system((command + " 2>/dev/null").c_str()) == 0; }

// One error line, exit 2, containing `expected`, and nothing written to `out`.
void check_refused(const llmtrain::test::ProcessResult& r, const std::string& expected, const std::string& out) {
  CAPTURE(r.err);
  CHECK(r.exit_code == 2);
  CHECK(r.err.rfind("llmtrain: error: ", 0) == 0);
  CHECK(r.err.find(expected) != std::string::npos);
  CHECK(r.err.find('\n') == r.err.size() - 1);
  CHECK_FALSE(std::filesystem::exists(out));
}

}  // namespace

TEST_CASE("tokenize of .jsonl, .jsonl.gz and .jsonl.zst gives the tokens of the text they hold, in order",
          "[data][tokenize]") {
  TempDir dir;
  // Three documents: JSON escapes, a newline inside a document, two-byte UTF-8 (é is C3 A9).
  const std::string docs[3] = {"first \"quoted\" document\n", "caf\xC3\xA9 au lait,\nsecond line", "third\ttab"};
  const std::string jsonl = dir.write("docs.jsonl",
                                      "{\"text\": \"first \\\"quoted\\\" document\\n\", \"id\": 1}\n"
                                      "\n"  // a blank line is skipped
                                      "{\"id\": 2, \"text\": \"caf\\u00e9 au lait,\\nsecond line\"}\r\n"
                                      "{\"text\": \"third\\ttab\"}");
  // The same documents as plain text files, one document each: the reference.
  std::vector<std::string> plain_args = {"tokenize", "--output", dir.path() + "/plain", "--val-fraction", "0", "--input"};
  for (int i = 0; i < 3; ++i) plain_args.push_back(dir.write("doc" + std::to_string(i) + ".txt", docs[i]));
  REQUIRE(run_llmtrain(plain_args).exit_code == 0);
  const std::vector<std::uint16_t> expected = train_tokens(dir.path() + "/plain");
  std::string all = docs[0] + docs[1] + docs[2];
  REQUIRE(expected == bytes_of(all));  // bytes, no end-of-text token
  CHECK(expected.size() == 24 + 26 + 9);

  const auto tokenize = [&](const std::vector<std::string>& inputs, const std::string& out,
                            std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {"tokenize", "--output", dir.path() + "/" + out, "--val-fraction", "0"};
    args.insert(args.end(), extra.begin(), extra.end());
    args.push_back("--input");
    args.insert(args.end(), inputs.begin(), inputs.end());
    const auto r = run_llmtrain(args);
    CAPTURE(r.err);
    REQUIRE(r.exit_code == 0);
    return train_tokens(dir.path() + "/" + out);
  };
  CHECK(tokenize({jsonl}, "jsonl") == expected);
  REQUIRE(shell("gzip -k -c " + jsonl + " > " + jsonl + ".gz"));
  CHECK(llmtrain::data::reads_gzip());
  CHECK(tokenize({jsonl + ".gz"}, "gz") == expected);
  const bool zstd = shell("zstd -q -c " + jsonl + " > " + jsonl + ".zst");
  if (!zstd) WARN("the zstd tool is missing: .zst inputs not checked");
  if (zstd && llmtrain::data::reads_zstd()) CHECK(tokenize({jsonl + ".zst"}, "zst") == expected);
  if (zstd && !llmtrain::data::reads_zstd()) WARN("this build has no libzstd: .zst inputs not checked");

  // Many files on several threads: documents in the order given, whatever finishes first; a
  // gzip of two concatenated members reads as their concatenation; another field by name.
  const std::string other = dir.write("other.jsonl", "{\"body\": \"x\"}\n{\"body\": \"yz\"}\n");
  const std::string twice = dir.path() + "/twice.txt.gz";
  REQUIRE(shell("gzip -c " + dir.path() + "/doc0.txt > " + twice + " && gzip -c " + dir.path() + "/doc2.txt >> " + twice));
  std::vector<std::uint16_t> order = tokenize({twice, jsonl + ".gz", dir.path() + "/doc1.txt"}, "many", {"--threads", "3"});
  std::string want = docs[0] + docs[2] + all + docs[1];
  CHECK(order == bytes_of(want));
  order = tokenize({other}, "field", {"--jsonl-field", "body"});
  CHECK(order == std::vector<std::uint16_t>{'x', 'y', 'z'});
}

TEST_CASE("bad JSON Lines and truncated compression exit 2 naming file and line, writing nothing", "[data][tokenize]") {
  TempDir dir;
  const std::string out = dir.path() + "/out";
  const auto refused = [&](const std::string& input, std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {"tokenize", "--output", out, "--input", input};
    args.insert(args.end(), extra.begin(), extra.end());
    return run_llmtrain(args);
  };
  const std::string no_field = dir.write("no_field.jsonl", "{\"text\": \"a\"}\n{\"txt\": \"b\"}\n");
  check_refused(refused(no_field), no_field + ":2: no \"text\" field (--jsonl-field)", out);
  const std::string bad_utf8 = dir.write("bad_utf8.jsonl", "{\"text\": \"a\"}\n{\"text\": \"a\"}\n{\"text\": \"\xC3\x28\"}\n");
  check_refused(refused(bad_utf8), bad_utf8 + ":3: byte 11 of the line is not valid UTF-8", out);
  const std::string not_json = dir.write("not_json.jsonl", "{\"text\": \"a\"}\n{\"text\": \"a\",}\n");
  check_refused(refused(not_json), not_json + ":2: malformed JSON", out);
  const std::string number = dir.write("number.jsonl", "{\"text\": 3}\n");
  check_refused(refused(number), number + ":1: \"text\" is not a string, got 3", out);
  // The first bad file of several read in parallel is the one named.
  check_refused(refused(no_field, {bad_utf8, "--threads", "2"}), no_field + ":2:", out);

  // Truncated compressed files: named with the line the text had reached.
  std::string text;
  for (int i = 0; i < 20000; ++i) text += "{\"text\": \"line " + std::to_string(i * 7919 % 10007) + "\"}\n";
  const std::string whole = dir.write("big.jsonl", text);
  REQUIRE(shell("gzip -c " + whole + " > " + whole + ".gz"));
  const std::string gz = read_bytes(whole + ".gz");
  const std::string cut_gz = dir.write("cut.jsonl.gz", gz.substr(0, gz.size() / 2));
  const auto gz_error = refused(cut_gz);
  check_refused(gz_error, cut_gz + ": line ", out);
  CHECK(gz_error.err.find(": the gzip stream ends early (a truncated file?)") != std::string::npos);
  const std::string cut_tail = dir.write("cut_tail.jsonl.gz", gz.substr(0, gz.size() - 4));  // the length trailer
  check_refused(refused(cut_tail), cut_tail + ": line 20001: the gzip stream ends early", out);
  // Whole, the same files (larger than the decoders' buffers) read to the .jsonl's tokens.
  const auto tokens_of = [&](const std::string& input, const std::string& folder) {
    REQUIRE(run_llmtrain({"tokenize", "--output", dir.path() + "/" + folder, "--val-fraction", "0", "--input", input})
                .exit_code == 0);
    return train_tokens(dir.path() + "/" + folder);
  };
  const std::vector<std::uint16_t> plain = tokens_of(whole, "whole");
  CHECK(plain.size() > 150000);  // of 440 kB of JSON Lines
  CHECK(tokens_of(whole + ".gz", "whole_gz") == plain);
  if (shell("zstd -q -c " + whole + " > " + whole + ".zst") && llmtrain::data::reads_zstd()) {
    CHECK(tokens_of(whole + ".zst", "whole_zst") == plain);
    const std::string zst = read_bytes(whole + ".zst");
    const std::string cut_zst = dir.write("cut.jsonl.zst", zst.substr(0, zst.size() / 2));
    check_refused(refused(cut_zst), cut_zst + ": line ", out);
    const std::string garbage = dir.write("garbage.jsonl.zst", "not zstd at all");
    check_refused(refused(garbage), garbage + ": line 1: corrupt Zstandard data", out);
  }
}

TEST_CASE("JSON Lines rows: CRLF and blank lines, stopping early, errors naming file and line", "[data]") {
  using llmtrain::data::for_each_json_line;
  std::vector<std::string> seen;
  const auto collect = [&](const nlohmann::json& object, const std::string& where) {
    seen.push_back(object.at("t").get<std::string>() + "@" + where);
    return true;
  };
  // Lines 2 (spaces, tabs and CRs), 4 (empty) and 6 (a lone CR) are blank; CRLF ends are dropped.
  for_each_json_line("f.jsonl", "{\"t\": \"a\"}\r\n \r\t\r\n{\"t\": \"b\"}\n\n{\"t\": \"c\"}\r\n\r\n", collect);
  CHECK(seen == std::vector<std::string>{"a@f.jsonl:1", "b@f.jsonl:3", "c@f.jsonl:5"});
  // Stopping after the second row: the bad line after it is never read.
  seen.clear();
  for_each_json_line("f.jsonl", "{\"t\": \"a\"}\n{\"t\": \"b\"}\nnot json\n",
                     [&](const nlohmann::json& object, const std::string& where) {
                       collect(object, where);
                       return seen.size() < 2;
                     });
  CHECK(seen.size() == 2);
  const auto error_of = [&](std::string_view text) {
    try {
      for_each_json_line("f.jsonl", text, collect);
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK(error_of("{\"t\": \"a\"}\n\n[1, 2]\n") == "f.jsonl:3: expected a JSON object, got [1,2]");
  CHECK(error_of("{\"t\": \"a\"}\n{\"t\": \"\xff\"}\n") == "f.jsonl:2: byte 8 of the line is not valid UTF-8");
  CHECK(error_of("{\"t\": \n").starts_with("f.jsonl:1: malformed JSON: "));
}
