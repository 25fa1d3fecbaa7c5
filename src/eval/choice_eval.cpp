#include "eval/choice_eval.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>

#include "core/error.h"
#include "core/files.h"
#include "core/json_file.h"
#include "data/text_inputs.h"

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

}  // namespace

std::vector<ChoiceExample> read_choice_file(const std::string& path, const std::string& task, std::int64_t limit) {
  if (task != "hellaswag" && task != "choice") {
    throw InputError("--task " + task + ": expected hellaswag or choice");
  }
  const bool hellaswag = task == "hellaswag";
  const char* context_key = hellaswag ? "ctx" : "context";
  const char* choices_key = hellaswag ? "endings" : "choices";
  const std::string text = read_regular_file(path, "a JSON Lines task file");
  std::vector<ChoiceExample> examples;
  data::for_each_json_line(path, text, [&](const nlohmann::json& object, const std::string& where) {
    ChoiceExample example;
    example.context = text_field(object, context_key, where);
    const auto choices = object.find(choices_key);
    if (choices == object.end() || !choices->is_array() || choices->size() < 2) {
      throw InputError(where + ": \"" + choices_key + "\" must be a list of at least two strings");
    }
    for (const auto& c : *choices) {
      if (!c.is_string() || c.get<std::string>().empty()) {
        throw InputError(where + ": \"" + choices_key + "\" must be a list of non-empty strings, got " + json_excerpt(c));
      }
      example.choices.push_back(c.get<std::string>());
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
                                             std::int64_t context_length) {
  std::vector<ChoiceSequence> sequences;
  for (std::size_t i = 0; i < examples.size(); ++i) {
    const ChoiceExample& example = examples[i];
    std::vector<std::uint32_t> context = tokenizer.encode(example.context);
    if (context.empty()) {
      if (!tokenizer.eot_token()) throw InputError("example " + std::to_string(i) + ": empty context");
      context.push_back(*tokenizer.eot_token());  // the ending's first token needs something before it
    }
    for (std::size_t c = 0; c < example.choices.size(); ++c) {
      const std::vector<std::uint32_t> ending = tokenizer.encode(" " + example.choices[c]);
      if (std::int64_t(ending.size()) > context_length) {
        throw InputError("example " + std::to_string(i) + ", choice " + std::to_string(c) + ": " +
                         std::to_string(ending.size()) + " tokens, more than the model's context (" +
                         std::to_string(context_length) + ")");
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
  ChoiceResult result;
  result.task = task;
  result.n = std::int64_t(examples.size());
  std::size_t at = 0;  // the first choice of example i in sequences and logliks
  for (std::size_t i = 0; i < examples.size(); ++i) {
    const ChoiceExample& example = examples[i];
    ChoicePrediction p;
    p.index = std::int64_t(i);
    p.label = example.label;
    std::vector<double> per_token, per_byte;
    for (std::size_t c = 0; c < example.choices.size(); ++c, ++at) {
      const double loglik = logliks[at];
      const std::int64_t tokens = sequences[at].ending;
      p.logliks.push_back(loglik);
      p.ending_tokens.push_back(tokens);
      per_token.push_back(loglik / double(tokens));
      per_byte.push_back(loglik / double(example.choices[c].size()));
    }
    p.choice = index_of_max(p.logliks);
    p.choice_norm = index_of_max(per_token);
    p.choice_norm_bytes = index_of_max(per_byte);
    result.acc += p.choice == p.label;
    result.acc_norm += p.choice_norm == p.label;
    result.acc_norm_bytes += p.choice_norm_bytes == p.label;
    result.predictions.push_back(std::move(p));
  }
  result.acc /= double(result.n);
  result.acc_norm /= double(result.n);
  result.acc_norm_bytes /= double(result.n);
  return result;
}

ChoiceResult score_choices(model::Model& model, const data::Tokenizer& tokenizer,
                           const std::vector<ChoiceExample>& examples, const std::string& task,
                           std::int64_t context_length, std::int64_t vocab_size, dist::Communicator* comm) {
  const int W = comm ? comm->world_size() : 1, rank = comm ? comm->rank() : 0;
  const std::vector<ChoiceSequence> sequences = choice_sequences(tokenizer, examples, context_length);
  // Every choice's log-likelihood, summed over the ranks (each fills its examples').
  std::vector<double> logliks(sequences.size(), 0.0);
  std::vector<std::int32_t> inputs;
  std::size_t at = 0;  // example i's first choice
  for (std::size_t i = 0; i < examples.size(); at += examples[i].choices.size(), ++i) {
    if (i % std::size_t(W) != std::size_t(rank)) continue;
    for (std::size_t c = 0; c < examples[i].choices.size(); ++c) {
      const ChoiceSequence& sequence = sequences[at + c];
      const int T = int(sequence.tokens.size()) - 1;
      inputs.assign(sequence.tokens.begin(), sequence.tokens.end() - 1);
      model.forward(inputs.data(), nullptr, 1, T, 0.0f);
      const float* logits = model.logits().as<float>();  // (1, T, V)
      double loglik = 0.0;
      for (std::int64_t k = 0; k < sequence.ending; ++k) {
        const std::size_t position = std::size_t(T - sequence.ending + k);  // predicts tokens[position + 1]
        const float* row = logits + position * std::size_t(vocab_size);
        double max = -std::numeric_limits<double>::infinity();
        for (std::int64_t v = 0; v < vocab_size; ++v) max = std::max(max, double(row[v]));
        double sum = 0.0;
        for (std::int64_t v = 0; v < vocab_size; ++v) sum += std::exp(double(row[v]) - max);
        loglik += double(row[sequence.tokens[position + 1]]) - max - std::log(sum);
      }
      logliks[at + c] = loglik;
    }
  }
  if (comm) comm->all_reduce_sum(logliks.data(), std::int64_t(logliks.size()));
  return choice_result(examples, sequences, logliks, task);
}

nlohmann::json to_json(const ChoiceResult& result) {
  nlohmann::json predictions = nlohmann::json::array();
  for (const ChoicePrediction& p : result.predictions) {
    predictions.push_back({{"index", p.index},
                           {"label", p.label},
                           {"choice", p.choice},
                           {"choice_norm", p.choice_norm},
                           {"choice_norm_bytes", p.choice_norm_bytes},
                           {"logliks", p.logliks},
                           {"ending_tokens", p.ending_tokens}});
  }
  return {{"task", result.task}, {"n", result.n}, {"acc", result.acc}, {"acc_norm", result.acc_norm},
          {"acc_norm_bytes", result.acc_norm_bytes}, {"predictions", std::move(predictions)}};
}

}  // namespace llmtrain::eval
