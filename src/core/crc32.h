// CRC-32 as zlib, PNG and Python's zlib.crc32 compute it (reflected polynomial 0xEDB88320).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace llmtrain {

/// CRC-32 of `n` bytes, continuing from `previous` (the CRC of the bytes before them; 0 to start),
/// so that crc32(b, n_b, crc32(a, n_a)) is the CRC of a then b. crc32("123456789") == 0xCBF43926.
/// zlib's where the build has zlib (faster), else crc32_builtin.
std::uint32_t crc32(const void* bytes, std::size_t n, std::uint32_t previous = 0);

/// CRC-32 of a string's bytes, continuing from `previous`.
inline std::uint32_t crc32(std::string_view bytes, std::uint32_t previous = 0) {
  return crc32(bytes.data(), bytes.size(), previous);
}

/// The CRC-32 of a then b from crc_a = crc32(a), crc_b = crc32(b) and b's length alone (as zlib's
/// crc32_combine), so that pieces checksummed apart give the whole's CRC without a second pass.
std::uint32_t crc32_combine(std::uint32_t crc_a, std::uint32_t crc_b, std::uint64_t length_b);

/// The same CRC-32 computed by our own table-driven code (what crc32 uses in a build without zlib).
std::uint32_t crc32_builtin(const void* bytes, std::size_t n, std::uint32_t previous = 0);

}  // namespace llmtrain
