// Native checkpoints, loaded: the ranges of the training state a rank needs, from whichever files
// hold them, each chunk read checked against its CRC-32. Finding a checkpoint and validating its
// state.json is checkpoint/find.cpp.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "checkpoint/safetensors.h"
#include "core/crc32.h"
#include "core/error.h"
#include "core/json_file.h"
#include "model/arch.h"

namespace llmtrain::checkpoint {
namespace {

// The largest read(2) a check makes: a chunk is read (and checksummed) in pieces of this size.
constexpr std::size_t read_piece = std::size_t(8) << 20;

// Bytes [offset, offset + bytes) of a file, to be copied to `to`.
struct Copy {
  std::int64_t offset = 0, bytes = 0;
  std::byte* to = nullptr;
};

// A file of a checkpoint, read with its CRC-32s: its chunks (state.json's chunk_bytes and
// chunk_crc32), or, for a file listed with one CRC-32 alone (an earlier version's), the whole file
// as one chunk. Every chunk read is read whole and checked before the read returns.
class CheckedFile {
 public:
  CheckedFile(std::string path, const nlohmann::json& listed) : path_(std::move(path)) {
    size_ = listed.at("bytes").get<std::int64_t>();
    if (listed.contains("chunk_crc32") && listed.value("chunk_bytes", std::int64_t(0)) > 0) {
      chunk_ = listed.at("chunk_bytes").get<std::int64_t>();
      for (const auto& c : listed.at("chunk_crc32")) crcs_.push_back(c.get<std::uint32_t>());
      const std::int64_t expected = (size_ + chunk_ - 1) / chunk_;
      if (std::int64_t(crcs_.size()) != expected) {
        throw DamagedCheckpoint(path_ + ": state.json lists " + std::to_string(crcs_.size()) + " chunk checksums for " +
                                std::to_string(expected) + " chunks of " + std::to_string(chunk_) + " bytes");
      }
    } else {
      chunk_ = std::max<std::int64_t>(size_, 1);
      crcs_.push_back(listed.at("crc32").get<std::uint32_t>());
    }
  }

  const std::string& path() const { return path_; }

  // Checks the chunks that hold the safetensors header (the 8-byte length and the JSON after it),
  // so that a damaged header is reported as a checksum mismatch, not as whatever it now says.
  void check_header() const {
    std::uint64_t length = 0;
    if (size_ < 8) return;  // the reader says what is wrong
    read({{0, 8, reinterpret_cast<std::byte*>(&length)}});
    if (length > std::uint64_t(size_ - 8)) return;
    std::vector<std::byte> header(static_cast<std::size_t>(length));
    read({{8, std::int64_t(length), header.data()}});
  }

  // Carries out `copies` (sorted by offset, disjoint), reading each chunk they touch once.
  void read(const std::vector<Copy>& copies) const {
    if (copies.empty()) return;
    std::vector<std::int64_t> chunks;
    for (const Copy& c : copies) {
      if (c.offset < 0 || c.offset + c.bytes > size_) {
        throw DamagedCheckpoint(path_ + ": bytes " + std::to_string(c.offset) + " to " + std::to_string(c.offset + c.bytes) +
                                " lie outside the file's " + std::to_string(size_));
      }
      for (std::int64_t k = c.offset / chunk_; k * chunk_ < c.offset + c.bytes; ++k) {
        if (chunks.empty() || chunks.back() != k) chunks.push_back(k);
      }
    }
    std::sort(chunks.begin(), chunks.end());
    chunks.erase(std::unique(chunks.begin(), chunks.end()), chunks.end());
    const int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw DamagedCheckpoint(path_ + ": cannot open: " + std::strerror(errno));
    try {
      std::vector<std::byte> buffer(std::size_t(std::min<std::int64_t>(chunk_, std::int64_t(read_piece))));
      std::size_t next = 0;  // the first copy that may still need bytes
      for (const std::int64_t k : chunks) {
        const std::int64_t begin = k * chunk_, end = std::min(size_, begin + chunk_);
        std::uint32_t crc = 0;
        for (std::int64_t at = begin; at < end;) {
          const std::int64_t n = std::min<std::int64_t>(end - at, std::int64_t(buffer.size()));
          read_fully(fd, buffer.data(), at, n);
          crc = crc32(buffer.data(), std::size_t(n), crc);
          while (next < copies.size() && copies[next].offset + copies[next].bytes <= at) ++next;
          for (std::size_t i = next; i < copies.size() && copies[i].offset < at + n; ++i) {
            const std::int64_t lo = std::max(at, copies[i].offset), hi = std::min(at + n, copies[i].offset + copies[i].bytes);
            if (lo < hi) std::memcpy(copies[i].to + (lo - copies[i].offset), buffer.data() + (lo - at), std::size_t(hi - lo));
          }
          at += n;
        }
        if (crc != crcs_[std::size_t(k)]) {
          const std::string where = crcs_.size() == 1 ? std::string()
                                                      : " in bytes " + std::to_string(begin) + " to " + std::to_string(end);
          throw DamagedCheckpoint(path_ + ": checksum mismatch" + where + " (the file is damaged)");
        }
      }
    } catch (...) {
      ::close(fd);
      throw;
    }
    ::close(fd);
  }

 private:
  void read_fully(int fd, std::byte* to, std::int64_t at, std::int64_t n) const {
    while (n > 0) {
      const ssize_t got = ::pread(fd, to, std::size_t(n), off_t(at));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) {
        throw DamagedCheckpoint(path_ + ": cannot read bytes " + std::to_string(at) + " on: " +
                                (got == 0 ? std::string("the file ends") : std::string(std::strerror(errno))));
      }
      to += got;
      at += got;
      n -= got;
    }
  }

  std::string path_;
  std::int64_t size_ = 0;
  std::int64_t chunk_ = 1;
  std::vector<std::uint32_t> crcs_;
};

// A run of the whole model's flat buffer that one file holds: its elements of each tensor of the
// kind (weights; or the optimizer's state tensors, in the order asked for) start at these byte
// offsets of the file.
struct Held {
  FlatRange logical;
  std::size_t file = 0;
  std::vector<std::int64_t> byte;
};

std::optional<std::int64_t> parse_int(const std::string& text) {
  std::int64_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end != text.data() + text.size() || text.empty()) return std::nullopt;
  return value;
}

// The ranges a file holds: its "ranges" tensor ((n, 2) int64, read through `file`'s checks), or,
// in optimizer files of earlier versions, its metadata ("ranges": "b0:e0,b1:e1,..." or
// range_begin and range_end).
std::vector<FlatRange> file_ranges(const SafetensorsReader& reader, const CheckedFile& file) {
  std::vector<FlatRange> ranges;
  if (const TensorInfo* t = reader.find("ranges")) {
    if (t->dtype != StDtype::i64 || t->shape.size() != 2 || t->shape[1] != 2) {
      throw DamagedCheckpoint(reader.path() + ": tensor ranges must be I64 of shape [n, 2]");
    }
    std::vector<std::int64_t> table(std::size_t(2 * t->shape[0]));
    file.read({{std::int64_t(reader.data_start() + t->begin), std::int64_t(t->num_bytes()),
                reinterpret_cast<std::byte*>(table.data())}});
    for (std::size_t i = 0; i < table.size(); i += 2) ranges.push_back({table[i], table[i + 1]});
  } else {
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
      throw DamagedCheckpoint(reader.path() + ": no tensor ranges, and no range_begin/range_end or ranges in its metadata");
    }
    for (const auto& [b, e] : texts) {
      const auto begin = parse_int(b), end = parse_int(e);
      if (!begin || !end) {
        throw DamagedCheckpoint(reader.path() + ": metadata range: expected integers, got " + json_excerpt(b) + " and " +
                                json_excerpt(e));
      }
      ranges.push_back({*begin, *end});
    }
  }
  for (const FlatRange& r : ranges) {
    if (r.begin < 0 || r.end < r.begin) {
      throw DamagedCheckpoint(reader.path() + ": range " + std::to_string(r.begin) + ":" + std::to_string(r.end) +
                              ": expected 0 <= begin <= end");
    }
  }
  return ranges;
}

// A checkpoint file's reader; a file that is not what its header says is a damaged checkpoint.
SafetensorsReader open_reader(const std::string& path) {
  try {
    return SafetensorsReader(path);
  } catch (const DamagedCheckpoint&) {
    throw;
  } catch (const InputError& e) {
    throw DamagedCheckpoint(e.what());
  }
}

// The index of the first value of x[0, n) that is not finite, or -1. In blocks whose test the
// compiler vectorises (the exponent's bits all set: an infinity or a NaN); only a block that fails
// is walked again for the position.
std::int64_t first_non_finite(const float* x, std::int64_t n) {
  constexpr std::int64_t block = 4096;
  const auto non_finite = [](float v) {
    std::uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    return (bits & 0x7f800000u) == 0x7f800000u;
  };
  for (std::int64_t b = 0; b < n; b += block) {
    const std::int64_t e = std::min(n, b + block);
    bool any = false;
    for (std::int64_t i = b; i < e; ++i) any |= non_finite(x[i]);
    if (!any) continue;
    for (std::int64_t i = b; i < e; ++i) {
      if (non_finite(x[i])) return i;
    }
  }
  return -1;
}

}  // namespace

// What the files of a checkpoint hold of one kind of state, sorted by place in the flat buffer.
// A file state.json lists with its spans (runs of the flat buffer that cover its ranges, save's
// index_spans) is opened, and its header and ranges read, only once a read asks for ranges in
// one of them: a rank reads the few files that hold its ranges, not every rank's. A file listed
// without them (an earlier version's) is read at once.
class StateIndex {
 public:
  StateIndex(const Found& found, StateKind kind, const std::vector<std::string>& names)
      : found_(found), kind_(kind), names_(kind == StateKind::weights ? std::vector<std::string>{"weights"} : names) {
    const nlohmann::json& files = found.state.at("files");
    std::size_t listed_files = 0;
    for (const auto& [name, listed] : files.items()) {
      const bool weights = name == "model.safetensors" || name.starts_with("model-");
      if ((kind == StateKind::weights) != weights || (!weights && !name.starts_with("optim-"))) continue;
      ++listed_files;
      if (listed.contains("spans")) {
        unopened_.push_back({name, listed_spans(found.dir, name, listed.at("spans"))});
      } else {
        open(name);
      }
    }
    if (listed_files == 0) {
      throw DamagedCheckpoint(found.dir + ": no " + std::string(kind == StateKind::weights ? "weights" : "optimizer") +
                              " files listed in state.json");
    }
    dir_ = found.dir;
  }

  // Opens the files not yet open whose spans meet one of `ranges`.
  void open_for(const std::vector<FlatRange>& ranges) {
    if (unopened_.empty()) return;
    std::vector<FlatRange> wanted;
    for (const FlatRange& r : ranges) {
      if (r.size() > 0) wanted.push_back(r);
    }
    std::sort(wanted.begin(), wanted.end(), [](const FlatRange& a, const FlatRange& b) { return a.begin < b.begin; });
    std::vector<std::int64_t> end_so_far(wanted.size());  // the largest end of wanted[0..i]
    for (std::size_t i = 0; i < wanted.size(); ++i) end_so_far[i] = std::max(wanted[i].end, i ? end_so_far[i - 1] : 0);
    std::vector<Unopened> still;
    // Whether a wanted range meets `span`: of those that begin before it ends, one ends after it
    // begins.
    const auto wanted_in = [&](const FlatRange& span) {
      const auto before =
          std::partition_point(wanted.begin(), wanted.end(), [&](const FlatRange& r) { return r.begin < span.end; });
      const std::size_t n = std::size_t(before - wanted.begin());
      return span.size() > 0 && n > 0 && end_so_far[n - 1] > span.begin;
    };
    for (Unopened& file : unopened_) {
      if (std::any_of(file.spans.begin(), file.spans.end(), wanted_in)) {
        open(file.name);
      } else {
        still.push_back(std::move(file));
      }
    }
    unopened_ = std::move(still);
  }

  std::size_t files_opened() const { return files_.size(); }

  int tensors() const { return int(names_.size()); }

  // The copies that fill `out` with `ranges` end to end, per file; the elements covered.
  std::int64_t plan(const std::vector<FlatRange>& ranges, const std::vector<float*>& out,
                    std::vector<std::vector<Copy>>& copies) const {
    copies.assign(files_.size(), {});
    std::int64_t covered = 0, at = 0;
    for (const FlatRange& want : ranges) {
      // The first held run that ends after `want` begins (runs are disjoint: their ends sorted too).
      auto h = std::partition_point(held_.begin(), held_.end(), [&](const Held& x) { return x.logical.end <= want.begin; });
      for (; h != held_.end() && h->logical.begin < want.end; ++h) {
        const std::int64_t lo = std::max(want.begin, h->logical.begin), hi = std::min(want.end, h->logical.end);
        if (lo >= hi) continue;
        for (int t = 0; t < tensors(); ++t) {
          copies[h->file].push_back({h->byte[std::size_t(t)] + (lo - h->logical.begin) * std::int64_t(sizeof(float)),
                                     (hi - lo) * std::int64_t(sizeof(float)),
                                     reinterpret_cast<std::byte*>(out[std::size_t(t)] + at + (lo - want.begin))});
        }
        covered += hi - lo;
      }
      at += want.size();
    }
    for (auto& list : copies) {
      std::sort(list.begin(), list.end(), [](const Copy& a, const Copy& b) { return a.offset < b.offset; });
    }
    return covered;
  }

  const CheckedFile& file(std::size_t i) const { return files_[i]; }
  const std::string& dir() const { return dir_; }
  const std::string& tensor_name(int t) const { return names_[std::size_t(t)]; }

  // The parameter that holds element `logical` of the whole model's flat buffer, and the
  // element's index in it: "model.layers.0.mlp.gate.e_score_correction_bias[3]".
  std::string element_name(std::int64_t logical) const {
    const auto whole = model::make_model(found_.config.model, Device::cpu, model::Recompute::none, DType::f32,
                                         ops::AttentionKernels::flash, model::Layout{true});
    for (const model::ParamInfo& info : whole->param_infos()) {
      if (logical >= info.logical_offset && logical < info.logical_offset + info.numel) {
        return info.name + "[" + std::to_string(logical - info.logical_offset) + "]";
      }
    }
    return "element " + std::to_string(logical) + " of the flat buffer";
  }

 private:
  struct Unopened {
    std::string name;
    std::vector<FlatRange> spans;
  };

  // A file's spans as state.json lists them: [[begin, end], ...], each 0 <= begin <= end.
  static std::vector<FlatRange> listed_spans(const std::string& dir, const std::string& name, const nlohmann::json& list) {
    const auto bad = [&] {
      return DamagedCheckpoint(dir + "/state.json: files." + name +
                               ".spans: expected a list of [begin, end] with 0 <= begin <= end, got " + json_excerpt(list));
    };
    if (!list.is_array()) throw bad();
    std::vector<FlatRange> spans;
    for (const nlohmann::json& span : list) {
      if (!span.is_array() || span.size() != 2 || !span[0].is_number_integer() || !span[1].is_number_integer()) {
        throw bad();
      }
      const FlatRange r{span[0].get<std::int64_t>(), span[1].get<std::int64_t>()};
      if (r.begin < 0 || r.end < r.begin) throw bad();
      spans.push_back(r);
    }
    return spans;
  }

  // Reads file `name`'s header and ranges into the index; checks that no two files hold the same
  // elements.
  void open(const std::string& name) {
    const std::string path = found_.dir + "/" + name;
    files_.emplace_back(path, found_.state.at("files").at(name));
    files_.back().check_header();
    const SafetensorsReader reader = open_reader(path);
    if (name == "model.safetensors") {
      add_named(found_, reader);
    } else {
      add_ranges(reader, files_.back());
    }
    std::sort(held_.begin(), held_.end(), [](const Held& a, const Held& b) { return a.logical.begin < b.logical.begin; });
    for (std::size_t i = 1; i < held_.size(); ++i) {
      if (held_[i].logical.begin < held_[i - 1].logical.end) {
        throw DamagedCheckpoint(found_.dir + ": " + files_[held_[i - 1].file].path() + " and " + files_[held_[i].file].path() +
                                " both hold elements from " + std::to_string(held_[i].logical.begin) + " of the flat buffer");
      }
    }
  }

  // A file of named tensors (model.safetensors): each parameter of the whole model in one piece.
  void add_named(const Found& found, const SafetensorsReader& reader) {
    const auto logical = model::make_model(found.config.model, Device::cpu, model::Recompute::none, DType::f32,
                                           ops::AttentionKernels::flash, model::Layout{true});
    for (const model::ParamInfo& info : logical->param_infos()) {
      const TensorInfo* t = reader.find(info.name);
      if (!t) throw DamagedCheckpoint(reader.path() + ": no tensor " + info.name);
      if (t->dtype != StDtype::f32 || t->shape != info.shape) {
        throw DamagedCheckpoint(reader.path() + ": tensor " + info.name + " must be F32 of the model's shape");
      }
      held_.push_back({{info.logical_offset, info.logical_offset + info.numel}, files_.size() - 1,
                       {std::int64_t(reader.data_start() + t->begin)}});
    }
  }

  // A file of ranges: its tensors (weights; or the optimizer's, by the names asked for, such as
  // adamw.m and adamw.v) hold them end to end.
  void add_ranges(const SafetensorsReader& reader, const CheckedFile& file) {
    const std::vector<FlatRange> ranges = file_ranges(reader, file);
    std::int64_t total = 0;
    for (const FlatRange& r : ranges) total += r.size();
    std::vector<std::int64_t> start;
    for (const std::string& name : names_) {
      const TensorInfo* t = reader.find(name);
      if (!t) throw DamagedCheckpoint(reader.path() + ": no tensor " + name);
      if (t->dtype != StDtype::f32 || t->shape.size() != 1 || t->shape[0] != total) {
        throw DamagedCheckpoint(reader.path() + ": tensor " + name + " must be F32 of shape [" + std::to_string(total) +
                                "] (the elements of its ranges)");
      }
      start.push_back(std::int64_t(reader.data_start() + t->begin));
    }
    std::int64_t at = 0;
    for (const FlatRange& r : ranges) {
      if (r.size() > 0) {
        Held held{r, files_.size() - 1, start};
        for (std::int64_t& byte : held.byte) byte += at * std::int64_t(sizeof(float));
        held_.push_back(std::move(held));
      }
      at += r.size();
    }
  }

  Found found_;  // (a copy: a reader may outlive the Found it was made from)
  StateKind kind_;
  std::vector<std::string> names_;  // the tensors read from each file of ranges
  std::vector<Unopened> unopened_;  // listed with spans that no read has asked for yet
  std::vector<CheckedFile> files_;
  std::vector<Held> held_;
  std::string dir_;
};

StateReader::StateReader(const Found& found, StateKind kind, const std::vector<std::string>& names)
    : index_(std::make_unique<StateIndex>(found, kind, names)), dir_(found.dir), kind_(kind) {}

StateReader::~StateReader() = default;

std::size_t StateReader::files_opened() const { return index_->files_opened(); }

void load_state(const Found& found, StateKind kind, const std::vector<FlatRange>& ranges,
                const std::vector<float*>& out, const std::vector<std::string>& names) {
  StateReader(found, kind, names).read(ranges, out);
}

void StateReader::read(const std::vector<FlatRange>& ranges, const std::vector<float*>& out) const {
  StateIndex& index = *index_;
  index.open_for(ranges);
  const StateKind kind = kind_;
  if (int(out.size()) != index.tensors()) throw RuntimeError("load_state: wrong number of output arrays");
  std::int64_t wanted = 0;
  for (const FlatRange& r : ranges) wanted += r.size();
  std::vector<std::vector<Copy>> copies;
  const std::int64_t covered = index.plan(ranges, out, copies);
  if (covered != wanted) {
    throw DamagedCheckpoint(dir_ + ": the " + std::string(kind == StateKind::weights ? "weight" : "optimizer") +
                            " files cover " + std::to_string(covered) + " of the " + std::to_string(wanted) +
                            " elements of the flat-buffer range(s) this rank needs");
  }
  for (std::size_t f = 0; f < copies.size(); ++f) index.file(f).read(copies[f]);
  // A value that is not finite steers every step after it without a word: a NaN expert bias
  // routes every token to one expert, a NaN moment turns its weight to NaN at the first update.
  // (Training never writes one: the NaN guard skips any update whose loss or norm is not finite.)
  for (int t = 0; t < index.tensors(); ++t) {
    std::int64_t at = 0;
    for (const FlatRange& r : ranges) {
      const std::int64_t i = first_non_finite(out[std::size_t(t)] + at, r.size());
      if (i >= 0) {
        const float v = out[std::size_t(t)][at + i];
        const std::string what =
            kind == StateKind::weights ? "the weight " : "the optimizer's " + index.tensor_name(t) + " of ";
        throw DamagedCheckpoint(dir_ + ": " + what + index.element_name(r.begin + i) + " is " +
                                (std::isnan(v) ? "NaN" : v > 0 ? "+inf" : "-inf") +
                                "; a checkpoint's weights and optimizer state must be finite");
      }
      at += r.size();
    }
  }
}

void verify_files(const Found& found) {
  for (const auto& [file, info] : found.state.at("files").items()) {
    const std::string path = found.dir + "/" + file;
    if (file_crc32(path) != info.at("crc32").get<std::uint64_t>()) {
      throw DamagedCheckpoint(path + ": checksum mismatch (the file is damaged)");
    }
  }
}

void load_weights(const Found& found, model::Model& model) {
  // A whole model's segments are one run; a part's (a pipeline stage's, say) read in turn, the
  // files indexed once.
  const StateReader reader(found, StateKind::weights);
  float* params = model.params().as<float>();
  for (const model::Segment& s : model.segments(false)) reader.read({s.logical_range()}, {params + s.local});
}

void check_weights_fit(const Found& found) {
  const double params = double(model::arch_spec(found.config.model.arch).parameter_count(found.config.model));
  double bytes = 0;
  for (const auto& [file, info] : found.state.at("files").items()) {
    if (file.starts_with("model")) bytes += double(info.at("bytes").get<std::int64_t>());
  }
  if (4.0 * params > bytes) {
    throw InputError(found.dir + ": the weight files' " + std::to_string(std::int64_t(bytes)) +
                     " bytes cannot hold the " + std::to_string(std::int64_t(params)) +
                     " fp32 parameters of the model in state.json's config");
  }
}

std::unique_ptr<model::Model> load_model(const Found& found) {
  // The config must describe a model whose weights the files can hold, before they are allocated.
  check_weights_fit(found);
  auto model = model::make_model(found.config.model, Device::cpu);
  load_weights(found, *model);
  return model;
}

}  // namespace llmtrain::checkpoint
