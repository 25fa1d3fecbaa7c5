// What a run folder's metrics.jsonl says, read the way the tests compare runs.
#pragma once

#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace llmtrain::test {

/// The training losses a run logged, step by step, from RUN/metrics.jsonl (validation and
/// checkpoint records, which carry no "loss", left out).
inline std::vector<double> training_losses(const std::string& run) {
  std::vector<double> out;
  std::ifstream metrics(run + "/metrics.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    const auto m = nlohmann::json::parse(line);
    if (m.contains("loss")) out.push_back(m["loss"].get<double>());
  }
  return out;
}

}  // namespace llmtrain::test
