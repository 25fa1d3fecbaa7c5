#include "checkpoint/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>

#include "checkpoint/disk_writer.h"
#include "core/crc32.h"
#include "core/error.h"
#include "core/files.h"
#include "core/json_file.h"
#include "ops/buffer.h"

static_assert(std::endian::native == std::endian::little,
              "tensor bytes are read and written in place: little-endian only");

namespace llmtrain::checkpoint {
namespace {

constexpr std::size_t length_bytes = 8;                 // the uint64 header length
constexpr std::size_t io_chunk = std::size_t(1) << 30;  // below Linux's 2 GiB per write

struct DtypeEntry {
  StDtype dtype;
  const char* name;
  std::size_t size;
};
constexpr DtypeEntry dtype_table[] = {
    {StDtype::f32, "F32", 4}, {StDtype::bf16, "BF16", 2}, {StDtype::f16, "F16", 2}, {StDtype::i32, "I32", 4},
    {StDtype::i64, "I64", 8}, {StDtype::u16, "U16", 2},   {StDtype::u8, "U8", 1},
};

const DtypeEntry& entry_of(StDtype t) {
  for (const auto& e : dtype_table) {
    if (e.dtype == t) return e;
  }
  throw RuntimeError("safetensors: dtype enum value " + std::to_string(int(t)) + " out of range");
}

std::string errno_text() {
  return std::strerror(errno);
}

// numel(shape) * element_size, or nullopt when a dim is negative or the product overflows.
std::optional<std::uint64_t> checked_bytes(const std::vector<std::int64_t>& shape, std::size_t element_size) {
  if (std::any_of(shape.begin(), shape.end(), [](std::int64_t d) { return d < 0; })) return std::nullopt;
  if (std::find(shape.begin(), shape.end(), 0) != shape.end()) return 0;  // empty, whatever the other dims
  std::uint64_t product = element_size;
  bool overflow = false;
  for (const std::int64_t d : shape)
    overflow = overflow || __builtin_mul_overflow(product, std::uint64_t(d), &product);
  if (overflow || product > std::uint64_t(std::numeric_limits<std::int64_t>::max())) return std::nullopt;
  return product;
}

std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s.append(i ? ", " : "").append(std::to_string(shape[i]));
  return s + "]";
}

std::string offsets_text(std::size_t begin, std::size_t end) {
  return "[" + std::to_string(begin) + ", " + std::to_string(end) + "]";
}

// One tensor entry of the header, validated; `data_bytes` is the size of the data buffer.
TensorInfo parse_tensor_entry(const std::string& path, const std::string& name, const nlohmann::json& entry,
                              std::size_t data_start, std::size_t data_bytes) {
  const auto bad = [&](const std::string& what) -> InputError {
    return InputError(path + ": tensor '" + name + "': " + what);
  };
  if (!entry.is_object())
    throw bad("expected an object with dtype, shape and data_offsets, got " + json_excerpt(entry));
  for (const char* key : {"dtype", "shape", "data_offsets"}) {
    if (!entry.contains(key)) throw bad(std::string("missing \"") + key + "\"");
  }
  TensorInfo info;
  info.name = name;

  const auto& dtype = entry["dtype"];
  if (!dtype.is_string()) throw bad("\"dtype\" must be a string, got " + json_excerpt(dtype));
  const auto parsed = parse_st_dtype(dtype.get_ref<const std::string&>());
  if (!parsed)
    throw bad("unsupported dtype " + json_excerpt(dtype) + " (expected F32, BF16, F16, I32, I64, U16 or U8)");
  info.dtype = *parsed;

  const auto& shape = entry["shape"];
  if (!shape.is_array()) throw bad("\"shape\" must be an array of integers, got " + json_excerpt(shape));
  for (const auto& d : shape) {
    if (!d.is_number_integer()) throw bad("\"shape\" must be an array of integers, got " + json_excerpt(shape));
    if (!d.is_number_unsigned())
      throw bad("negative dim " + std::to_string(d.get<std::int64_t>()) + " in shape " + json_excerpt(shape));
    if (d.get<std::uint64_t>() > std::uint64_t(std::numeric_limits<std::int64_t>::max())) {
      throw bad("dim too large in shape " + json_excerpt(shape));
    }
    info.shape.push_back(d.get<std::int64_t>());
  }

  const auto& offsets = entry["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
      !offsets[1].is_number_unsigned()) {
    throw bad("\"data_offsets\" must be [begin, end], two non-negative integers, got " + json_excerpt(offsets));
  }
  const std::uint64_t begin = offsets[0].get<std::uint64_t>(), end = offsets[1].get<std::uint64_t>();
  if (end < begin) throw bad("data_offsets " + offsets_text(begin, end) + " end before they begin");
  if (end > data_bytes) {
    throw bad("data_offsets " + offsets_text(begin, end) +
              " run past the end of the file: the tensor would end at byte " +
              (end > std::numeric_limits<std::uint64_t>::max() - data_start
                   ? std::string("(overflow)")
                   : std::to_string(data_start + end)) +
              ", the file has " + std::to_string(data_start + data_bytes) + " bytes");
  }
  info.begin = begin;
  info.end = end;

  const auto expected = checked_bytes(info.shape, st_dtype_size(info.dtype));
  if (!expected) throw bad("shape " + shape_text(info.shape) + " has too many elements");
  if (*expected != end - begin) {
    throw bad("data_offsets " + offsets_text(begin, end) + " hold " + std::to_string(end - begin) +
              " bytes, but " + st_dtype_name(info.dtype) + " " + shape_text(info.shape) + " needs " +
              std::to_string(*expected) + " (at file byte " + std::to_string(data_start + begin) + ")");
  }
  return info;
}

}  // namespace

const char* st_dtype_name(StDtype t) {
  return entry_of(t).name;
}

std::size_t st_dtype_size(StDtype t) {
  return entry_of(t).size;
}

std::optional<StDtype> parse_st_dtype(std::string_view name) {
  for (const auto& e : dtype_table) {
    if (name == e.name) return e.dtype;
  }
  return std::nullopt;
}

float bf16_to_f32(std::uint16_t bits) {
  return std::bit_cast<float>(std::uint32_t(bits) << 16);
}

float f16_to_f32(std::uint16_t bits) {
  const std::uint32_t sign = std::uint32_t(bits & 0x8000u) << 16;
  std::uint32_t exponent = (bits >> 10) & 0x1Fu;
  std::uint32_t mantissa = bits & 0x3FFu;
  std::uint32_t out;
  if (exponent == 0x1F) {  // inf or NaN: keep the payload
    out = sign | 0x7F800000u | (mantissa << 13);
  } else if (exponent != 0) {  // normal: rebias 15 -> 127
    out = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {  // +-0
    out = sign;
  } else {
    // Subnormal, mantissa * 2^-24, which is a normal float: shift the leading 1 into the implicit
    // bit (bit 10), starting from 2^-14's biased float exponent (113) and lowering it per shift.
    exponent = 113;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --exponent;
    }
    out = sign | (exponent << 23) | ((mantissa & 0x3FFu) << 13);
  }
  return std::bit_cast<float>(out);
}

std::int64_t TensorInfo::numel() const {
  std::int64_t n = 1;
  for (const std::int64_t d : shape) n *= d;
  return n;
}

SafetensorsReader::SafetensorsReader(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);  // a FIFO must not block
  if (fd < 0) throw InputError(path + ": cannot open safetensors file: " + errno_text());
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const std::string why = errno_text();
    ::close(fd);
    throw InputError(path + ": cannot stat safetensors file: " + why);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw InputError(path + ": not a regular file");
  }
  map_bytes_ = static_cast<std::size_t>(st.st_size);
  if (map_bytes_ < length_bytes) {
    ::close(fd);
    throw InputError(path + ": byte " + std::to_string(map_bytes_) +
                     ": file ends inside the 8-byte header length (" + std::to_string(map_bytes_) +
                     " bytes; not a safetensors file)");
  }
  void* map = ::mmap(nullptr, map_bytes_, PROT_READ, MAP_SHARED, fd, 0);
  const std::string map_error = errno_text();
  ::close(fd);
  if (map == MAP_FAILED) throw InputError(path + ": cannot map safetensors file: " + map_error);
  map_ = static_cast<const std::byte*>(map);

  try {
    std::uint64_t header_bytes = 0;
    for (std::size_t i = 0; i < length_bytes; ++i) header_bytes |= std::uint64_t(map_[i]) << (8 * i);
    if (header_bytes > map_bytes_ - length_bytes) {
      throw InputError(path + ": byte 0: header length " + std::to_string(header_bytes) +
                       " runs past the end of the file (" + std::to_string(map_bytes_) + " bytes)");
    }
    data_start_ = length_bytes + header_bytes;
    const auto* text = reinterpret_cast<const char*>(map_) + length_bytes;

    // The JSON object keeps the last of repeated keys; the callback sees every top-level key first.
    std::set<std::string> seen;
    std::string repeated;
    const nlohmann::json::parser_callback_t note_keys = [&](int depth, nlohmann::json::parse_event_t event,
                                                            nlohmann::json& parsed) {
      check_json_depth(depth, event, path + ": header");
      if (depth == 1 && event == nlohmann::json::parse_event_t::key && parsed.is_string() &&
          !seen.insert(parsed.get<std::string>()).second && repeated.empty()) {
        repeated = parsed.get<std::string>();
      }
      return true;
    };
    nlohmann::json header;
    try {
      header = nlohmann::json::parse(text, text + header_bytes, note_keys);
    } catch (const nlohmann::json::parse_error& e) {
      std::string detail = e.what();
      if (const auto bracket = detail.find("] "); bracket != std::string::npos) detail.erase(0, bracket + 2);
      throw InputError(path + ": byte " + std::to_string(length_bytes + (e.byte > 0 ? e.byte - 1 : 0)) +
                       ": header is not valid JSON (" + detail + ")");
    }
    if (!header.is_object()) {
      throw InputError(path + ": byte " + std::to_string(length_bytes) +
                       ": header must be a JSON object, got " + std::string(header.type_name()));
    }
    if (!repeated.empty()) throw InputError(path + ": header names '" + repeated + "' more than once");

    const std::size_t data_bytes = map_bytes_ - data_start_;
    for (const auto& [name, entry] : header.items()) {
      if (name == "__metadata__") {
        if (!entry.is_object()) throw InputError(path + ": \"__metadata__\" must be an object of strings");
        for (const auto& [key, value] : entry.items()) {
          if (!value.is_string()) {
            throw InputError(path + ": \"__metadata__\" value of '" + key + "' must be a string, got " +
                             json_excerpt(value));
          }
          metadata_.emplace(key, value.get<std::string>());
        }
        continue;
      }
      tensors_.push_back(parse_tensor_entry(path, name, entry, data_start_, data_bytes));
    }

    // In file order; tensors with bytes must not share any (empty ones share none).
    std::stable_sort(tensors_.begin(), tensors_.end(), [](const TensorInfo& a, const TensorInfo& b) {
      return std::pair(a.begin, a.end) < std::pair(b.begin, b.end);
    });
    const TensorInfo* last = nullptr;  // the non-empty tensor that ends furthest so far
    for (const auto& t : tensors_) {
      if (t.num_bytes() == 0) continue;
      if (last && t.begin < last->end) {
        throw InputError(path + ": tensor '" + t.name + "': data_offsets " + offsets_text(t.begin, t.end) +
                         " overlap tensor '" + last->name + "' " + offsets_text(last->begin, last->end) +
                         " (at file byte " + std::to_string(data_start_ + t.begin) + ")");
      }
      last = &t;
    }
    for (std::size_t i = 0; i < tensors_.size(); ++i) index_.emplace(tensors_[i].name, i);
  } catch (...) {
    ::munmap(const_cast<std::byte*>(map_), map_bytes_);
    throw;
  }
}

SafetensorsReader::~SafetensorsReader() {
  if (map_) ::munmap(const_cast<std::byte*>(map_), map_bytes_);
}

SafetensorsReader::SafetensorsReader(SafetensorsReader&& other) noexcept
    : path_(std::move(other.path_)),
      map_(std::exchange(other.map_, nullptr)),
      map_bytes_(other.map_bytes_),
      data_start_(other.data_start_),
      tensors_(std::move(other.tensors_)),
      index_(std::move(other.index_)),
      metadata_(std::move(other.metadata_)) {}

const TensorInfo* SafetensorsReader::find(std::string_view name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

std::span<const std::byte> SafetensorsReader::data(const TensorInfo& info) const {
  if (info.begin > info.end || info.end > map_bytes_ - data_start_) {
    throw RuntimeError(path_ + ": tensor '" + info.name + "': data_offsets " +
                       offsets_text(info.begin, info.end) + " are not this file's");
  }
  return {map_ + data_start_ + info.begin, info.num_bytes()};
}

void SafetensorsReader::read_f32(std::string_view name, std::span<float> out) const {
  const TensorInfo* info = find(name);
  if (!info) throw InputError(path_ + ": no tensor '" + std::string(name) + "'");
  const std::size_t n = static_cast<std::size_t>(info->numel());
  if (n != out.size()) {
    throw InputError(path_ + ": tensor '" + info->name + "' has " + std::to_string(n) + " elements (shape " +
                     shape_text(info->shape) + "), expected " + std::to_string(out.size()));
  }
  read_f32_range(*info, 0, out);
  // The mapped pages leave this process once copied (the page cache keeps them): loading a model
  // then holds its weights once, not twice (GPT-2 124M: about 0.5 GB less at peak).
  if (info->dtype == StDtype::f32) ops::release_pages(data(*info).data(), n * sizeof(float));
}

void SafetensorsReader::read_f32_range(const TensorInfo& info, std::int64_t first, std::span<float> out) const {
  const auto n = static_cast<std::int64_t>(out.size());
  if (first < 0 || first + n > info.numel()) {
    throw RuntimeError(path_ + ": tensor '" + info.name + "': elements [" + std::to_string(first) + ", " +
                       std::to_string(first + n) + ") are outside its " + std::to_string(info.numel()));
  }
  const std::byte* src = data(info).data();
  switch (info.dtype) {
    case StDtype::f32:
      if (n > 0) std::memcpy(out.data(), src + std::size_t(first) * sizeof(float), std::size_t(n) * sizeof(float));
      break;
    case StDtype::bf16:
    case StDtype::f16: {
      const bool is_bf16 = info.dtype == StDtype::bf16;
      const std::byte* at = src + std::size_t(first) * 2;
      for (std::int64_t i = 0; i < n; ++i) {
        std::uint16_t bits;
        std::memcpy(&bits, at + 2 * i, 2);
        out[std::size_t(i)] = is_bf16 ? bf16_to_f32(bits) : f16_to_f32(bits);
      }
      break;
    }
    default:
      throw InputError(path_ + ": tensor '" + info.name + "' is " + st_dtype_name(info.dtype) +
                       ", expected a float type (F32, BF16 or F16)");
  }
  bytes_read_ += std::size_t(n) * st_dtype_size(info.dtype);
}

std::uint32_t write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                                const std::map<std::string, std::string>& metadata, std::size_t chunk_bytes) {
  return write_safetensors_checked(path, tensors, metadata, chunk_bytes).crc32;
}

FileChecksums write_safetensors_checked(const std::string& path, const std::vector<TensorToWrite>& tensors,
                                        const std::map<std::string, std::string>& metadata, std::size_t chunk_bytes,
                                        std::size_t crc_chunk_bytes, const TensorBytes& bytes_of) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<std::size_t> sizes;  // bytes of each tensor, in order
  sizes.reserve(tensors.size());
  std::set<std::string_view> names;
  std::size_t offset = 0;
  for (const auto& t : tensors) {
    const auto bad = [&](const std::string& what) {
      return RuntimeError(path + ": cannot write tensor '" + t.name + "': " + what);
    };
    if (t.name == "__metadata__") throw bad("the name is reserved for the metadata");
    if (!names.insert(t.name).second) throw bad("a tensor of that name comes twice");
    const auto bytes = checked_bytes(t.shape, st_dtype_size(t.dtype));
    if (!bytes) throw bad("shape " + shape_text(t.shape) + " has a negative dim or too many elements");
    if (*bytes > 0 && t.data == nullptr && t.pieces.empty() && !bytes_of) throw bad("data is null");
    if (!t.pieces.empty()) {
      std::size_t total = 0;
      for (const auto& [address, n] : t.pieces) total += n;
      if (total != *bytes) throw bad("its pieces hold " + std::to_string(total) + " bytes, its shape " + std::to_string(*bytes));
    }
    nlohmann::ordered_json entry;
    entry["dtype"] = st_dtype_name(t.dtype);
    entry["shape"] = t.shape;
    entry["data_offsets"] = {offset, offset + *bytes};
    header[t.name] = std::move(entry);
    sizes.push_back(*bytes);
    offset += *bytes;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::exception& e) {  // a name or metadata string that is not UTF-8
    throw RuntimeError(path + ": cannot write the header: " + e.what());
  }
  // Padded so that the data buffer starts 8-byte aligned (8 + N is a multiple of 8).
  text.append((length_bytes - text.size() % length_bytes) % length_bytes, ' ');
  unsigned char length[length_bytes];
  for (std::size_t i = 0; i < length_bytes; ++i) {
    length[i] = static_cast<unsigned char>(std::uint64_t(text.size()) >> (8 * i));
  }

  DiskWriter file(path, std::clamp<std::size_t>(chunk_bytes, 1, io_chunk), crc_chunk_bytes);
  file.reserve(length_bytes + text.size() + offset);
  file.write(length, length_bytes);
  file.write(text.data(), text.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (sizes[i] == 0) continue;
    if (!tensors[i].pieces.empty()) {
      for (const auto& [address, n] : tensors[i].pieces) {
        if (address) {
          file.write(address, n);
          continue;
        }
        static const std::vector<unsigned char> zeros(std::size_t(1) << 16, 0);
        for (std::size_t done = 0; done < n; done += zeros.size()) file.write(zeros.data(), std::min(zeros.size(), n - done));
      }
    } else {
      file.write(tensors[i].data ? tensors[i].data : bytes_of(i), sizes[i]);
    }
  }
  file.commit();
  return {file.crc(), crc_chunk_bytes, file.chunk_crcs()};
}

std::uint32_t file_crc32(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) throw RuntimeError(path + ": cannot open for its CRC-32: " + errno_text());
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw InputError(path + ": not a regular file");
  }
  const std::size_t size = std::size_t(st.st_size);
  if (size == 0) {
    ::close(fd);
    return 0;
  }
  // Read through a mapping, which the kernel reads ahead of the CRC (and whose pages a resume then
  // finds in the page cache when it maps the file again to load it).
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  const std::string map_error = errno_text();
  ::close(fd);
  if (map == MAP_FAILED) throw RuntimeError(path + ": cannot map for its CRC-32: " + map_error);
  ::madvise(map, size, MADV_SEQUENTIAL);
  const std::uint32_t crc = crc32(map, size);
  ::munmap(map, size);
  return crc;
}

}  // namespace llmtrain::checkpoint
