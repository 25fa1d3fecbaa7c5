// Python's str rules as lm-evaluation-harness's HellaSwag task applies them, on hand-worked
// cases (each expectation is what CPython 3.11 prints for the same input).
#include "catch_compat.h"

#include <string>
#include <vector>

#include "data/tokenizer.h"
#include "eval/choice_eval.h"
#include "eval/python_text.h"

using namespace llmtrain;

TEST_CASE("code_points counts characters, not bytes", "[python_text]") {
  CHECK(eval::code_points("") == 0);
  CHECK(eval::code_points("caf\u00e9") == 4);                // 5 bytes
  CHECK(eval::code_points("\u00e9t\u00e9 \u20ac \U0001F600") == 7);  // 2-, 3- and 4-byte characters
  CHECK(eval::code_points(std::string("a\xff" "b\xc3", 4)) == 4);    // invalid bytes count one each
}

TEST_CASE("strip and rstrip take Python's white space", "[python_text]") {
  CHECK(eval::python_strip("  \t a b \n") == "a b");
  CHECK(eval::python_strip("\u00a0\u3000x\u2009\u0085") == "x");  // no-break, ideographic, thin space, NEL
  CHECK(eval::python_strip("\u200bx") == "\u200bx");             // a zero-width space is not white space
  CHECK(eval::python_strip(" \n ").empty());
  CHECK(eval::trailing_space_bytes("ab \u00a0") == 3);
  CHECK(eval::trailing_space_bytes("ab") == 0);
}

TEST_CASE("capitalize: title case first, the rest lower case, Latin scripts", "[python_text]") {
  CHECK(eval::python_capitalize("") == "");
  CHECK(eval::python_capitalize("then, the MAN sits.") == "Then, the man sits.");
  CHECK(eval::python_capitalize("\u00e9COLE \u00c9T\u00c9") == "\u00c9cole \u00e9t\u00e9");    // éCOLE ÉTÉ -> École été
  CHECK(eval::python_capitalize("\u00dfTRASSE") == "Sstrasse");                                // ß -> Ss
  CHECK(eval::python_capitalize("\u00ff\u0178") == "\u0178\u00ff");                            // ÿŸ -> Ÿÿ
  CHECK(eval::python_capitalize("\u01c6ungla \u01c4") == "\u01c5ungla \u01c6");                // dž -> Dž (title case)
  CHECK(eval::python_capitalize("\u0131STANBUL \u0130") == "Istanbul i\u0307");                // ı -> I; İ -> i + dot
  CHECK(eval::python_capitalize("\u0149 \u017f") == "\u02bcN \u017f");                         // ŉ -> ʼN
  CHECK(eval::python_capitalize("\u1ebfT \u1ea0") == "\u1ebet \u1ea1");                        // ế -> Ế, Ạ -> ạ
  CHECK(eval::python_capitalize("\u0181\u0253") == "\u0181\u0253");                            // Ɓ stays, ɓ's own
  CHECK(eval::python_capitalize("a\u0181") == "A\u0253");                                      // Ɓ -> ɓ (IPA block)
  CHECK(eval::python_capitalize("1ABC") == "1abc");
}

TEST_CASE("HellaSwag's preprocess: tags, [title], double spaces", "[python_text]") {
  CHECK(eval::hellaswag_preprocess(" How to bake bread [title] Preheat the oven. [step] Mix  it. ") ==
        "How to bake bread. Preheat the oven. Mix it.");
  CHECK(eval::hellaswag_preprocess("a [header] b [substeps] c") == "a b c");
  CHECK(eval::hellaswag_preprocess("a    b") == "a  b");           // one pass of "  " -> " "
  CHECK(eval::hellaswag_preprocess("a [b [c] d]") == "a d]");      // the first ']' closes
  CHECK(eval::hellaswag_preprocess("x [open\n] y") == "x [open\n] y");  // no tag across a line end
  CHECK(eval::hellaswag_preprocess("[title]x") == "x");             // " [title]" needs its space
  CHECK(eval::hellaswag_preprocess("caf\u00e9 [step] cr\u00e8me") == "caf\u00e9 cr\u00e8me");
}

TEST_CASE("hellaswag's continuation tokens: the whole's past the context's", "[python_text]") {
  // The byte tokenizer: a context's trailing white space counts to the continuation.
  const auto bytes = data::make_byte_tokenizer();
  const std::vector<eval::ChoiceExample> examples = {{"ab ", {"c", "de"}, 0}};
  const auto together = eval::choice_sequences(*bytes, examples, "hellaswag", 64);
  REQUIRE(together.size() == 2);
  CHECK(together[0].tokens == std::vector<std::uint32_t>{'a', 'b', ' ', ' ', 'c'});
  CHECK(together[0].ending == 3);  // "  c": the moved space, then " c"
  CHECK(together[1].ending == 4);
  const auto apart = eval::choice_sequences(*bytes, examples, "hellaswag_llmc", 64);
  CHECK(apart[0].tokens == together[0].tokens);
  CHECK(apart[0].ending == 2);  // " c"
  // At most context_length + 1 tokens, the context's first ones dropped.
  const auto cut = eval::choice_sequences(*bytes, {{"ab ", {"c", "d"}, 0}}, "hellaswag", 3);
  CHECK(cut[0].tokens == std::vector<std::uint32_t>{'b', ' ', ' ', 'c'});
  CHECK(cut[0].ending == 3);
}
