// model.moe: the Mixture-of-Experts keys as one JSON object inside the model section (or null, or
// absent: a dense model). Each key is read against its range as a section's keys are; the reader
// (config/reader.cpp) hands the object here.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "config/config.h"
#include "config/origins.h"

namespace llmtrain::config {

/// Reads `v` (the value of model.moe, at `path`) into `out`: null (dense), or an object of
/// MoeConfig's keys, each in its range, experts, top_k and ffn_hidden required; InputError naming
/// the key (with a "did you mean") for an unknown one.
void read_moe_keys(const nlohmann::json& v, const std::string& path, MoeConfig& out, const Origins& o);

/// model.moe as the resolved config writes it: null for a dense model.
nlohmann::json moe_keys_json(const MoeConfig& m);

}  // namespace llmtrain::config
