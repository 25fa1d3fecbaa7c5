// Safetensors files (Hugging Face's format), read memory-mapped and written atomically.
//
// Layout: an 8-byte little-endian uint64 N, then N bytes of JSON header, then the data buffer.
// The header maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]}, offsets
// relative to the start of the data buffer, plus an optional "__metadata__" of string -> string.
// Every field is validated on open, so a reader that opened holds only tensors whose bytes lie
// inside the file, do not overlap and match their shape.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace llmtrain::checkpoint {

/// The element types llmtrain reads and writes ("F32", "BF16", ... in the file).
enum class StDtype : std::uint8_t { f32, bf16, f16, i32, i64, u16, u8 };

/// The dtype's name in a safetensors header: "F32", "BF16", "F16", "I32", "I64", "U16", "U8".
const char* st_dtype_name(StDtype t);
/// The dtype a header name stands for; nullopt for names llmtrain does not support.
std::optional<StDtype> parse_st_dtype(std::string_view name);
/// Bytes per element.
std::size_t st_dtype_size(StDtype t);

/// bfloat16 bits to float32: they are its upper 16 bits.
float bf16_to_f32(std::uint16_t bits);
/// IEEE binary16 bits to float32, exact (subnormals, infinities, NaN payloads included).
float f16_to_f32(std::uint16_t bits);

/// One tensor of a file as its header describes it; [begin, end) is relative to the data buffer.
struct TensorInfo {
  std::string name;
  StDtype dtype = StDtype::f32;
  std::vector<std::int64_t> shape;  // [] is a scalar (one element)
  std::size_t begin = 0;
  std::size_t end = 0;

  /// Product of the dims (1 for a scalar, 0 when any dim is 0).
  std::int64_t numel() const;
  std::size_t num_bytes() const { return end - begin; }
};

/// A read-only, memory-mapped safetensors file. The constructor validates the whole header and
/// throws InputError "PATH: ..." naming the tensor or byte offset of the first problem.
class SafetensorsReader {
 public:
  explicit SafetensorsReader(const std::string& path);
  ~SafetensorsReader();
  SafetensorsReader(SafetensorsReader&& other) noexcept;
  SafetensorsReader& operator=(SafetensorsReader&&) = delete;
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;

  /// Every tensor, in the order of their data_offsets (the order of their bytes in the file).
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  /// The tensor called `name`, or nullptr if the file has none.
  const TensorInfo* find(std::string_view name) const;
  /// The tensor's bytes, in place in the mapping (valid while this reader lives).
  std::span<const std::byte> data(const TensorInfo& info) const;
  /// Copies a tensor into `out` as float32 (from F32, BF16 or F16), checking the element count;
  /// InputError naming the tensor when it is absent, of another dtype or of another size.
  void read_f32(std::string_view name, std::span<float> out) const;
  /// Copies elements [first, first + out.size()) of tensor `info` (row-major) into `out` as
  /// float32, touching only their bytes; InputError as read_f32 for a dtype that is not a float.
  void read_f32_range(const TensorInfo& info, std::int64_t first, std::span<float> out) const;
  /// Bytes of tensor data read_f32 and read_f32_range have copied out of the file so far.
  std::size_t bytes_read() const { return bytes_read_; }
  /// The header's "__metadata__" (empty when it has none).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::string& path() const { return path_; }
  /// Byte offset of the data buffer in the file (8 + header length).
  std::size_t data_start() const { return data_start_; }

 private:
  std::string path_;
  const std::byte* map_ = nullptr;
  std::size_t map_bytes_ = 0;
  std::size_t data_start_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::size_t, std::less<>> index_;  // name -> position in tensors_
  std::map<std::string, std::string> metadata_;
  mutable std::size_t bytes_read_ = 0;
};

/// A tensor to write: `data` points at numel(shape) * st_dtype_size(dtype) bytes, host memory.
struct TensorToWrite {
  std::string name;
  StDtype dtype = StDtype::f32;
  std::vector<std::int64_t> shape;
  const void* data = nullptr;
  /// Instead of `data`: pieces of memory (address, bytes) that, end to end, hold the tensor; a
  /// piece at address null is that many zero bytes.
  std::vector<std::pair<const void*, std::size_t>> pieces = {};
};

/// The size of the write(2) calls write_safetensors streams a file in, unless told otherwise.
inline constexpr std::size_t default_write_chunk = std::size_t(32) << 20;

/// Writes atomically: PATH.tmp (its blocks reserved first, so a full disk fails before any byte
/// is written), fsync, rename; header padded with spaces to a multiple of 8; tensors stored in the
/// given order. Files of 4 MiB and more go to the disk directly (O_DIRECT, through aligned bounce
/// buffers, bypassing the page cache) where the file system allows it; smaller ones, and all on
/// file systems that refuse O_DIRECT, straight from their memory in sequential writes of
/// `chunk_bytes`, each chunk's write-back to the disk started as soon as it is written. Returns the CRC-32 (as zlib's crc32)
/// of the whole file, computed chunk by chunk as it is written. RuntimeError naming the path on
/// any I/O failure (disk full, permission) or bad argument (a negative dim, a repeated name), and
/// the temp file is removed.
std::uint32_t write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                                const std::map<std::string, std::string>& metadata = {},
                                std::size_t chunk_bytes = default_write_chunk);

/// A written file's CRC-32 (as zlib's crc32), and that of each `chunk_bytes` of it in order (the
/// last chunk may be short): a reader of part of the file checks the chunks it reads.
struct FileChecksums {
  std::uint32_t crc32 = 0;
  std::size_t chunk_bytes = 0;
  std::vector<std::uint32_t> chunks;
};

/// The chunk size of checkpoint files' checksums.
inline constexpr std::size_t default_crc_chunk = std::size_t(8) << 20;

/// Tensor i's bytes when the file comes to it (a tensor whose `data` is null): valid until the
/// next call, so that a file can be written one tensor at a time from elsewhere.
using TensorBytes = std::function<const void*(std::size_t i)>;

/// write_safetensors, returning the CRC-32 of every `crc_chunk_bytes` of the file as well; the
/// tensors without data are asked of `bytes_of`.
FileChecksums write_safetensors_checked(const std::string& path, const std::vector<TensorToWrite>& tensors,
                                        const std::map<std::string, std::string>& metadata = {},
                                        std::size_t chunk_bytes = default_write_chunk,
                                        std::size_t crc_chunk_bytes = default_crc_chunk,
                                        const TensorBytes& bytes_of = {});

/// CRC-32 of a whole file (as zlib's), read through a memory mapping; RuntimeError if unreadable.
std::uint32_t file_crc32(const std::string& path);

}  // namespace llmtrain::checkpoint
