// Multiple-choice benchmarks scored by log-likelihood. Three tasks:
//
//  - "hellaswag": lm-evaluation-harness's hellaswag task. Each line of HellaSwag's JSON Lines
//    (`activity_label`, `ctx_a`, `ctx_b`, `endings`, `label`) becomes the query
//    preprocess(activity_label + ": " + ctx_a + " " + ctx_b.capitalize()) and the choices
//    preprocess(ending) (see python_text.h), each scored as the continuation " " + choice.
//    Context and continuation are tokenized together as the harness does: white space ending
//    the context moves to the start of the continuation, and the continuation's tokens are
//    those of encode(context + continuation) past the first len(encode(context)). Scores: `acc`
//    (the highest total log-likelihood), `acc_norm` (the highest total over the choice's length
//    in code points, Python's len) and `acc_bytes` (over its length in UTF-8 bytes).
//  - "hellaswag_llmc": llm.c's HellaSwag evaluation: `ctx` and `endings` as published, the
//    context and " " + ending tokenized apart and joined; `acc` as above, `acc_norm` the highest
//    mean log-likelihood per ending token.
//  - "choice": a plain form (`context`, `choices`, `label`) for other benchmarks, tokenized as
//    hellaswag_llmc; `acc`, `acc_norm` (per token) and `acc_norm_bytes` (the total over the
//    choice's UTF-8 bytes).
//
// A choice's log-likelihood is the summed log-probability of its tokens given the context (the
// per-position losses of a forward pass of context + choice, at most context_length + 1 tokens:
// longer ones keep their last tokens; eval/sequence_scoring.h runs them). No token precedes the context (an empty context gets the end-of-text token).
// Ties go to the lowest index.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/tokenizer.h"

namespace llmtrain::eval {

struct ChoiceExample {
  std::string context;               // as scored (hellaswag: the preprocessed query)
  std::vector<std::string> choices;  // as scored, without the leading space
  int label = 0;
};

/// Whether `task` names one of the tasks above.
bool is_choice_task(const std::string& task);

/// The scores `task` reports, in order ("acc", "acc_norm", ...).
std::vector<std::string> task_metrics(const std::string& task);

/// Reads FILE in the format of `task`, at most `limit` examples (0: all). InputError naming the
/// file and line for a line that is not such an object (a label out of range, fewer than two
/// choices, a choice empty after preprocessing, ...) or a file without examples.
std::vector<ChoiceExample> read_choice_file(const std::string& path, const std::string& task, std::int64_t limit = 0);

struct ChoicePrediction {
  std::int64_t index = 0;
  int label = 0;
  std::vector<int> picks;                  // per score of the task (task_metrics' order): the choice it takes
  std::vector<double> logliks;             // per choice: summed log-probability of its tokens
  std::vector<std::int64_t> ending_tokens;  // per choice: its tokens
};

struct ChoiceResult {
  std::string task;
  std::int64_t n = 0;
  std::vector<std::pair<std::string, double>> scores;  // task_metrics' names and their values
  std::vector<ChoicePrediction> predictions;           // in file order
  /// The score named `metric`; RuntimeError where the task has none of that name.
  double score(const std::string& metric) const;
};

/// One choice to score: the context's tokens (its last ones where the whole would not fit) then
/// the choice's, at most context_length + 1 tokens; the last `ending` of them are the choice's.
struct ChoiceSequence {
  std::vector<std::uint32_t> tokens;
  std::int64_t ending = 0;
};

/// Every choice of every example as a sequence to score (example 0's choices, then example 1's,
/// ...), tokenized as `task` does. InputError for a choice longer than the context, a choice
/// without tokens of its own, or an empty context without an end-of-text token to stand for it.
std::vector<ChoiceSequence> choice_sequences(const data::Tokenizer& tokenizer, const std::vector<ChoiceExample>& examples,
                                             const std::string& task, std::int64_t context_length);

/// The predictions and scores from each choice's log-likelihood `logliks` (choice_sequences' order).
ChoiceResult choice_result(const std::vector<ChoiceExample>& examples, const std::vector<ChoiceSequence>& sequences,
                           const std::vector<double>& logliks, const std::string& task);

/// {"task", "n", SCORE..., "predictions": [{"index", "label", PICK..., "logliks", "ending_tokens"},
/// ...]}: each score by its name, each prediction's pick for score "acc*" as "choice*" ("acc_norm":
/// "choice_norm"). With `examples` (the result's), each prediction also has its "context" and
/// "choices" as scored.
nlohmann::json to_json(const ChoiceResult& result, const std::vector<ChoiceExample>* examples = nullptr);

}  // namespace llmtrain::eval
