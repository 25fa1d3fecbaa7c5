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
  const std::string name = where + ": " + key;
  if (!object.contains(key)) throw InputError(name + ": missing (expected an integer from " + std::to_string(lo) + ")");
  const nlohmann::json& v = object.at(key);
  const bool in_range = v.is_number_integer() &&
                        (v.is_number_unsigned() ? v.get<std::uint64_t>() <= std::uint64_t(hi)
                                                : v.get<std::int64_t>() >= lo && v.get<std::int64_t>() <= hi);
  if (!in_range || v.get<std::int64_t>() < lo) {
    throw InputError(name + ": expected an integer from " + std::to_string(lo) + " to " + std::to_string(hi) +
                     ", got " + json_excerpt(v));
  }
  return v.get<std::int64_t>();
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

// The whole of a decimal integer, or nullopt (no sign games, no trailing text, no overflow).
std::optional<std::int64_t> parse_int(const std::string& text) {
  std::int64_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end != text.data() + text.size() || text.empty()) return std::nullopt;
  return value;
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
  if (!files.contains("model.safetensors")) throw InputError(file + ": files: model.safetensors is not listed");
  for (const auto& [name, info] : files.items()) {
    if (!is_plain_file_name(name)) {
      throw InputError(file + ": files: " + json_excerpt(name) + " is not a plain file name (no '/', not '..')");
    }
    const std::string where = file + ": files." + name;
    if (!info.is_object()) throw InputError(where + ": expected an object, got " + json_excerpt(info));
    state_int(info, "crc32", where, 0, 0xFFFFFFFFll);
    state_int(info, "bytes", where, 0, max_count);
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
  Found found{dir, read_json_file(state_file, "the state.json of a checkpoint"), {}};
  validate_state(found.state, state_file);
  // Sizes first (cheap, and no read of a file that is not what was written), then checksums.
  for (const auto& [file, info] : found.state["files"].items()) {
    const std::string file_path = dir + "/" + file;
    const std::uint64_t bytes = listed_file_size(file_path);
    if (bytes != info.at("bytes").get<std::uint64_t>()) {
      throw InputError(file_path + ": " + std::to_string(bytes) + " bytes, state.json says " +
                       std::to_string(info.at("bytes").get<std::uint64_t>()) + " (the file is damaged)");
    }
  }
  for (const auto& [file, info] : found.state["files"].items()) {
    const std::string file_path = dir + "/" + file;
    if (file_crc32(file_path) != info.at("crc32").get<std::uint64_t>()) {
      throw InputError(file_path + ": checksum mismatch (the file is damaged)");
    }
  }
  found.config = config::parse_config(found.state["config"].dump(), state_file);
  return found;
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

namespace {

// The ranges an optimizer file holds, from its metadata: "ranges" ("b0:e0,b1:e1,...") or
// range_begin and range_end. InputError naming the file unless each is 0 <= begin <= end.
std::vector<FlatRange> file_ranges(const SafetensorsReader& reader) {
  const auto& meta = reader.metadata();
  std::vector<std::pair<std::string, std::string>> texts;
  if (meta.contains("ranges")) {
    const std::string& list = meta.at("ranges");
    for (std::size_t at = 0; at <= list.size();) {
      const std::size_t comma = std::min(list.find(',', at), list.size());
      const std::string item = list.substr(at, comma - at);
      const std::size_t colon = item.find(':');
      texts.emplace_back(item.substr(0, colon), colon == std::string::npos ? "" : item.substr(colon + 1));
      at = comma + 1;
    }
  } else if (meta.contains("range_begin") && meta.contains("range_end")) {
    texts.emplace_back(meta.at("range_begin"), meta.at("range_end"));
  } else {
    throw InputError(reader.path() + ": no range_begin/range_end or ranges in its metadata");
  }
  std::vector<FlatRange> ranges;
  for (const auto& [b, e] : texts) {
    const auto begin = parse_int(b), end = parse_int(e);
    if (!begin || !end || *begin < 0 || *end < *begin) {
      throw InputError(reader.path() + ": metadata range: expected integers 0 <= begin <= end, got " +
                       json_excerpt(b) + " and " + json_excerpt(e));
    }
    ranges.push_back({*begin, *end});
  }
  return ranges;
}

}  // namespace

void load_optimizer(const Found& found, const std::vector<FlatRange>& ranges, float* m, float* v) {
  std::int64_t covered = 0, wanted = 0;
  for (const FlatRange& r : ranges) wanted += r.end - r.begin;
  for (const auto& [file, unused] : found.state["files"].items()) {
    if (!file.starts_with("optim-")) continue;
    const SafetensorsReader reader(found.dir + "/" + file);
    const std::vector<FlatRange> held = file_ranges(reader);
    std::int64_t held_size = 0;
    for (const FlatRange& h : held) held_size += h.end - h.begin;
    // The ranges must agree with the tensors' sizes before anything is read.
    for (const char* name : {"adamw.m", "adamw.v"}) {
      const TensorInfo* t = reader.find(name);
      if (!t) throw InputError(reader.path() + ": no tensor " + name);
      if (t->dtype != StDtype::f32 || t->shape.size() != 1 || t->shape[0] != held_size) {
        throw InputError(reader.path() + ": tensor " + name + " must be F32 of shape [" + std::to_string(held_size) +
                         "] (the elements of the ranges in its metadata)");
      }
    }
    const std::byte* file_m = reader.data(*reader.find("adamw.m")).data();
    const std::byte* file_v = reader.data(*reader.find("adamw.v")).data();
    // Every overlap of a held range with a wanted one. Straight from the file's mapping: only
    // the pages this rank needs are read.
    std::int64_t held_at = 0;
    for (const FlatRange& h : held) {
      std::int64_t wanted_at = 0;
      for (const FlatRange& w : ranges) {
        const std::int64_t lo = std::max(w.begin, h.begin), hi = std::min(w.end, h.end);
        if (lo < hi) {
          const std::size_t from = std::size_t(held_at + (lo - h.begin)) * sizeof(float);
          const std::size_t bytes = std::size_t(hi - lo) * sizeof(float);
          std::memcpy(m + wanted_at + (lo - w.begin), file_m + from, bytes);
          std::memcpy(v + wanted_at + (lo - w.begin), file_v + from, bytes);
          covered += hi - lo;
        }
        wanted_at += w.end - w.begin;
      }
      held_at += h.end - h.begin;
    }
  }
  if (covered != wanted) {
    throw InputError(found.dir + ": the optimizer files cover " + std::to_string(covered) + " of the " +
                     std::to_string(wanted) + " elements of the flat-buffer range(s) this rank needs");
  }
}

void load_weights(const Found& found, model::Model& model) {
  const SafetensorsReader reader(found.dir + "/model.safetensors");
  for (const auto& info : model.param_infos()) {
    const Tensor p = model.param(info);
    reader.read_f32(info.name, std::span<float>(p.as<float>(), std::size_t(info.numel)));
  }
}

std::unique_ptr<model::Model> load_model(const Found& found) {
  // The config must describe a model whose weights the file can hold, before they are allocated.
  const double params = double(model::arch_spec(found.config.model.arch).parameter_count(found.config.model));
  const double bytes = double(found.state.at("files").at("model.safetensors").at("bytes").get<std::int64_t>());
  if (4.0 * params > bytes) {
    throw InputError(found.dir + "/model.safetensors: " + std::to_string(std::int64_t(bytes)) +
                     " bytes cannot hold the " + std::to_string(std::int64_t(params)) +
                     " fp32 parameters of the model in state.json's config");
  }
  auto model = model::make_model(found.config.model, Device::cpu);
  load_weights(found, *model);
  return model;
}
}  // namespace llmtrain::checkpoint
