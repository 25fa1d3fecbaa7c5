// Native checkpoints, read back: finding the newest complete one, validating state.json and the
// files it lists, and loading the weights and the optimizer ranges a rank needs.
#include "checkpoint/checkpoint.h"

#include <sys/stat.h>

#include <algorithm>
#include <charconv>
#include <optional>
#include <memory>
#include <cstring>
#include <filesystem>

#include "checkpoint/safetensors.h"
#include "core/crc32.h"
#include "core/error.h"
#include "core/files.h"
#include "core/json_file.h"
#include "model/arch.h"

namespace llmtrain::checkpoint {
namespace {

namespace fs = std::filesystem;

}  // namespace

namespace {

// The bounds of state.json's numbers: far beyond any real run, far below overflow.
constexpr std::int64_t max_step = 1'000'000'000'000;
constexpr std::int64_t max_count = std::int64_t(1) << 56;  // tokens, samples, bytes, epochs
constexpr std::int64_t max_world_size = 1 << 20;

// state.json's key `key` of `object` as an integer in [lo, hi]; InputError naming file and key.
std::int64_t state_int(const nlohmann::json& object, const std::string& key, const std::string& where,
                       std::int64_t lo, std::int64_t hi) {
  return json_integer(json_key(object, key, where, "an integer from " + std::to_string(lo)), where + ": " + key, lo, hi);
}

const nlohmann::json& state_object(const nlohmann::json& object, const std::string& key, const std::string& where) {
  if (!object.contains(key) || !object.at(key).is_object()) {
    throw InputError(where + ": " + key + ": expected an object, got " +
                     (object.contains(key) ? json_excerpt(object.at(key)) : std::string("nothing (missing)")));
  }
  return object.at(key);
}

// A regular file's size by lstat (a link, a folder or a device is refused), or InputError.
std::uint64_t listed_file_size(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) throw InputError(path + ": missing (listed in state.json)");
  if (!S_ISREG(st.st_mode)) throw InputError(path + ": not a regular file (listed in state.json)");
  return std::uint64_t(st.st_size);
}

}  // namespace

void validate_state(const nlohmann::json& state, const std::string& file) {
  if (!state.is_object()) throw InputError(file + ": expected a JSON object, got " + json_excerpt(state));
  state_int(state, "step", file, 0, max_step);
  state_int(state, "tokens_seen", file, 0, max_count);
  state_int(state, "world_size", file, 1, max_world_size);
  state_int(state, "zero_stage", file, 0, 3);
  const nlohmann::json& sampler = state_object(state, "sampler", file);
  state_int(sampler, "epoch", file + ": sampler", 0, max_count);
  state_int(sampler, "next_sample", file + ": sampler", 0, max_count);
  state_object(state, "config", file);
  const nlohmann::json& files = state_object(state, "files", file);
  bool weights = false;
  for (const auto& [name, info] : files.items()) weights = weights || name == "model.safetensors" || name.starts_with("model-");
  if (!weights) throw InputError(file + ": files: no weights listed (model.safetensors or model-*.safetensors)");
  for (const auto& [name, info] : files.items()) {
    if (!is_plain_file_name(name)) {
      throw InputError(file + ": files: " + json_excerpt(name) + " is not a plain file name (no '/', not '..')");
    }
    const std::string where = file + ": files." + name;
    if (!info.is_object()) throw InputError(where + ": expected an object, got " + json_excerpt(info));
    state_int(info, "crc32", where, 0, 0xFFFFFFFFll);
    const std::int64_t bytes = state_int(info, "bytes", where, 0, max_count);
    if (info.contains("chunk_crc32") || info.contains("chunk_bytes")) {
      const std::int64_t chunk = state_int(info, "chunk_bytes", where, 1, max_count);
      const nlohmann::json& list = info.contains("chunk_crc32") ? info.at("chunk_crc32") : nlohmann::json();
      const std::int64_t chunks = (bytes + chunk - 1) / chunk;
      if (!list.is_array() || std::int64_t(list.size()) != chunks) {
        throw InputError(where + ": chunk_crc32: expected a list of " + std::to_string(chunks) + " checksums (one per " +
                         std::to_string(chunk) + " bytes), got " + json_excerpt(list));
      }
      // The chunks' checksums must combine to the whole file's: a reader checks only the chunks it
      // reads, so a damaged list (or crc32) would otherwise go unseen.
      std::uint32_t whole = 0;
      std::int64_t at = 0;
      for (const auto& c : list) {
        if (!c.is_number_integer() || c.get<std::int64_t>() < 0 || c.get<std::int64_t>() > 0xFFFFFFFFll) {
          throw InputError(where + ": chunk_crc32: expected integers from 0 to 4294967295, got " + json_excerpt(c));
        }
        const std::int64_t length = std::min(chunk, bytes - at);
        whole = at == 0 ? c.get<std::uint32_t>() : crc32_combine(whole, c.get<std::uint32_t>(), std::uint64_t(length));
        at += length;
      }
      if (chunks > 0 && whole != info.at("crc32").get<std::uint32_t>()) {
        throw DamagedCheckpoint(where + ": the chunk checksums combine to crc32 " + std::to_string(whole) + ", not " +
                                std::to_string(info.at("crc32").get<std::uint32_t>()) + " (state.json is damaged)");
      }
    }
  }
}

std::string resolve_dir(const std::string& path) {
  // `latest` is a small text file naming a step folder beside it; a link loop, a folder or a
  // device in its place is an error, not a crash or a hang.
  std::string dir = path;
  if (path_exists(path + "/checkpoints/latest")) dir = path + "/checkpoints";
  if (path_exists(dir + "/latest")) {
    const std::string latest = dir + "/latest";
    std::string name = read_regular_file(latest, "a file naming the newest step folder", 4096);
    if (const auto end = name.find('\n'); end != std::string::npos) name.resize(end);
    if (!is_plain_file_name(name)) {
      throw InputError(latest + ": expected the name of a step folder beside it, got " + json_excerpt(name));
    }
    dir += "/" + name;
  }
  return dir;
}

Found find(const std::string& path) {
  const std::string dir = resolve_dir(path);
  if (!path_exists(dir + "/state.json")) {
    throw InputError(path + ": not a checkpoint (no state.json; expected a step folder, a checkpoints folder or a run folder)");
  }
  if (!path_exists(dir + "/COMPLETE")) throw InputError(dir + ": incomplete checkpoint (no COMPLETE file)");
  const std::string state_file = dir + "/state.json";
  const std::string state_text = read_regular_file(state_file, "the state.json of a checkpoint", std::uint64_t(1) << 30);
  Found found{dir, parse_json_text(state_text, state_file), {}};
  validate_state(found.state, state_file);
  // Sizes (cheap, and no read of a file that is not what was written).
  for (const auto& [file, info] : found.state["files"].items()) {
    const std::string file_path = dir + "/" + file;
    const std::uint64_t bytes = listed_file_size(file_path);
    if (bytes != info.at("bytes").get<std::uint64_t>()) {
      throw InputError(file_path + ": " + std::to_string(bytes) + " bytes, state.json says " +
                       std::to_string(info.at("bytes").get<std::uint64_t>()) + " (the file is damaged)");
    }
  }
  // Checksums: as each rank reads the chunks it needs (load_state), or all (verify_files).
  found.config = config::parse_config(found.state["config"].dump(), state_file);
  // Last, so that a state.json that is not one is named for what is wrong in it: whether its
  // bytes are those the commit recorded.
  check_state_file(dir, state_text);
  return found;
}

std::string complete_marker(std::string_view state_text) {
  const nlohmann::json marker = {{"state.json", {{"crc32", crc32(state_text)}, {"bytes", state_text.size()}}}};
  return marker.dump() + "\n";
}

void check_state_file(const std::string& dir, std::string_view state_text) {
  const std::string file = dir + "/COMPLETE";
  const std::string text = read_regular_file(file, "the commit marker of a checkpoint", 4096);
  if (text.empty()) return;  // an earlier version's marker: state.json has no checksum
  const nlohmann::json marker = parse_json_text(text, file);
  const nlohmann::json* listed = marker.is_object() && marker.contains("state.json") ? &marker.at("state.json") : nullptr;
  if (!listed || !listed->is_object()) {
    throw InputError(file + ": expected {\"state.json\": {\"crc32\": ..., \"bytes\": ...}}, got " + json_excerpt(marker));
  }
  const std::int64_t crc = state_int(*listed, "crc32", file + ": state.json", 0, 0xFFFFFFFFll);
  const std::int64_t bytes = state_int(*listed, "bytes", file + ": state.json", 0, max_count);
  if (std::int64_t(state_text.size()) != bytes || crc32(state_text) != std::uint32_t(crc)) {
    throw DamagedCheckpoint(dir + "/state.json: " + std::to_string(state_text.size()) + " bytes of crc32 " +
                            std::to_string(crc32(state_text)) + ", the commit recorded " + std::to_string(bytes) +
                            " of crc32 " + std::to_string(crc) + " (the file is damaged)");
  }
}

std::vector<std::string> complete_checkpoints(const std::string& root) {
  std::vector<std::string> out;
  if (!is_directory(root)) return out;
  for (const auto& entry : fs::directory_iterator(root)) {
    const std::string n = entry.path().filename().string();
    if (n.starts_with("step_") && path_exists((entry.path() / "COMPLETE").string())) out.push_back(entry.path().string());
  }
  std::sort(out.rbegin(), out.rend());  // step_%08d names sort by step
  return out;
}

}  // namespace llmtrain::checkpoint
