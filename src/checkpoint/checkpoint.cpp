#include "checkpoint/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <optional>
#include <cmath>
#include <map>
#include <thread>
#include <memory>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "checkpoint/safetensors.h"
#include "core/error.h"
#include "core/files.h"
#include "core/json_file.h"
#include "llmtrain/build_info.h"
#include "model/arch.h"

namespace llmtrain::checkpoint {
namespace {

namespace fs = std::filesystem;

// Writes a small text file atomically: an exclusive temporary name, fsync, rename (core/files.h).
void write_text_atomic(const std::string& path, const std::string& text) { write_file_atomic(path, text); }

std::string step_dir_name(std::int64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "step_%08lld", static_cast<long long>(step));
  return name;
}

std::vector<float> transposed(const float* x, std::int64_t rows, std::int64_t cols) {
  std::vector<float> out(std::size_t(rows * cols));
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < cols; ++c) out[std::size_t(c * rows + r)] = x[r * cols + c];
  }
  return out;
}

}  // namespace

std::int64_t OptimizerShard::size() const {
  std::int64_t n = 0;
  for (const FlatRange& r : ranges) n += r.end - r.begin;
  return n;
}

std::int64_t WrittenPart::bytes() const {
  std::int64_t total = 0;
  for (const auto& f : files) total += f.bytes;
  return total;
}

namespace {

std::string optim_file(int shard) {
  char file[40];
  std::snprintf(file, sizeof file, "optim-%05d.safetensors", shard);
  return file;
}

}  // namespace

std::string prepare_dir(const std::string& root, std::int64_t step, dist::Communicator& comm) {
  const std::string dir = root + "/" + step_dir_name(step);
  if (comm.rank() == 0) {
    fs::create_directories(root);
    fs::remove_all(dir);  // an incomplete attempt at this step (no COMPLETE) is not a checkpoint
    fs::create_directories(dir);
  }
  comm.barrier();
  return dir;
}

WrittenPart write_part(const SaveRequest& r, const std::string& dir, int rank, int world_size) {
  const model::Model& m = *r.model;
  const auto start = std::chrono::steady_clock::now();
  struct Job {
    std::string name;
    std::vector<TensorToWrite> tensors;
    std::map<std::string, std::string> metadata;
    WrittenPart::File written;
    std::string error;
  };
  std::vector<Job> jobs;
  const std::int64_t P = m.num_params();
  const auto& ranges = r.optimizer.ranges;
  const bool whole_state = ranges.size() == 1 && ranges[0].begin == 0 && ranges[0].end == P;
  if (r.write_optimizer && (!whole_state || rank == 0)) {
    const std::int64_t n = r.optimizer.size();
    std::map<std::string, std::string> metadata{{"rank", std::to_string(rank)}, {"world_size", std::to_string(world_size)}};
    if (ranges.size() == 1) {
      metadata["range_begin"] = std::to_string(ranges[0].begin);
      metadata["range_end"] = std::to_string(ranges[0].end);
    } else {
      std::string list;
      for (const FlatRange& range : ranges) {
        list += (list.empty() ? "" : ",") + std::to_string(range.begin) + ":" + std::to_string(range.end);
      }
      metadata["ranges"] = list;
    }
    jobs.push_back({optim_file(rank),
                    {{"adamw.m", StDtype::f32, {n}, r.optimizer.m}, {"adamw.v", StDtype::f32, {n}, r.optimizer.v}},
                    std::move(metadata),
                    {},
                    {}});
  }
  if (rank == 0) {
    const float* flat = r.weights ? r.weights : m.params().as<float>();
    Job weights{"model.safetensors", {}, {{"format", "llmtrain"}, {"arch", config::to_string(m.config().arch)}}, {}, {}};
    for (const auto& info : m.param_infos()) weights.tensors.push_back({info.name, StDtype::f32, info.shape, flat + info.offset});
    jobs.push_back(std::move(weights));
  }
  const auto run = [&](Job& job) {
    try {
      const std::string path = dir + "/" + job.name;
      const std::uint32_t crc = write_safetensors(path, job.tensors, job.metadata, r.write_chunk);
      job.written = {job.name, crc, std::int64_t(fs::file_size(path))};
    } catch (const std::exception& e) {
      job.error = e.what();
    }
  };
  // The files of one rank go to the disk side by side: one thread each beyond the first.
  std::vector<std::thread> threads;
  for (std::size_t i = 1; i < jobs.size(); ++i) threads.emplace_back(run, std::ref(jobs[i]));
  if (!jobs.empty()) run(jobs[0]);
  for (auto& t : threads) t.join();

  WrittenPart part;
  for (auto& job : jobs) {
    if (!job.error.empty() && part.error.empty()) part.error = job.error;
    part.files.push_back(job.written);
  }
  part.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return part;
}

Committed commit(const SaveRequest& r, const WrittenPart& mine, dist::Communicator& comm) {
  const int rank = comm.rank(), W = comm.world_size();
  const std::string name = step_dir_name(r.step);
  const std::string dir = r.root + "/" + name;
  // Agreement first: the lowest rank whose writing failed (W when none did).
  std::int64_t failed = mine.error.empty() ? -W : -rank;
  comm.all_reduce_max(&failed, 1);
  if (-failed != W) {
    if (!mine.error.empty()) throw RuntimeError(mine.error);
    throw RuntimeError(dir + ": rank " + std::to_string(-failed) + " could not write its part of the checkpoint");
  }

  // Each rank's file checksum and size land in its slot (the weights in slot W); a max-reduction
  // gathers them on all ranks, with the slowest write time at the end.
  std::vector<std::int64_t> crc(std::size_t(W) + 1, -1), bytes(std::size_t(W) + 2, -1);
  for (const auto& f : mine.files) {
    const std::size_t slot = f.name == "model.safetensors" ? std::size_t(W) : std::size_t(rank);
    crc[slot] = f.crc32;
    bytes[slot] = f.bytes;
  }
  bytes[std::size_t(W) + 1] = std::int64_t(mine.seconds * 1e6);
  comm.all_reduce_max(crc.data(), std::int64_t(crc.size()));
  comm.all_reduce_max(bytes.data(), std::int64_t(bytes.size()));

  Committed done{dir, 0, double(bytes[std::size_t(W) + 1]) / 1e6};
  for (std::size_t k = 0; k <= std::size_t(W); ++k) done.bytes += std::max<std::int64_t>(bytes[k], 0);
  std::string error;
  if (rank == 0) {
    try {
      nlohmann::json files = nlohmann::json::object();
      files["model.safetensors"] = {{"crc32", crc[std::size_t(W)]}, {"bytes", bytes[std::size_t(W)]}};
      for (int k = 0; k < W; ++k) {
        if (crc[std::size_t(k)] >= 0) files[optim_file(k)] = {{"crc32", crc[std::size_t(k)]}, {"bytes", bytes[std::size_t(k)]}};
      }
      nlohmann::json state = r.state;
      state["step"] = r.step;
      state["files"] = files;
      state["llmtrain_version"] = build::version;
      write_text_atomic(dir + "/state.json", state.dump(2) + "\n");
      write_text_atomic(dir + "/COMPLETE", "");
      write_text_atomic(r.root + "/latest", name + "\n");

      // Only now, with a newer complete checkpoint on disk, are old ones deleted.
      std::vector<std::string> complete;
      for (const auto& entry : fs::directory_iterator(r.root)) {
        const std::string n = entry.path().filename().string();
        if (n.starts_with("step_") && fs::exists(entry.path() / "COMPLETE")) complete.push_back(n);
      }
      std::sort(complete.begin(), complete.end());
      for (std::size_t i = 0; i + std::size_t(r.keep_last) < complete.size(); ++i) {
        fs::remove_all(r.root + "/" + complete[i]);
      }
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  // Rank 0's outcome on every rank, so that none goes on alone when the commit failed.
  std::int64_t commit_failed = error.empty() ? 0 : 1;
  if (W > 1) comm.all_reduce_max(&commit_failed, 1);
  if (!error.empty()) throw RuntimeError(error);
  if (commit_failed) throw RuntimeError(dir + ": rank 0 could not complete the checkpoint");
  return done;
}

std::string save(const SaveRequest& r, dist::Communicator& comm) {
  const std::string dir = prepare_dir(r.root, r.step, comm);
  return commit(r, write_part(r, dir, comm.rank(), comm.world_size()), comm).dir;
}

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

std::string hf_architecture(const config::ModelConfig& c) { return model::arch_spec(c.arch).hf_architecture; }

namespace {

// The tensors of a Hugging Face checkpoint: one safetensors file, or the shards a
// model.safetensors.index.json names.
class HfTensors {
 public:
  explicit HfTensors(const std::string& path) {
    if (!is_directory(path)) {
      if (!path_exists(path)) throw InputError("model.init_from: " + path + ": no such file");
      open(path);
      return;
    }
    if (path_exists(path + "/model.safetensors")) {
      open(path + "/model.safetensors");
      return;
    }
    const std::string index = path + "/model.safetensors.index.json";
    if (!path_exists(index)) {
      throw InputError("model.init_from: " + path + ": no model.safetensors or model.safetensors.index.json in it");
    }
    const nlohmann::json map = read_json_file(index, "a safetensors shard index");
    if (!map.contains("weight_map") || !map["weight_map"].is_object()) {
      throw InputError(index + ": no \"weight_map\" object");
    }
    std::set<std::string> files;
    for (const auto& [name, file] : map["weight_map"].items()) {
      if (!file.is_string() || !is_plain_file_name(file.get<std::string>())) {
        throw InputError(index + ": weight_map." + name + ": expected a plain file name beside the index, got " +
                         json_excerpt(file));
      }
      files.insert(file.get<std::string>());
    }
    for (const auto& file : files) open(path + "/" + file);
  }

  /// The reader holding `name` and the tensor's entry, or {nullptr, nullptr}.
  std::pair<const SafetensorsReader*, const TensorInfo*> find(const std::string& name) const {
    for (const auto& reader : readers_) {
      if (const TensorInfo* t = reader->find(name)) return {reader.get(), t};
    }
    return {nullptr, nullptr};
  }
  const std::vector<std::unique_ptr<SafetensorsReader>>& readers() const { return readers_; }
  std::string describe() const { return readers_.size() == 1 ? readers_[0]->path() : path_of_shards(); }

 private:
  void open(const std::string& file) { readers_.push_back(std::make_unique<SafetensorsReader>(file)); }
  std::string path_of_shards() const {
    return fs::path(readers_.front()->path()).parent_path().string() + " (" + std::to_string(readers_.size()) +
           " shards)";
  }
  std::vector<std::unique_ptr<SafetensorsReader>> readers_;
};

// A folder's config.json must agree with the run's config on what the weights' shapes do not show
// (Llama: rotary base, norm epsilon, tying); a mismatch would silently change the model.
void check_hf_config(const std::string& path, const config::ModelConfig& c, const model::ArchSpec& spec) {
  if (spec.hf_checked_keys.empty()) return;
  const std::string file = (is_directory(path) ? fs::path(path) : fs::path(path).parent_path()) / "config.json";
  if (!path_exists(file)) return;
  const nlohmann::json hf = read_json_file(file, "a Hugging Face config.json");
  const nlohmann::json expected = spec.hf_config(c);
  for (const auto& [hf_key, our_key] : spec.hf_checked_keys) {
    if (!hf.contains(hf_key)) continue;
    const nlohmann::json& theirs = hf[hf_key];
    const nlohmann::json& ours = expected.at(hf_key);
    if (ours.is_boolean()) {
      if (!theirs.is_boolean() || theirs.get<bool>() == ours.get<bool>()) continue;
      throw InputError("model." + our_key + ": the config has " + (ours.get<bool>() ? "true" : "false") + ", but " +
                       file + " has " + hf_key + " = " + (theirs.get<bool>() ? "true" : "false"));
    }
    if (!theirs.is_number()) continue;
    const double a = theirs.get<double>(), b = ours.get<double>();
    if (std::abs(a - b) > 1e-9 * std::max(1.0, std::abs(b))) {
      std::ostringstream message;
      message << "model." << our_key << ": the config has " << b << ", but " << file << " has " << hf_key << " = "
              << a;
      throw InputError(message.str());
    }
  }
}

}  // namespace

void export_hf(const model::Model& model, const std::string& dir) {
  const model::ArchSpec& spec = model::arch_spec(model.config().arch);
  fs::create_directories(dir);
  std::vector<std::vector<float>> keep;  // transposed copies live until written
  std::vector<TensorToWrite> tensors;
  for (const auto& info : model.param_infos()) {
    const float* data = model.param(info).as<float>();
    std::vector<std::int64_t> shape = info.shape;
    if (spec.hf_transposed(info.name)) {
      keep.push_back(transposed(data, shape[0], shape[1]));
      data = keep.back().data();
      std::swap(shape[0], shape[1]);
    }
    tensors.push_back({info.name, StDtype::f32, shape, data});
  }
  write_safetensors(dir + "/model.safetensors", tensors, {{"format", "pt"}});
  write_hf_config(model.config(), dir);
}

void write_hf_config(const config::ModelConfig& config, const std::string& dir) {
  write_text_atomic(dir + "/config.json", model::arch_spec(config.arch).hf_config(config).dump(2) + "\n");
}

void import_hf(const std::string& path, model::Model& model) {
  const model::ArchSpec& spec = model::arch_spec(model.config().arch);
  const HfTensors source(path);
  check_hf_config(path, model.config(), spec);
  const std::string where = source.describe();
  // Names with or without the prefix published files may leave out (GPT2LMHeadModel's "transformer.").
  const std::string prefix = spec.hf_optional_prefix;
  const auto hf_name = [&](const std::string& name) {
    auto found = source.find(name);
    if (!found.second && !prefix.empty() && name.starts_with(prefix)) found = source.find(name.substr(prefix.size()));
    return found;
  };
  std::set<std::string> used;
  for (const auto& info : model.param_infos()) {
    const auto [reader, t] = hf_name(info.name);
    if (!t) throw InputError(where + ": tensor " + info.name + " is missing");
    used.insert(t->name);
    const bool conv = spec.hf_transposed(info.name);
    std::vector<std::int64_t> expected = info.shape;
    if (conv) std::swap(expected[0], expected[1]);
    if (t->shape != expected) {
      std::ostringstream got, want;
      for (const auto d : t->shape) got << d << ' ';
      for (const auto d : expected) want << d << ' ';
      throw InputError(reader->path() + ": tensor " + t->name + " has shape [" + got.str() + "], the config needs [" +
                       want.str() + "]");
    }
    float* out = model.param(info).as<float>();
    if (!conv) {
      reader->read_f32(t->name, std::span<float>(out, std::size_t(info.numel)));
      continue;
    }
    std::vector<float> hf(std::size_t(info.numel));
    reader->read_f32(t->name, hf);
    const auto ours = transposed(hf.data(), expected[0], expected[1]);
    std::copy(ours.begin(), ours.end(), out);
  }
  for (const auto& reader : source.readers()) {
    for (const auto& t : reader->tensors()) {
      // A tied output head, the causal-mask buffers of older GPT-2 exports and the rotary
      // frequency buffers of older Llama exports carry no parameters.
      const bool ignorable = (t.name == "lm_head.weight" && model.config().tie_embeddings) ||
                             t.name.ends_with(".attn.bias") || t.name.ends_with(".attn.masked_bias") ||
                             t.name.ends_with(".rotary_emb.inv_freq");
      if (!used.contains(t.name) && !ignorable) throw InputError(reader->path() + ": unexpected tensor " + t.name);
    }
  }
}

}  // namespace llmtrain::checkpoint
