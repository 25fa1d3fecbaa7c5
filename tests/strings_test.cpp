#include "catch_compat.h"
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
