#include "train/choice_eval.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>

#include "core/error.h"
#include "core/files.h"
#include "core/json_file.h"
#include "core/strings.h"

namespace llmtrain::train {
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
  std::size_t start = 0;
  for (std::int64_t line = 1; start < text.size() && (limit <= 0 || std::int64_t(examples.size()) < limit); ++line) {
    std::size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    std::string_view row(text.data() + start, end - start);
    start = end + 1;
    if (row.find_first_not_of(" \t\r") == std::string_view::npos) continue;
    const std::string where = path + ":" + std::to_string(line);
    if (std::size_t bad = 0; !is_valid_utf8(row, &bad)) {
      throw InputError(where + ": byte " + std::to_string(bad + 1) + " of the line is not valid UTF-8");
    }
    nlohmann::json object;
    try {
      object = nlohmann::json::parse(row);
    } catch (const nlohmann::json::parse_error& e) {
      std::string reason = e.what();
      if (const auto colon = reason.find("]: "); colon != std::string::npos) reason = reason.substr(colon + 3);
      throw InputError(where + ": malformed JSON: " + reason);
    }
    if (!object.is_object()) throw InputError(where + ": expected a JSON object, got " + json_excerpt(object));
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
  }
  if (examples.empty()) throw InputError(path + ": no examples");
  return examples;
}

ChoiceResult score_choices(model::Model& model, const data::Tokenizer& tokenizer,
                           const std::vector<ChoiceExample>& examples, const std::string& task,
                           std::int64_t context_length, std::int64_t vocab_size, dist::Communicator* comm) {
  const int W = comm ? comm->world_size() : 1, rank = comm ? comm->rank() : 0;
  // Every choice's log-likelihood and token count, in one flat array summed over the ranks.
  std::vector<std::size_t> first(examples.size() + 1, 0);
  for (std::size_t i = 0; i < examples.size(); ++i) first[i + 1] = first[i] + examples[i].choices.size();
  std::vector<double> figures(2 * first.back(), 0.0);  // loglik, then tokens, per choice
  std::vector<std::int32_t> inputs;
  for (std::size_t i = std::size_t(rank); i < examples.size(); i += std::size_t(W)) {
    const ChoiceExample& example = examples[i];
    std::vector<std::uint32_t> context = tokenizer.encode(example.context);
    if (context.empty()) {
      if (!tokenizer.eot_token()) throw InputError("example " + std::to_string(i) + ": empty context");
      context.push_back(*tokenizer.eot_token());  // the ending's first token needs something before it
    }
    for (std::size_t c = 0; c < example.choices.size(); ++c) {
      const std::vector<std::uint32_t> ending = tokenizer.encode(" " + example.choices[c]);
      std::vector<std::uint32_t> sequence = context;
      sequence.insert(sequence.end(), ending.begin(), ending.end());
      if (std::int64_t(ending.size()) > context_length) {
        throw InputError("example " + std::to_string(i) + ", choice " + std::to_string(c) + ": " +
                         std::to_string(ending.size()) + " tokens, more than the model's context (" +
                         std::to_string(context_length) + ")");
      }
      // At most context_length + 1 tokens: the context's last ones.
      if (std::int64_t(sequence.size()) > context_length + 1) {
        sequence.erase(sequence.begin(), sequence.end() - (context_length + 1));
      }
      const int T = int(sequence.size()) - 1;
      inputs.assign(sequence.begin(), sequence.end() - 1);
      model.forward(inputs.data(), nullptr, 1, T, 0.0f);
      const float* logits = model.logits().as<float>();  // (1, T, V)
      double loglik = 0.0;
      for (std::size_t k = 0; k < ending.size(); ++k) {
        const std::size_t position = std::size_t(T) - ending.size() + k;  // predicts sequence[position + 1]
        const float* row = logits + position * std::size_t(vocab_size);
        double max = -std::numeric_limits<double>::infinity();
        for (std::int64_t v = 0; v < vocab_size; ++v) max = std::max(max, double(row[v]));
        double sum = 0.0;
        for (std::int64_t v = 0; v < vocab_size; ++v) sum += std::exp(double(row[v]) - max);
        loglik += double(row[ending[k]]) - max - std::log(sum);
      }
      figures[2 * (first[i] + c)] = loglik;
      figures[2 * (first[i] + c) + 1] = double(ending.size());
    }
  }
  if (comm) comm->all_reduce_sum(figures.data(), std::int64_t(figures.size()));

  ChoiceResult result;
  result.task = task;
  result.n = std::int64_t(examples.size());
  for (std::size_t i = 0; i < examples.size(); ++i) {
    const ChoiceExample& example = examples[i];
    ChoicePrediction p;
    p.index = std::int64_t(i);
    p.label = example.label;
    std::vector<double> per_token, per_byte;
    for (std::size_t c = 0; c < example.choices.size(); ++c) {
      const double loglik = figures[2 * (first[i] + c)];
      const auto tokens = std::int64_t(figures[2 * (first[i] + c) + 1]);
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

}  // namespace llmtrain::train
