// tokenize's inputs: JSON Lines, gzip and Zstandard give the tokens of the text they hold, many
// files read in parallel keep their order, and bad inputs stop with one line naming file and line.
#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>

#include <sys/wait.h>

#include "catch_compat.h"
#include "data/text_inputs.h"
#include "data/text_stream.h"
#include "data/tokenizer.h"
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

namespace {

// Every file of DIR (shards and tokenizer files) by name, with its bytes.
std::map<std::string, std::string> folder_bytes(const std::string& dir) {
  std::map<std::string, std::string> files;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    files[entry.path().filename().string()] = read_bytes(entry.path().string());
  }
  return files;
}

// Text in which "\n" follows both printable characters and other whitespace: GPT-2's pattern
// splits "x\n\nA" as "x", "\n", "\n", "A" but "x\n\n" at the end of a text as "x", "\n\n", so a
// block cut after a "\n" that follows whitespace would change the pieces (and a trained BPE).
std::string tricky_text(int paragraphs) {
  std::string text;
  for (int i = 0; i < paragraphs; ++i) {
    text += "Para " + std::to_string(i * 37 % 101) + " it's here.\n\nNext line, with  two spaces \n";
    text += (i % 3 == 0) ? " \nLead\n\n\nEnd.\n" : "caf\xC3\xA9 \xE2\x80\x94 d\xC3\xA9j\xC3\xA0 vu\n";
  }
  return text;
}

}  // namespace

TEST_CASE("tokenize in small blocks writes the same shards and tokenizer as in one block", "[data][tokenize]") {
  TempDir dir;
  const std::string text = tricky_text(400);  // 30 kB
  const std::string txt = dir.write("doc.txt", text);
  std::string lines;
  for (int i = 0; i < 300; ++i) {
    lines += "{\"text\": " + nlohmann::json(tricky_text(1 + i % 4)).dump() + "}\n";
  }
  const std::string jsonl = dir.write("docs.jsonl", lines);
  const bool zstd = shell("zstd -q -c " + jsonl + " > " + jsonl + ".zst") && llmtrain::data::reads_zstd();
  const std::string packed = zstd ? jsonl + ".zst" : jsonl;
  const bool bpe = llmtrain::data::have_pretokenizer();
  for (const std::string tokenizer : {"byte", "bpe:400"}) {
    if (tokenizer != "byte" && !bpe) {
      WARN("no PCRE2: bpe:N not checked");
      continue;
    }
    const auto run = [&](const std::string& out, const std::string& block, const std::string& threads) {
      const auto r = run_llmtrain({"tokenize", "--output", dir.path() + "/" + out, "--tokenizer", tokenizer,
                                   "--shard-tokens", "4000", "--threads", threads, "--block-bytes", block,
                                   "--input", txt, packed, txt});
      CAPTURE(r.err);
      REQUIRE(r.exit_code == 0);
      return r.out;
    };
    const std::string whole = run("whole_" + tokenizer, "100000000", "1");
    CHECK(whole.find(" 3 block(s)") != std::string::npos);  // one a file
    for (const std::string block : {"1", "97", "4096"}) {
      const std::string out = run("blocks_" + block + "_" + tokenizer, block, "3");
      // The block machinery is used: about (2 x 30 kB + 40 kB) / block bytes blocks.
      const auto at = out.find(" block(s)");
      REQUIRE(at != std::string::npos);
      const long blocks = std::stol(out.substr(out.rfind(' ', at - 1) + 1));
      CAPTURE(block, blocks);
      CHECK(blocks > (block == "4096" ? 20 : 400));
      CHECK(folder_bytes(dir.path() + "/blocks_" + block + "_" + tokenizer) ==
            folder_bytes(dir.path() + "/whole_" + tokenizer));
    }
  }
}

TEST_CASE("tokenize --input - reads JSON Lines or text from standard input", "[data][tokenize]") {
  TempDir dir;
  const std::string jsonl = dir.write("docs.jsonl", "{\"text\": \"ab\"}\n\n{\"text\": \"c\\nd\"}\n");
  const std::string txt = dir.write("doc.txt", "plain\ntext\n");
  const auto piped = [&](const std::string& file, const std::string& out, const std::string& format) {
    const std::string command = std::string(LLMTRAIN_BINARY) + " tokenize --val-fraction 0 --input - --output " +
                                dir.path() + "/" + out + format + " < " + file + " > /dev/null";
    REQUIRE(std::system(command.c_str()) == 0);
    return train_tokens(dir.path() + "/" + out);
  };
  CHECK(piped(jsonl, "stdin_jsonl", "") == bytes_of("abc\nd"));
  CHECK(piped(jsonl, "stdin_jsonl2", " --stdin-format jsonl") == bytes_of("abc\nd"));
  CHECK(piped(txt, "stdin_text", " --stdin-format text") == bytes_of("plain\ntext\n"));
  // An error names standard input and the line; a second "-" and bpe:N (two passes) are refused.
  const std::string bad = dir.write("bad.jsonl", "{\"text\": \"a\"}\n{\"body\": \"b\"}\n");
  const std::string command = std::string(LLMTRAIN_BINARY) + " tokenize --input - --output " + dir.path() +
                              "/bad < " + bad + " 2> " + dir.path() + "/err";
  CHECK(WEXITSTATUS(std::system(command.c_str())) == 2);
  CHECK(read_bytes(dir.path() + "/err") == "llmtrain: error: <stdin>:2: no \"text\" field (--jsonl-field)\n");
  CHECK_FALSE(std::filesystem::exists(dir.path() + "/bad"));
  check_refused(run_llmtrain({"tokenize", "--output", dir.path() + "/twice", "--input", "-", "-"}),
                "--input: standard input (-) can be read only once", dir.path() + "/twice");
  check_refused(run_llmtrain({"tokenize", "--output", dir.path() + "/bpe", "--tokenizer", "bpe:300", "--input", "-"}),
                "training reads the inputs twice", dir.path() + "/bpe");
}

TEST_CASE("an error after shards were spooled leaves no shard and keeps the earlier ones", "[data][tokenize]") {
  TempDir dir;
  std::string good;
  for (int i = 0; i < 5000; ++i) good += "{\"text\": \"document number " + std::to_string(i) + "\"}\n";
  const std::string first = dir.write("good.jsonl", good);
  const std::string bad = dir.write("bad.jsonl", good + "{\"text\": \"x\"\n");
  const std::string out = dir.path() + "/out";
  const std::vector<std::string> args = {"tokenize", "--output", out, "--shard-tokens", "1000", "--block-bytes", "500",
                                         "--threads", "2", "--input", first, bad};
  check_refused(run_llmtrain(args), bad + ":5001: malformed JSON", out);
  // Into a folder holding an earlier run's shards, with --force: they stay as they were.
  REQUIRE(run_llmtrain({"tokenize", "--output", out, "--input", first}).exit_code == 0);
  const auto before = folder_bytes(out);
  std::vector<std::string> forced = args;
  forced.push_back("--force");
  const auto r = run_llmtrain(forced);
  CHECK(r.exit_code == 2);
  CHECK(r.err.find(bad + ":5001: malformed JSON") != std::string::npos);
  CHECK(folder_bytes(out) == before);  // no new shard, no private folder left behind
}

TEST_CASE("stream_blocks hands blocks back in input order, holding at most 2 x threads + 2", "[data][tokenize]") {
  TempDir dir;
  llmtrain::data::StreamOptions options;
  std::string expected;
  for (int f = 0; f < 5; ++f) {
    std::string lines;
    for (int i = 0; i < 200 + 50 * f; ++i) lines += "{\"text\": \"f" + std::to_string(f) + " line " + std::to_string(i) + "\"}\n";
    std::string name = "f";
    name.append(std::to_string(f)).append(".jsonl");
    options.inputs.push_back(dir.write(name, lines));
    expected += lines;
  }
  options.block_bytes = 64;
  options.threads = 3;
  std::atomic<int> processed{0};
  int consumed = 0, most_held = 0;
  std::string seen;
  const auto blocks = llmtrain::data::stream_blocks(
      options, [&](llmtrain::data::StreamBlock&) { ++processed; },
      [&](llmtrain::data::StreamBlock& block) {
        most_held = std::max(most_held, processed - consumed);
        ++consumed;
        seen += block.text;
      });
  CHECK(seen == expected);
  CHECK(blocks == consumed);
  CHECK(blocks > 400);
  CHECK(most_held <= 2 * 3 + 2);
  CHECK(most_held >= 2);  // blocks were processed ahead of the consumer
}
