// Reading a small JSON file (tokenizer files, checkpoint state), with errors that name the file.
#pragma once

#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace llmtrain {

/// Parses the JSON file at `path`; InputError "PATH: cannot open (expected `what`)" or
/// "PATH: not valid JSON: ...".
inline nlohmann::json read_json_file(const std::string& path, const std::string& what) {
  std::ifstream in(path);
  if (!in) throw InputError(path + ": cannot open (expected " + what + ")");
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw InputError(path + ": not valid JSON: " + e.what());
  }
}

}  // namespace llmtrain
