// Hugging Face's layout: model.init_from (import) and export --format hf, names, transposes and
// config.json as the architecture's spec (model/arch.h) gives them.
#include "checkpoint/checkpoint.h"

#include <fcntl.h>

#include <algorithm>
#include <cstdio>
#include <optional>
#include <cmath>
#include <memory>
#include <filesystem>
#include <limits>
#include <set>
#include <sstream>

#include "checkpoint/safetensors.h"
#include "core/bf16.h"
#include "core/error.h"
#include "core/files.h"
#include "core/json_file.h"
#include "model/arch.h"

namespace llmtrain::checkpoint {
namespace {

namespace fs = std::filesystem;

std::vector<float> transposed(const float* x, std::int64_t rows, std::int64_t cols) {
  std::vector<float> out(std::size_t(rows * cols));
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < cols; ++c) out[std::size_t(c * rows + r)] = x[r * cols + c];
  }
  return out;
}

// One Hugging Face tensor holding `count` consecutive elements of a logical parameter: they sit
// at `logical` in the whole model's flat buffer and at `stored` in the tensor (of `shape`).
struct HfPiece {
  std::string name;
  std::vector<std::int64_t> shape;
  std::int64_t logical = 0, stored = 0, count = 0;
  bool transposed = false;  // the whole parameter, stored (in, out)
};

// A logical parameter's forms in Hugging Face's files, the one export writes first. Most are one
// tensor of the same name; an MoE layer's stacked experts (E, I, C) are E tensors per expert
// (what transformers writes with save_pretrained), or transformers' fused in-memory
// experts.gate_up_proj (E, 2I, C), gate rows first, and experts.down_proj (E, C, I).
std::vector<std::vector<HfPiece>> hf_forms(const model::ArchSpec& spec, const config::ModelConfig& c,
                                           const model::ParamInfo& info) {
  std::vector<std::int64_t> shape = info.full_shape.empty() ? info.shape : info.full_shape;
  std::int64_t numel = 1;
  for (const auto d : shape) numel *= d;
  const bool conv = spec.hf_transposed(info.name);
  if (conv) std::swap(shape[0], shape[1]);
  const HfPiece whole{info.name, shape, info.logical_offset, 0, numel, conv};
  const auto at = info.name.find(".mlp.");
  if (!c.moe.enabled || at == std::string::npos) return {{whole}};
  const std::string layer = info.name.substr(0, at), rest = info.name.substr(at + 5);
  const bool mixtral = !c.qk_norm;
  if (rest == "gate.weight") {
    if (!mixtral) return {{whole}};
    HfPiece renamed = whole;
    renamed.name = layer + ".block_sparse_moe.gate.weight";
    return {{renamed}, {whole}};
  }
  if (!rest.starts_with("experts.")) return {{whole}};
  const std::string proj = rest.substr(8);  // gate_proj, up_proj, down_proj
  const std::int64_t E = shape[0], each = numel / E;
  std::vector<HfPiece> per_expert;
  for (std::int64_t e = 0; e < E; ++e) {
    const std::string hf = mixtral ? (proj == "gate_proj" ? "w1" : proj == "down_proj" ? "w2" : "w3") : proj;
    per_expert.push_back({layer + (mixtral ? ".block_sparse_moe" : ".mlp") + ".experts." + std::to_string(e) + "." +
                              hf + ".weight",
                          {shape[1], shape[2]}, info.logical_offset + e * each, 0, each, false});
  }
  if (proj == "down_proj") return {per_expert, {whole}};
  std::vector<HfPiece> fused;
  for (std::int64_t e = 0; e < E; ++e) {
    fused.push_back({layer + ".mlp.experts.gate_up_proj", {E, 2 * shape[1], shape[2]}, info.logical_offset + e * each,
                     (2 * e + (proj == "up_proj" ? 1 : 0)) * each, each, false});
  }
  return {per_expert, fused};
}

}  // namespace

std::string hf_architecture(const config::ModelConfig& c) {
  return model::arch_spec(c.arch).hf_config(c).at("architectures").at(0).get<std::string>();
}

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
  if (!hf.is_object()) throw InputError(file + ": expected a JSON object, got " + json_excerpt(hf));
  const nlohmann::json expected = spec.hf_config(c);
  for (const auto& [hf_key, our_key] : spec.hf_checked_keys) {
    if (!expected.contains(hf_key)) continue;  // a key of another kind of model (MoE keys of a dense one)
    // transformers 5 writes the rotary base inside rope_parameters; a null is a value left unset.
    const nlohmann::json* theirs = hf.contains(hf_key) ? &hf[hf_key] : nullptr;
    std::string key = hf_key;
    if (!theirs && hf_key == "rope_theta" && hf.contains("rope_parameters")) {
      if (const auto nested = json_optional_key(hf["rope_parameters"], hf_key, file + ": rope_parameters")) {
        theirs = &nested->get();
        key = "rope_parameters." + hf_key;
      }
    }
    const std::string where = file + ": " + key;
    if (!theirs || theirs->is_null()) continue;
    // Read by the type of the run's own value: "1" is not the number 1, nor 1 the boolean true.
    const nlohmann::json& ours = expected.at(hf_key);
    if (ours.is_boolean()) {
      const bool a = json_boolean(*theirs, where);
      if (a == ours.get<bool>()) continue;
      throw InputError("model." + our_key + ": the config has " + (ours.get<bool>() ? "true" : "false") + ", but " +
                       file + " has " + key + " = " + (a ? "true" : "false"));
    }
    const double a = ours.is_number_integer()
                         ? double(json_integer(*theirs, where, 0, std::numeric_limits<std::int32_t>::max()))
                         : json_number(*theirs, where, 0.0);
    const double b = ours.get<double>();
    if (std::abs(a - b) > 1e-9 * std::max(1.0, std::abs(b))) {
      throw InputError("model." + our_key + ": the config has " + number_text(b) + ", but " + file + " has " + key +
                       " = " + number_text(a));
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
    const auto forms = hf_forms(spec, model.config(), info);  // alive through the loop
    for (const HfPiece& piece : forms.front()) {
      const float* at = data + (piece.logical - info.logical_offset);
      if (piece.transposed) {
        keep.push_back(transposed(data, info.shape[0], info.shape[1]));
        at = keep.back().data();
      }
      tensors.push_back({piece.name, StDtype::f32, piece.shape, at});
    }
  }
  write_safetensors(dir + "/model.safetensors", tensors, {{"format", "pt"}});
  write_hf_config(model.config(), dir);
}

HfExported export_hf_streamed(const Found& found, const std::string& dir, const HfExportOptions& options) {
  check_weights_fit(found);
  const config::ModelConfig& c = found.config.model;
  const model::ArchSpec& spec = model::arch_spec(c.arch);
  // The whole model's parameter list, without buffers.
  const auto logical = model::make_model(c, Device::cpu, model::Recompute::none, DType::f32,
                                         ops::AttentionKernels::flash, model::Layout{true});
  const StDtype dtype = options.bf16 ? StDtype::bf16 : StDtype::f32;
  const std::int64_t element = std::int64_t(st_dtype_size(dtype));
  // Shards: the tensors in order, a new file whenever the next would pass shard_bytes.
  struct Shard {
    std::vector<HfPiece> params;
    std::int64_t bytes = 0;
  };
  std::vector<Shard> shards(1);
  for (const model::ParamInfo& info : logical->param_infos()) {
    const auto forms = hf_forms(spec, c, info);  // alive through the loop
    for (const HfPiece& piece : forms.front()) {
      const std::int64_t bytes = piece.count * element;
      if (!shards.back().params.empty() && shards.back().bytes + bytes > options.shard_bytes) shards.emplace_back();
      shards.back().params.push_back(piece);
      shards.back().bytes += bytes;
    }
  }
  const StateReader reader(found, StateKind::weights);
  fs::create_directories(dir);
  HfExported out;
  nlohmann::json weight_map = nlohmann::json::object();
  std::vector<float> values;    // one tensor, in the model's layout, then Hugging Face's
  std::vector<std::uint16_t> half;  // and as bf16
  for (std::size_t k = 0; k < shards.size(); ++k) {
    char name[64];
    std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", k + 1, shards.size());
    const std::string file = shards.size() == 1 ? std::string("model.safetensors") : std::string(name);
    std::vector<TensorToWrite> tensors;
    for (const HfPiece& piece : shards[k].params) {
      tensors.push_back({piece.name, dtype, piece.shape, nullptr});
      weight_map[piece.name] = file;
    }
    const auto bytes_of = [&](std::size_t i) -> const void* {
      const HfPiece& piece = shards[k].params[i];
      values.resize(std::size_t(piece.count));
      reader.read({{piece.logical, piece.logical + piece.count}}, {values.data()});
      if (piece.transposed) values = transposed(values.data(), piece.shape[1], piece.shape[0]);
      if (!options.bf16) return values.data();
      half.resize(values.size());
      for (std::size_t j = 0; j < values.size(); ++j) half[j] = float_to_bf16_bits(values[j]);
      return half.data();
    };
    write_safetensors_checked(dir + "/" + file, tensors, {{"format", "pt"}}, default_write_chunk, default_crc_chunk,
                              bytes_of);
    out.files.push_back(file);
    out.bytes += std::int64_t(fs::file_size(dir + "/" + file));
  }
  if (shards.size() > 1) {
    std::int64_t total = 0;
    for (const Shard& shard : shards) total += shard.bytes;
    const nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    write_file_atomic(dir + "/model.safetensors.index.json", index.dump(2) + "\n");
  }
  write_hf_config(c, dir);
  return out;
}

void write_hf_config(const config::ModelConfig& config, const std::string& dir) {
  write_file_atomic(dir + "/config.json", model::arch_spec(config.arch).hf_config(config).dump(2) + "\n");
}

std::size_t import_hf_ranges(const std::string& path, const model::Model& logical,
                             const std::vector<FlatRange>& ranges, float* out) {
  const model::ArchSpec& spec = model::arch_spec(logical.config().arch);
  const HfTensors source(path);
  check_hf_config(path, logical.config(), spec);
  const std::string where = source.describe();
  // Names with or without the prefix published files may leave out (GPT2LMHeadModel's "transformer.").
  const std::string prefix = spec.hf_optional_prefix;
  const auto hf_name = [&](const std::string& name) {
    auto found = source.find(name);
    if (!found.second && !prefix.empty() && name.starts_with(prefix)) found = source.find(name.substr(prefix.size()));
    return found;
  };
  // The wanted ranges by place in the flat buffer, each with where it goes in `out`.
  struct Wanted {
    FlatRange range;
    std::int64_t at = 0;
  };
  std::vector<Wanted> wanted;
  std::int64_t at = 0;
  for (const FlatRange& r : ranges) {
    if (r.size() > 0) wanted.push_back({r, at});
    at += r.size();
  }
  std::sort(wanted.begin(), wanted.end(), [](const Wanted& a, const Wanted& b) { return a.range.begin < b.range.begin; });
  std::set<std::string> used;
  std::vector<float> column;  // a transposed tensor's piece of one stored row
  for (const auto& info : logical.param_infos()) {
    // The first form whose first tensor the files hold.
    const auto forms = hf_forms(spec, logical.config(), info);
    const std::vector<HfPiece>* form = &forms.front();
    for (const auto& f : forms) {
      if (hf_name(f.front().name).second) {
        form = &f;
        break;
      }
    }
    for (const HfPiece& piece : *form) {
      const auto [reader, t] = hf_name(piece.name);
      if (!t) throw InputError(where + ": tensor " + piece.name + " is missing");
      used.insert(t->name);
      if (t->shape != piece.shape) {
        std::ostringstream got, want;
        for (const auto d : t->shape) got << d << ' ';
        for (const auto d : piece.shape) want << d << ' ';
        throw InputError(reader->path() + ": tensor " + t->name + " has shape [" + got.str() +
                         "], the config needs [" + want.str() + "]");
      }
      const std::int64_t begin = piece.logical, end = begin + piece.count;
      auto w =
          std::partition_point(wanted.begin(), wanted.end(), [&](const Wanted& x) { return x.range.end <= begin; });
      // Only the wanted elements are read: a slice of the stored tensor, or (stored transposed, as
      // GPT-2's Conv1D weights) a piece of each stored row per logical row block.
      for (; w != wanted.end() && w->range.begin < end; ++w) {
        const std::int64_t lo = std::max(begin, w->range.begin), hi = std::min(end, w->range.end);
        float* dst = out + w->at + (lo - w->range.begin);  // receives logical element lo - begin
        if (!piece.transposed) {
          reader->read_f32_range(*t, piece.stored + lo - begin, {dst, std::size_t(hi - lo)});
          continue;
        }
        const std::int64_t rows = piece.shape[1], cols = piece.shape[0];  // logical (rows, cols); stored (cols, rows)
        const std::int64_t a = lo - begin, b = hi - begin;
        // Logical rows [i0, i1) and columns [j0, j1): stored row j holds logical column j.
        const auto block = [&](std::int64_t i0, std::int64_t i1, std::int64_t j0, std::int64_t j1) {
          column.resize(std::size_t(i1 - i0));
          for (std::int64_t j = j0; j < j1; ++j) {
            reader->read_f32_range(*t, j * rows + i0, column);
            for (std::int64_t i = i0; i < i1; ++i) dst[i * cols + j - a] = column[std::size_t(i - i0)];
          }
        };
        for (std::int64_t k = a; k < b;) {
          const std::int64_t i = k / cols, j = k % cols;
          if (j == 0 && b - k >= cols) {  // whole logical rows
            const std::int64_t i1 = i + (b - k) / cols;
            block(i, i1, 0, cols);
            k = i1 * cols;
          } else {  // part of one row
            const std::int64_t j1 = std::min(cols, j + (b - k));
            block(i, i + 1, j, j1);
            k += j1 - j;
          }
        }
      }
    }
  }
  for (const auto& reader : source.readers()) {
    for (const auto& t : reader->tensors()) {
      // A tied output head, the causal-mask buffers of older GPT-2 exports and the rotary
      // frequency buffers of older Llama exports carry no parameters.
      const bool ignorable = (t.name == "lm_head.weight" && logical.config().tie_embeddings) ||
                             t.name.ends_with(".attn.bias") || t.name.ends_with(".attn.masked_bias") ||
                             t.name.ends_with(".rotary_emb.inv_freq");
      if (used.contains(t.name) || ignorable) continue;
      const bool head_norm = t.name.ends_with("self_attn.q_norm.weight") || t.name.ends_with("self_attn.k_norm.weight");
      throw InputError(reader->path() + ": unexpected tensor " + t.name +
                       (head_norm && !logical.config().qk_norm ? " (per-head query/key norms: set model.qk_norm true)" : ""));
    }
  }
  std::size_t bytes = 0;
  for (const auto& reader : source.readers()) bytes += reader->bytes_read();
  return bytes;
}

void import_hf(const std::string& path, model::Model& model) {
  float* params = model.params().as<float>();
  for (const model::Segment& s : model.segments(false)) {
    import_hf_ranges(path, model, {s.logical_range()}, params + s.local);
  }
}

}  // namespace llmtrain::checkpoint
