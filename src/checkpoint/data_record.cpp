#include "checkpoint/data_record.h"

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "data/shard.h"

namespace llmtrain::checkpoint {
namespace {

std::string source_key(const nlohmann::json& source, std::size_t index) {
  const std::string name = source.value("name", std::string());
  return "data.train[" + std::to_string(index) + "]" + (name.empty() ? "" : " (" + name + ")");
}

// Each source's weight as a share of their sum: weights 7, 3 and 0.7, 0.3 are the same mixture.
std::vector<double> shares(const nlohmann::json& sources) {
  double total = 0;
  for (const auto& s : sources) {
    const double w = s.at("weight").get<double>();
    if (!(w > 0) || !std::isfinite(w)) throw std::domain_error("a weight that is not a number > 0");
    total += w;
  }
  std::vector<double> out;
  for (const auto& s : sources) out.push_back(s.at("weight").get<double>() / total);
  return out;
}

std::string number(double x) {
  std::ostringstream out;
  out.precision(6);
  out << x;
  return out.str();
}

std::string shard_phrase(const nlohmann::json& shard) {
  return shard.at("path").get<std::string>() + " (" + std::to_string(shard.at("bytes").get<std::int64_t>()) + " bytes)";
}

}  // namespace

nlohmann::json data_record(const config::TrainData& train) {
  nlohmann::json sources = nlohmann::json::array();
  for (std::size_t s = 0; s < train.sources.size(); ++s) {
    const config::TrainSource& source = train.sources[s];
    const std::string key = train.sources.size() == 1 ? "data.train" : "data.train[" + std::to_string(s) + "].path";
    nlohmann::json shards = nlohmann::json::array();
    for (const std::string& path : data::expand_paths(source.paths, key)) {
      shards.push_back({{"path", path}, {"bytes", std::int64_t(std::filesystem::file_size(path))}});
    }
    nlohmann::json entry = {{"paths", source.paths}, {"weight", source.weight}, {"shards", std::move(shards)}};
    if (!source.name.empty()) entry["name"] = source.name;
    sources.push_back(std::move(entry));
  }
  return {{"sources", std::move(sources)}};
}

std::string data_record_change(const nlohmann::json& saved, const nlohmann::json& now) {
  const nlohmann::json& was = saved.at("sources");
  const nlohmann::json& is = now.at("sources");
  if (was.size() != is.size()) {
    return "data.train: " + std::to_string(is.size()) + " source(s), the checkpoint's " + std::to_string(was.size());
  }
  const std::vector<double> was_shares = shares(was), is_shares = shares(is);
  for (std::size_t s = 0; s < is.size(); ++s) {
    // (decimal weights and their integer multiples agree to rounding: 1e-12 of the whole)
    if (std::abs(was_shares[s] - is_shares[s]) > 1e-12) {
      return source_key(is[s], s) + ": weight " + number(is[s].at("weight").get<double>()) + " (a share of " +
             number(is_shares[s]) + "), the checkpoint's " + number(was[s].at("weight").get<double>()) +
             " (a share of " + number(was_shares[s]) + ")";
    }
  }
  for (std::size_t s = 0; s < is.size(); ++s) {
    const nlohmann::json &a = was[s].at("shards"), &b = is[s].at("shards");
    for (std::size_t f = 0; f < std::max(a.size(), b.size()); ++f) {
      if (f < a.size() && f < b.size() && a[f] == b[f]) continue;
      const std::string at = source_key(is[s], s) + " = " + nlohmann::json(is[s].at("paths")).dump() + ": shard " +
                             std::to_string(f) + " is ";
      if (f >= b.size()) return at + "gone (" + std::to_string(b.size()) + " shards), the checkpoint's " + shard_phrase(a[f]);
      if (f >= a.size()) return at + shard_phrase(b[f]) + ", new (the checkpoint's " + std::to_string(a.size()) + " shards)";
      return at + shard_phrase(b[f]) + ", the checkpoint's " + shard_phrase(a[f]);
    }
  }
  return "";
}

}  // namespace llmtrain::checkpoint
