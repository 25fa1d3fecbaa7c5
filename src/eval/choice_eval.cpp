#include "eval/choice_eval.h"

#include <algorithm>
#include <fstream>

#include "core/error.h"
#include "core/files.h"
#include "core/json_file.h"
#include "data/text_inputs.h"
#include "eval/python_text.h"

namespace llmtrain::eval {
namespace {

// The string `key` of a line's object, or an error naming file, line and key.
std::string text_field(const nlohmann::json& object, const char* key, const std::string& where) {
  const auto it = object.find(key);
  if (it == object.end()) throw InputError(where + ": no \"" + std::string(key) + "\" field");
  if (!it->is_string()) throw InputError(where + ": \"" + std::string(key) + "\" is not a string, got " + json_excerpt(*it));
  return it->get<std::string>();
}

int index_of_max(const std::vector<double>& values) {
  return int(std::max_element(values.begin(), values.end()) - values.begin());  // the first of equals
}

// What a score divides each choice's log-likelihood by.
enum class Norm { none, tokens, code_points, bytes };

struct Metric {
  const char* name;
  Norm norm;
};

std::vector<Metric> metrics_of(const std::string& task) {
  if (task == "hellaswag") return {{"acc", Norm::none}, {"acc_norm", Norm::code_points}, {"acc_bytes", Norm::bytes}};
  if (task == "hellaswag_llmc") return {{"acc", Norm::none}, {"acc_norm", Norm::tokens}};
  if (task == "choice") return {{"acc", Norm::none}, {"acc_norm", Norm::tokens}, {"acc_norm_bytes", Norm::bytes}};
  throw InputError("--task " + task + ": expected hellaswag, hellaswag_llmc or choice");
}

// lm-evaluation-harness's tokenization of a (context, continuation) pair: the context's final
// white space moves to the continuation, and the continuation's tokens are those of the whole
// past the context's own count (a BPE merge across the boundary shifts them, as there).
void encode_pair(const data::Tokenizer& tokenizer, std::string_view context, std::string continuation,
                 std::vector<std::uint32_t>& context_tokens, std::vector<std::uint32_t>& continuation_tokens) {
  const std::size_t spaces = trailing_space_bytes(context);
  continuation.insert(0, context.substr(context.size() - spaces));
  context.remove_suffix(spaces);
  context_tokens = tokenizer.encode(context);
  const std::vector<std::uint32_t> whole = tokenizer.encode(std::string(context) + continuation);
  continuation_tokens.assign(whole.begin() + std::ptrdiff_t(std::min(context_tokens.size(), whole.size())), whole.end());
}

std::string error_at(std::size_t example, std::size_t choice) {
  return "example " + std::to_string(example) + ", choice " + std::to_string(choice);
}

}  // namespace

bool is_choice_task(const std::string& task) {
  return task == "hellaswag" || task == "hellaswag_llmc" || task == "choice";
}

std::vector<std::string> task_metrics(const std::string& task) {
  std::vector<std::string> names;
  for (const Metric& m : metrics_of(task)) names.emplace_back(m.name);
  return names;
}

double ChoiceResult::score(const std::string& metric) const {
  for (const auto& [name, value] : scores) {
    if (name == metric) return value;
  }
  throw RuntimeError("task " + task + " has no score " + metric);
}

std::vector<ChoiceExample> read_choice_file(const std::string& path, const std::string& task, std::int64_t limit) {
  metrics_of(task);  // a known task
  const bool harness = task == "hellaswag", plain = task == "choice";
  const char* choices_key = plain ? "choices" : "endings";
  const std::string text = read_regular_file(path, "a JSON Lines task file");
  std::vector<ChoiceExample> examples;
  data::for_each_json_line(path, text, [&](const nlohmann::json& object, const std::string& where) {
    ChoiceExample example;
    if (harness) {  // lm-evaluation-harness's process_docs
      const std::string ctx = text_field(object, "ctx_a", where) + " " + python_capitalize(text_field(object, "ctx_b", where));
      example.context = hellaswag_preprocess(text_field(object, "activity_label", where) + ": " + ctx);
    } else {
      example.context = text_field(object, plain ? "context" : "ctx", where);
    }
    const auto choices = object.find(choices_key);
    if (choices == object.end() || !choices->is_array() || choices->size() < 2) {
      throw InputError(where + ": \"" + choices_key + "\" must be a list of at least two strings");
    }
    for (const auto& c : *choices) {
      if (!c.is_string() || c.get<std::string>().empty()) {
        throw InputError(where + ": \"" + choices_key + "\" must be a list of non-empty strings, got " + json_excerpt(c));
      }
      example.choices.push_back(harness ? hellaswag_preprocess(c.get<std::string>()) : c.get<std::string>());
      if (example.choices.back().empty()) {  // its length divides its log-likelihood
        throw InputError(where + ": \"" + choices_key + "\" has " + json_excerpt(c) + ", empty once preprocessed");
      }
    }
    const auto label = object.find("label");
    std::int64_t value = -1;
    if (label != object.end() && label->is_number_integer()) value = label->get<std::int64_t>();
    if (label != object.end() && label->is_string()) {  // the Hugging Face copy spells it "0".."3"
      const std::string s = label->get<std::string>();
      if (s.size() == 1 && s[0] >= '0' && s[0] <= '9') value = s[0] - '0';
    }
    if (value < 0 || value >= std::int64_t(example.choices.size())) {
      throw InputError(where + ": \"label\" must be the index of one of the " + std::to_string(example.choices.size()) +
                       " choices, got " + (label == object.end() ? std::string("none") : json_excerpt(*label)));
    }
    example.label = int(value);
    examples.push_back(std::move(example));
    return limit <= 0 || std::int64_t(examples.size()) < limit;
  });
  if (examples.empty()) throw InputError(path + ": no examples");
  return examples;
}

std::vector<ChoiceSequence> choice_sequences(const data::Tokenizer& tokenizer, const std::vector<ChoiceExample>& examples,
                                             const std::string& task, std::int64_t context_length) {
  const bool together = task == "hellaswag";
  metrics_of(task);  // a known task
  std::vector<ChoiceSequence> sequences;
  std::vector<std::uint32_t> context, ending;
  for (std::size_t i = 0; i < examples.size(); ++i) {
    const ChoiceExample& example = examples[i];
    for (std::size_t c = 0; c < example.choices.size(); ++c) {
      const std::string continuation = " " + example.choices[c];
      if (together && !example.context.empty()) {
        encode_pair(tokenizer, example.context, continuation, context, ending);
        if (context.empty()) throw InputError(error_at(i, c) + ": the context is white space only");
      } else {
        if (c == 0) context = tokenizer.encode(example.context);
        ending = tokenizer.encode(continuation);
      }
      if (example.context.empty()) {
        if (!tokenizer.eot_token()) throw InputError("example " + std::to_string(i) + ": empty context");
        context.assign(1, *tokenizer.eot_token());  // the ending's first token needs something before it
      }
      if (ending.empty()) throw InputError(error_at(i, c) + ": no tokens of its own after the context's");
      if (std::int64_t(ending.size()) > context_length) {
        throw InputError(error_at(i, c) + ": " + std::to_string(ending.size()) +
                         " tokens, more than the model's context (" + std::to_string(context_length) + ")");
      }
      ChoiceSequence sequence{context, std::int64_t(ending.size())};
      sequence.tokens.insert(sequence.tokens.end(), ending.begin(), ending.end());
      // At most context_length + 1 tokens: the context's last ones.
      if (std::int64_t(sequence.tokens.size()) > context_length + 1) {
        sequence.tokens.erase(sequence.tokens.begin(), sequence.tokens.end() - (context_length + 1));
      }
      sequences.push_back(std::move(sequence));
    }
  }
  return sequences;
}

ChoiceResult choice_result(const std::vector<ChoiceExample>& examples, const std::vector<ChoiceSequence>& sequences,
                           const std::vector<double>& logliks, const std::string& task) {
  const std::vector<Metric> metrics = metrics_of(task);
  ChoiceResult result;
  result.task = task;
  result.n = std::int64_t(examples.size());
  std::vector<double> correct(metrics.size(), 0.0), normalized;
  std::size_t at = 0;  // the first choice of example i in sequences and logliks
  for (std::size_t i = 0; i < examples.size(); ++i) {
    const ChoiceExample& example = examples[i];
    ChoicePrediction p;
    p.index = std::int64_t(i);
    p.label = example.label;
    for (std::size_t c = 0; c < example.choices.size(); ++c) {
      p.logliks.push_back(logliks[at + c]);
      p.ending_tokens.push_back(sequences[at + c].ending);
    }
    for (std::size_t m = 0; m < metrics.size(); ++m) {
      normalized.clear();
      for (std::size_t c = 0; c < example.choices.size(); ++c) {
        const std::string& choice = example.choices[c];
        const double length = metrics[m].norm == Norm::tokens        ? double(p.ending_tokens[c])
                              : metrics[m].norm == Norm::code_points ? double(code_points(choice))
                              : metrics[m].norm == Norm::bytes       ? double(choice.size())
                                                                     : 1.0;
        normalized.push_back(p.logliks[c] / length);
      }
      p.picks.push_back(index_of_max(normalized));
      correct[m] += p.picks.back() == p.label;
    }
    at += example.choices.size();
    result.predictions.push_back(std::move(p));
  }
  for (std::size_t m = 0; m < metrics.size(); ++m) result.scores.emplace_back(metrics[m].name, correct[m] / double(result.n));
  return result;
}

nlohmann::json to_json(const ChoiceResult& result, const std::vector<ChoiceExample>* examples) {
  nlohmann::json predictions = nlohmann::json::array();
  for (const ChoicePrediction& p : result.predictions) {
    nlohmann::json row = {{"index", p.index}, {"label", p.label}};
    for (std::size_t m = 0; m < result.scores.size(); ++m) row["choice" + result.scores[m].first.substr(3)] = p.picks[m];
    row["logliks"] = p.logliks;
    row["ending_tokens"] = p.ending_tokens;
    if (examples) {
      row["context"] = (*examples)[std::size_t(p.index)].context;
      row["choices"] = (*examples)[std::size_t(p.index)].choices;
    }
    predictions.push_back(std::move(row));
  }
  nlohmann::json out = {{"task", result.task}, {"n", result.n}};
  for (const auto& [name, value] : result.scores) out[name] = value;
  out["predictions"] = std::move(predictions);
  return out;
}

}  // namespace llmtrain::eval
