// CRC-32: published check values, continuation, and zlib's and our own table-driven code
// against a bit-at-a-time reference over every tail length and alignment.
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "catch_compat.h"
#include "core/crc32.h"

using namespace llmtrain;

namespace {

// The definition, one bit at a time: reflected polynomial 0xEDB88320, all-ones start and finish.
std::uint32_t bitwise_crc32(const unsigned char* p, std::size_t n) {
  std::uint32_t c = 0xFFFFFFFFu;
  for (std::size_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int bit = 0; bit < 8; ++bit) c = (c & 1u) ? (c >> 1) ^ 0xEDB88320u : c >> 1;
  }
  return ~c;
}

}  // namespace

TEST_CASE("crc32 gives the published check values", "[core]") {
  for (const auto f : {+[](std::string_view s) { return crc32(s); },
                       +[](std::string_view s) { return crc32_builtin(s.data(), s.size()); }}) {
    CHECK(f("") == 0u);
    CHECK(f("a") == 0xE8B7BE43u);
    CHECK(f("abc") == 0x352441C2u);
    CHECK(f("123456789") == 0xCBF43926u);  // the CRC-32 catalogue's check value
    CHECK(f("The quick brown fox jumps over the lazy dog") == 0x414FA339u);
    CHECK(f(std::string(32, '\0')) == 0x190A55ADu);
    CHECK(f(std::string(32, '\xFF')) == 0xFF6CAB0Bu);
  }
}

TEST_CASE("crc32 continues across pieces and matches the bitwise definition at every offset", "[core]") {
  std::mt19937 rng(7);
  std::vector<unsigned char> buffer(1100);
  for (auto& b : buffer) b = static_cast<unsigned char>(rng());
  for (std::size_t offset = 0; offset < 8; ++offset) {
    for (std::size_t n = 0; n < 40; ++n) {
      const std::uint32_t want = bitwise_crc32(buffer.data() + offset, n);
      REQUIRE(crc32(buffer.data() + offset, n) == want);
      REQUIRE(crc32_builtin(buffer.data() + offset, n) == want);
    }
  }
  const std::uint32_t whole = bitwise_crc32(buffer.data(), buffer.size());
  CHECK(crc32(buffer.data(), buffer.size()) == whole);
  CHECK(crc32_builtin(buffer.data(), buffer.size()) == whole);
  for (const std::size_t split : {std::size_t(0), std::size_t(1), std::size_t(13), std::size_t(512), buffer.size()}) {
    CHECK(crc32(buffer.data() + split, buffer.size() - split, crc32(buffer.data(), split)) == whole);
    CHECK(crc32_builtin(buffer.data() + split, buffer.size() - split, crc32_builtin(buffer.data(), split)) == whole);
  }
}

TEST_CASE("crc32_combine gives the CRC of two pieces joined, from theirs and the second's length", "[core]") {
  std::mt19937 rng(11);
  std::vector<unsigned char> buffer(5000);
  for (auto& b : buffer) b = static_cast<unsigned char>(rng());
  const std::uint32_t whole = bitwise_crc32(buffer.data(), buffer.size());
  for (const std::size_t split : {std::size_t(0), std::size_t(1), std::size_t(7), std::size_t(1024), std::size_t(4999),
                                  buffer.size()}) {
    const std::uint32_t a = bitwise_crc32(buffer.data(), split);
    const std::uint32_t b = bitwise_crc32(buffer.data() + split, buffer.size() - split);
    CHECK(crc32_combine(a, b, buffer.size() - split) == whole);
  }
  CHECK(crc32_combine(crc32("1234"), crc32("56789"), 5) == 0xCBF43926u);  // the published check value
}
