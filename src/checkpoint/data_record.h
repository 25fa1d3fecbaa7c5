// What a checkpoint records of data.train, so that a resume reads the same history: each source's
// paths (as given), weight and resolved shard files (with their sizes), in state.json's "data".
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "config/config.h"

namespace llmtrain::checkpoint {

/// {"sources": [{"paths": [...], "weight": W, "shards": [{"path": P, "bytes": N}, ...]}, ...]}:
/// data.train's sources in order, each glob resolved as the trainer reads it.
nlohmann::json data_record(const config::TrainData& train);

/// How `now` differs from `saved` (both data_record()s) in what the trainer reads: the number of
/// sources, a source's share of the weights, or its shard files (a path or a size). Empty when it
/// reads the same samples in the same mixture; otherwise one phrase naming the first difference
/// ("data.train[1] (web): weight 0.5 of 1, the checkpoint's 0.3 of 1").
std::string data_record_change(const nlohmann::json& saved, const nlohmann::json& now);

}  // namespace llmtrain::checkpoint
