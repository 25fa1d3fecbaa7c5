// optim.muon: the Muon optimizer's keys as one JSON object inside the optim section. Each key is
// read against its range as a section's keys are; the reader (config/reader.cpp) hands the
// object here.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "config/config.h"
#include "config/origins.h"

namespace llmtrain::config {

/// Reads `v` (the value of optim.muon, at `path`) into `out`: an object of MuonConfig's keys, each
/// in its range; InputError naming the key (with a "did you mean") for an unknown one.
void read_muon_keys(const nlohmann::json& v, const std::string& path, MuonConfig& out, const Origins& o);

/// optim.muon as the resolved config writes it; lr and weight_decay only when given (absent, they
/// follow optim.lr and optim.weight_decay).
nlohmann::json muon_keys_json(const MuonConfig& m);

}  // namespace llmtrain::config
