// Multiple-choice benchmarks scored by log-likelihood: HellaSwag's JSON Lines (`ctx`, `endings`,
// `label`) and a plain form (`context`, `choices`, `label`) for other benchmarks of this kind.
//
// Each choice is tokenized with a leading space ("context" + " " + choice, the two encoded
// apart and joined) and scored by the summed log-probability of its tokens given the context
// (one forward pass of context + choice, at most context_length + 1 tokens: longer ones keep
// their last tokens). The predictions: `choice` the highest total, `choice_norm` the highest mean
// per choice token (llm.c's HellaSwag figure), `choice_norm_bytes` the highest total over the
// choice's length in UTF-8 bytes, without the leading space (lm-evaluation-harness's acc_norm).
// Ties go to the lowest index.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/tokenizer.h"
#include "dist/communicator.h"
#include "model/model.h"

namespace llmtrain::eval {

struct ChoiceExample {
  std::string context;
  std::vector<std::string> choices;
  int label = 0;
};

/// Reads FILE in the format of `task` ("hellaswag" or "choice"), at most `limit` examples (0:
/// all). InputError naming the file and line for a line that is not such an object (a label out
/// of range, fewer than two choices, ...) or a file without examples.
std::vector<ChoiceExample> read_choice_file(const std::string& path, const std::string& task, std::int64_t limit = 0);

struct ChoicePrediction {
  std::int64_t index = 0;
  int label = 0;
  int choice = 0, choice_norm = 0, choice_norm_bytes = 0;
  std::vector<double> logliks;             // per choice: summed log-probability of its tokens
  std::vector<std::int64_t> ending_tokens;  // per choice: its tokens
};

struct ChoiceResult {
  std::string task;
  std::int64_t n = 0;
  double acc = 0, acc_norm = 0, acc_norm_bytes = 0;
  std::vector<ChoicePrediction> predictions;  // in file order
};

/// One choice to score: the context's tokens (its last ones where the whole would not fit) then
/// the choice's, at most context_length + 1 tokens; the last `ending` of them are the choice's.
struct ChoiceSequence {
  std::vector<std::uint32_t> tokens;
  std::int64_t ending = 0;
};

/// Every choice of every example as a sequence to score (example 0's choices, then example 1's,
/// ...). InputError for a choice longer than the context, or an empty context without an
/// end-of-text token to stand for it.
std::vector<ChoiceSequence> choice_sequences(const data::Tokenizer& tokenizer, const std::vector<ChoiceExample>& examples,
                                             std::int64_t context_length);

/// The predictions and scores from each choice's log-likelihood `logliks` (choice_sequences' order).
ChoiceResult choice_result(const std::vector<ChoiceExample>& examples, const std::vector<ChoiceSequence>& sequences,
                           const std::vector<double>& logliks, const std::string& task);

/// Scores `examples` with `model` (B = 1 forward passes of up to `context_length` positions).
/// With `comm`, rank r scores examples r, r + W, ... and every rank gets the whole result.
ChoiceResult score_choices(model::Model& model, const data::Tokenizer& tokenizer,
                           const std::vector<ChoiceExample>& examples, const std::string& task,
                           std::int64_t context_length, std::int64_t vocab_size, dist::Communicator* comm = nullptr);

/// {"task", "n", "acc", "acc_norm", "acc_norm_bytes", "predictions": [{"index", "label", "choice",
/// "choice_norm", "choice_norm_bytes", "logliks", "ending_tokens"}, ...]}
nlohmann::json to_json(const ChoiceResult& result);

}  // namespace llmtrain::eval
