#include "catch_compat.h"
#include "core/json_file.h"
#include "core/strings.h"

using namespace llmtrain;

TEST_CASE("edit_distance matches hand-computed values", "[core]") {
  CHECK(edit_distance("", "") == 0);
  CHECK(edit_distance("abc", "") == 3);
  CHECK(edit_distance("kitten", "sitting") == 3);  // the textbook example
  CHECK(edit_distance("n_layers", "n_layer") == 1);
  CHECK(edit_distance("flaw", "lawn") == 2);
}

TEST_CASE("closest_match suggests only plausible typos", "[core]") {
  const std::vector<std::string> keys = {"n_layer", "n_head", "d_model", "vocab_size"};
  CHECK(closest_match("n_layers", keys) == "n_layer");
  CHECK(closest_match("d_modle", keys) == "d_model");
  CHECK(closest_match("learning_rate", keys).empty());
}

TEST_CASE("format_bytes picks binary units", "[core]") {
  CHECK(format_bytes(512) == "512 B");
  CHECK(format_bytes(1536) == "1.50 KiB");
  CHECK(format_bytes(141.0 * (1ull << 30)) == "141.00 GiB");
}

TEST_CASE("escape_text keeps UTF-8 and shows other bytes as \\xNN; is_valid_utf8 finds the bad byte", "[strings]") {
  CHECK(llmtrain::escape_text("plain ascii") == "plain ascii");
  CHECK(llmtrain::escape_text("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80") == "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80");
  CHECK(llmtrain::escape_text("a\xff" "b") == "a\\xffb");
  CHECK(llmtrain::escape_text("tab\tbell\x07") == "tab\\x09bell\\x07");
  CHECK(llmtrain::escape_text("\xc3") == "\\xc3");                      // cut-off sequence
  CHECK(llmtrain::escape_text("\xc0\xaf") == "\\xc0\\xaf");             // overlong '/'
  CHECK(llmtrain::escape_text("\xed\xa0\x80") == "\\xed\\xa0\\x80");    // a UTF-16 surrogate
  CHECK(llmtrain::escape_text("\xf4\x90\x80\x80") == "\\xf4\\x90\\x80\\x80");  // past U+10FFFF
  std::size_t bad = 99;
  CHECK(llmtrain::is_valid_utf8("caf\xc3\xa9", &bad));
  CHECK(bad == 99);
  CHECK_FALSE(llmtrain::is_valid_utf8("ok\xc3(", &bad));
  CHECK(bad == 2);
}

TEST_CASE("JSON: nesting is bounded at 64 levels, and excerpts of values are short and printable", "[strings]") {
  const auto nested = [](int depth) { return std::string(std::size_t(depth), '[') + std::string(std::size_t(depth), ']'); };
  CHECK(llmtrain::parse_json_text(nested(64), "f.json").is_array());
  std::string message;
  try {
    llmtrain::parse_json_text(nested(65), "f.json");
  } catch (const llmtrain::InputError& e) {
    message = e.what();
  }
  CHECK(message == "f.json: JSON nested deeper than 64 levels (the most accepted)");
  // 100,000 levels: refused at level 65, without walking the rest.
  try {
    llmtrain::parse_json_text(nested(100000), "deep.json");
    message.clear();
  } catch (const llmtrain::InputError& e) {
    message = e.what();
  }
  CHECK(message.find("deep.json: JSON nested deeper than 64 levels") == 0);

  CHECK(llmtrain::json_excerpt(nlohmann::json::parse(R"({"a": [1, 2.5, null], "b": "x"})")) ==
        R"({"a":[1,2.5,null],"b":"x"})");  // as dump() writes it
  const std::string long_list = llmtrain::json_excerpt(nlohmann::json(std::vector<int>(100000, 7)));
  CHECK(long_list.size() == 60);
  CHECK(long_list.ends_with("..."));
  CHECK(llmtrain::json_excerpt(nlohmann::json(std::string("bad \xff byte"))) == "\"bad \\xff byte\"");
}
