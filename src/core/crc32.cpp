// CRC-32 through zlib where the build found it, else our own: eight bytes per step through eight
// 256-entry tables ("slicing by 8"), so that a build needs no zlib. 256 MiB on one x86-64 core:
// ours 2.9 GB/s, Debian 12's zlib 1.2.13 6.5 GB/s (1.5 GB of GPT-2 124M checkpoint: 0.5 s vs 0.2 s).
#include "core/crc32.h"

#include <algorithm>
#include <array>

#if LLMTRAIN_HAVE_ZLIB
#include <zlib.h>
#endif

namespace llmtrain {
namespace {

constexpr std::uint32_t polynomial = 0xEDB88320u;  // bit-reversed 0x04C11DB7

// table[0][b]: the CRC step of byte b alone; table[k][b]: of byte b followed by k zero bytes.
constexpr std::array<std::array<std::uint32_t, 256>, 8> make_tables() {
  std::array<std::array<std::uint32_t, 256>, 8> table{};
  for (std::uint32_t b = 0; b < 256; ++b) {
    std::uint32_t c = b;
    for (int bit = 0; bit < 8; ++bit) c = (c >> 1) ^ (polynomial & (0u - (c & 1u)));
    table[0][b] = c;
  }
  for (std::size_t k = 1; k < 8; ++k) {
    for (std::size_t b = 0; b < 256; ++b) table[k][b] = (table[k - 1][b] >> 8) ^ table[0][table[k - 1][b] & 0xFFu];
  }
  return table;
}

constexpr auto tables = make_tables();

}  // namespace

std::uint32_t crc32_builtin(const void* bytes, std::size_t n, std::uint32_t previous) {
  const auto* p = static_cast<const unsigned char*>(bytes);
  std::uint32_t c = ~previous;
  for (; n >= 8; n -= 8, p += 8) {
    // The first four bytes as a little-endian word, assembled byte by byte: any host order.
    const std::uint32_t lo = c ^ (std::uint32_t(p[0]) | std::uint32_t(p[1]) << 8 | std::uint32_t(p[2]) << 16 |
                                  std::uint32_t(p[3]) << 24);
    c = tables[7][lo & 0xFFu] ^ tables[6][(lo >> 8) & 0xFFu] ^ tables[5][(lo >> 16) & 0xFFu] ^ tables[4][lo >> 24] ^
        tables[3][p[4]] ^ tables[2][p[5]] ^ tables[1][p[6]] ^ tables[0][p[7]];
  }
  for (; n > 0; --n, ++p) c = (c >> 8) ^ tables[0][(c ^ *p) & 0xFFu];
  return ~c;
}

std::uint32_t crc32(const void* bytes, std::size_t n, std::uint32_t previous) {
#if LLMTRAIN_HAVE_ZLIB
  const auto* p = static_cast<const Bytef*>(bytes);
  uLong c = previous;
  while (n > 0) {
    const std::size_t chunk = std::min<std::size_t>(n, std::size_t(1) << 30);  // zlib counts in uInt
    c = ::crc32(c, p, static_cast<uInt>(chunk));
    p += chunk;
    n -= chunk;
  }
  return static_cast<std::uint32_t>(c);
#else
  return crc32_builtin(bytes, n, previous);
#endif
}

namespace {

// CRC-32 is linear over GF(2): appending n zero bytes to a message multiplies its (unconditioned)
// CRC register by a fixed 32x32 bit matrix. `mat` holds the images of the 32 unit vectors.
std::uint32_t gf2_times(const std::uint32_t* mat, std::uint32_t vec) {
  std::uint32_t sum = 0;
  for (; vec != 0; vec >>= 1, ++mat) {
    if (vec & 1u) sum ^= *mat;
  }
  return sum;
}

void gf2_square(std::uint32_t* square, const std::uint32_t* mat) {
  for (int n = 0; n < 32; ++n) square[n] = gf2_times(mat, mat[n]);
}

}  // namespace

std::uint32_t crc32_combine(std::uint32_t crc_a, std::uint32_t crc_b, std::uint64_t length_b) {
  if (length_b == 0) return crc_a;
  // The pre- and post-conditioning (~) of both CRCs cancel: crc(a b) = Z^len(b) crc(a) ^ crc(b),
  // Z the operator of one zero byte. Z^len(b) by repeated squaring: start from one zero bit.
  std::uint32_t even[32], odd[32];
  odd[0] = polynomial;
  for (int n = 1; n < 32; ++n) odd[n] = std::uint32_t(1) << (n - 1);
  gf2_square(even, odd);  // two zero bits
  gf2_square(odd, even);  // four
  std::uint32_t c = crc_a;
  do {
    gf2_square(even, odd);  // 8, 32, 128, ... zero bits: 1, 4, 16, ... bytes
    if (length_b & 1u) c = gf2_times(even, c);
    length_b >>= 1;
    if (length_b == 0) break;
    gf2_square(odd, even);
    if (length_b & 1u) c = gf2_times(odd, c);
    length_b >>= 1;
  } while (length_b != 0);
  return c ^ crc_b;
}

}  // namespace llmtrain
