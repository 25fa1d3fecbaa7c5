#include "checkpoint/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
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
#include "core/json_file.h"
#include "llmtrain/build_info.h"
#include "model/arch.h"

namespace llmtrain::checkpoint {
namespace {

namespace fs = std::filesystem;

// Writes a small text file atomically: temporary name, fsync, rename.
void write_text_atomic(const std::string& path, const std::string& text) {
  const std::string temp = path + ".tmp";
  const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  bool ok = fd >= 0 && ::write(fd, text.data(), text.size()) == ssize_t(text.size()) && ::fsync(fd) == 0;
  if (fd >= 0) ok = (::close(fd) == 0) && ok;
  if (!ok) {
    std::remove(temp.c_str());
    throw RuntimeError(path + ": cannot write (disk full or no permission?)");
  }
  fs::rename(temp, path);
}

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
  const bool whole_state = r.optimizer.begin == 0 && r.optimizer.end == P;
  if (!whole_state || rank == 0) {
    const std::int64_t n = r.optimizer.end - r.optimizer.begin;
    jobs.push_back({optim_file(rank),
                    {{"adamw.m", StDtype::f32, {n}, r.optimizer.m}, {"adamw.v", StDtype::f32, {n}, r.optimizer.v}},
                    {{"range_begin", std::to_string(r.optimizer.begin)},
                     {"range_end", std::to_string(r.optimizer.end)},
                     {"rank", std::to_string(rank)},
                     {"world_size", std::to_string(world_size)}},
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

std::string resolve_dir(const std::string& path) {
  std::string dir = path;
  if (fs::exists(path + "/checkpoints/latest")) dir = path + "/checkpoints";
  if (fs::exists(dir + "/latest")) {
    std::ifstream latest(dir + "/latest");
    std::string name;
    std::getline(latest, name);
    dir += "/" + name;
  }
  return dir;
}

Found find(const std::string& path) {
  const std::string dir = resolve_dir(path);
  if (!fs::exists(dir + "/state.json")) {
    throw InputError(path + ": not a checkpoint (no state.json; expected a step folder, a checkpoints folder or a run folder)");
  }
  if (!fs::exists(dir + "/COMPLETE")) throw InputError(dir + ": incomplete checkpoint (no COMPLETE file)");
  Found found{dir, read_json_file(dir + "/state.json", "the state.json of a checkpoint"), {}};
  if (!found.state.contains("config") || !found.state.contains("files")) {
    throw InputError(dir + "/state.json: missing \"config\" or \"files\"");
  }
  for (const auto& [file, info] : found.state["files"].items()) {
    const std::string file_path = dir + "/" + file;
    if (!fs::exists(file_path)) throw InputError(file_path + ": missing (listed in state.json)");
    const auto crc = file_crc32(file_path);
    if (crc != info.value("crc32", std::uint64_t{0})) {
      throw InputError(file_path + ": checksum mismatch (the file is damaged)");
    }
  }
  found.config = config::parse_config(found.state["config"].dump(), dir + "/state.json");
  return found;
}

std::vector<std::string> complete_checkpoints(const std::string& root) {
  std::vector<std::string> out;
  if (!fs::is_directory(root)) return out;
  for (const auto& entry : fs::directory_iterator(root)) {
    const std::string n = entry.path().filename().string();
    if (n.starts_with("step_") && fs::exists(entry.path() / "COMPLETE")) out.push_back(entry.path().string());
  }
  std::sort(out.rbegin(), out.rend());  // step_%08d names sort by step
  return out;
}

void load_optimizer(const Found& found, std::int64_t begin, std::int64_t end, float* m, float* v) {
  std::int64_t covered = 0;
  for (const auto& [file, unused] : found.state["files"].items()) {
    if (!file.starts_with("optim-")) continue;
    const SafetensorsReader reader(found.dir + "/" + file);
    const auto& meta = reader.metadata();
    if (!meta.contains("range_begin") || !meta.contains("range_end")) {
      throw InputError(reader.path() + ": no range_begin/range_end in its metadata");
    }
    const std::int64_t file_begin = std::stoll(meta.at("range_begin")), file_end = std::stoll(meta.at("range_end"));
    const std::int64_t lo = std::max(begin, file_begin), hi = std::min(end, file_end);
    if (lo >= hi) continue;
    for (const auto& [name, out] : {std::pair{"adamw.m", m}, std::pair{"adamw.v", v}}) {
      const TensorInfo* t = reader.find(name);
      if (t && t->dtype == StDtype::f32 && t->shape == std::vector<std::int64_t>{file_end - file_begin}) {
        // Straight from the file's mapping: only the pages of the range this rank needs are read.
        const std::byte* bytes = reader.data(*t).data();
        std::memcpy(out + (lo - begin), bytes + std::size_t(lo - file_begin) * sizeof(float),
                    std::size_t(hi - lo) * sizeof(float));
        continue;
      }
      std::vector<float> part(std::size_t(file_end - file_begin));
      reader.read_f32(name, part);  // another dtype or size: converted, or refused naming the tensor
      std::copy(part.begin() + (lo - file_begin), part.begin() + (hi - file_begin), out + (lo - begin));
    }
    covered += hi - lo;
  }
  if (covered != end - begin) {
    throw InputError(found.dir + ": the optimizer files cover " + std::to_string(covered) + " of the " +
                     std::to_string(end - begin) + " elements [" + std::to_string(begin) + ", " +
                     std::to_string(end) + ") this rank needs");
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
    if (!fs::is_directory(path)) {
      if (!fs::exists(path)) throw InputError("model.init_from: " + path + ": no such file");
      open(path);
      return;
    }
    if (fs::exists(path + "/model.safetensors")) {
      open(path + "/model.safetensors");
      return;
    }
    const std::string index = path + "/model.safetensors.index.json";
    if (!fs::exists(index)) {
      throw InputError("model.init_from: " + path + ": no model.safetensors or model.safetensors.index.json in it");
    }
    const nlohmann::json map = read_json_file(index, "a safetensors shard index");
    if (!map.contains("weight_map") || !map["weight_map"].is_object()) {
      throw InputError(index + ": no \"weight_map\" object");
    }
    std::set<std::string> files;
    for (const auto& [name, file] : map["weight_map"].items()) {
      if (!file.is_string()) throw InputError(index + ": weight_map." + name + " is not a file name");
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
  const std::string file = (fs::is_directory(path) ? fs::path(path) : fs::path(path).parent_path()) / "config.json";
  if (!fs::exists(file)) return;
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
