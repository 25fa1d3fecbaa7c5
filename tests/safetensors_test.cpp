// Safetensors files: round trips, the exact bytes of a tiny file, half-precision conversions,
// and every malformed file rejected naming the file and the tensor or byte offset.
#include "checkpoint/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>

#include "catch_compat.h"
#include "checkpoint/disk_writer.h"
#include "core/crc32.h"
#include "core/error.h"
#include "process.h"

using namespace llmtrain;
using namespace llmtrain::checkpoint;

namespace {

template <class E>
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "(no error of the expected type)";
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

// Whether the file system of `dir` takes O_DIRECT writes, found without the writer: an aligned
// block written through a descriptor opened with O_DIRECT.
bool takes_direct_writes(const std::string& dir) {
  const std::string probe = dir + "/direct-probe";
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_DIRECT | O_CLOEXEC, 0644);
  if (fd < 0) return false;
  void* block = std::aligned_alloc(4096, 4096);
  std::memset(block, 0, 4096);
  const bool ok = ::pwrite(fd, block, 4096, 0) == 4096;
  std::free(block);
  ::close(fd);
  std::filesystem::remove(probe);
  return ok;
}

// `n` pseudo-random bytes.
std::string noise(std::size_t n, std::uint32_t seed) {
  std::string bytes(n, '\0');
  for (auto& c : bytes) {
    seed = seed * 1664525u + 1013904223u;
    c = static_cast<char>(seed >> 24);
  }
  return bytes;
}

// 8-byte little-endian `length`, then `rest`.
std::string with_length(std::uint64_t length, const std::string& rest) {
  std::string bytes;
  for (int i = 0; i < 8; ++i) bytes.push_back(static_cast<char>(length >> (8 * i)));
  return bytes + rest;
}

// A file whose header is `header` verbatim, followed by `data_bytes` zero bytes.
std::string raw_file(const test::TempDir& dir, const std::string& name, const std::string& header,
                     std::size_t data_bytes) {
  return dir.write(name, with_length(header.size(), header + std::string(data_bytes, '\0')));
}

// Our own table-driven CRC-32: where the build has zlib, the files' CRCs come from zlib's.
std::uint32_t builtin_crc(const std::string& bytes) { return crc32_builtin(bytes.data(), bytes.size()); }

template <class T>
std::vector<T> values_of(const SafetensorsReader& r, const TensorInfo& info) {
  const auto bytes = r.data(info);
  REQUIRE(bytes.size() % sizeof(T) == 0);
  std::vector<T> out(bytes.size() / sizeof(T));
  if (!out.empty()) std::memcpy(out.data(), bytes.data(), bytes.size());
  return out;
}

}  // namespace

TEST_CASE("safetensors round-trip every dtype, a scalar and an empty tensor, in the given order",
          "[checkpoint]") {
  test::TempDir dir;
  const std::string path = dir.path() + "/model.safetensors";
  const std::vector<float> weight = {1, 2, 3, -4, 0.5f, 1e-30f};  // (2, 3)
  const std::vector<std::uint16_t> bias = {0x3F80, 0xC020, 0x0000, 0x7F80};
  const std::vector<std::uint16_t> half = {0x3C00, 0xC100, 0x7BFF, 0x0001};
  const std::vector<std::int32_t> ids = {-1, 0, 2147483647};
  const std::vector<std::int64_t> steps = {-5, std::int64_t(1) << 40};
  const std::vector<std::uint16_t> tokens = {0, 65535};
  const std::vector<std::uint8_t> bytes = {1, 2, 3, 250, 255};
  const float scalar = 3.5f;
  // Names deliberately not in alphabetical order: the file keeps the order they are given in.
  const std::vector<TensorToWrite> tensors = {
      {"z.weight", StDtype::f32, {2, 3}, weight.data()}, {"a.bias", StDtype::bf16, {4}, bias.data()},
      {"half", StDtype::f16, {2, 2}, half.data()},       {"ids", StDtype::i32, {3}, ids.data()},
      {"steps", StDtype::i64, {2}, steps.data()},        {"tokens", StDtype::u16, {1, 2}, tokens.data()},
      {"bytes", StDtype::u8, {5}, bytes.data()},         {"scalar", StDtype::f32, {}, &scalar},
      {"empty", StDtype::f32, {0, 4}, nullptr},
  };
  const std::uint32_t crc = write_safetensors(path, tensors);
  CHECK(std::distance(std::filesystem::directory_iterator(std::filesystem::path(path).parent_path()),
                      std::filesystem::directory_iterator()) == 1);  // no temporary file left
  const std::string file = read_bytes(path);
  CHECK(crc == builtin_crc(file));
  CHECK(crc == file_crc32(path));
  CHECK(file.size() % 8 != 0);  // 8 + padded header + 81 data bytes: only the header is padded

  SafetensorsReader r(path);  // not const: moved from at the end
  CHECK(r.path() == path);
  CHECK(r.metadata().empty());
  CHECK(r.data_start() % 8 == 0);
  CHECK(file.size() == r.data_start() + 81);
  // Offsets by hand: 24 + 8 + 8 + 12 + 16 + 4 + 5 + 4 + 0 bytes.
  struct Expected {
    const char* name;
    StDtype dtype;
    std::vector<std::int64_t> shape;
    std::size_t begin, end;
  };
  const std::vector<Expected> expected = {
      {"z.weight", StDtype::f32, {2, 3}, 0, 24}, {"a.bias", StDtype::bf16, {4}, 24, 32},
      {"half", StDtype::f16, {2, 2}, 32, 40},    {"ids", StDtype::i32, {3}, 40, 52},
      {"steps", StDtype::i64, {2}, 52, 68},      {"tokens", StDtype::u16, {1, 2}, 68, 72},
      {"bytes", StDtype::u8, {5}, 72, 77},       {"scalar", StDtype::f32, {}, 77, 81},
      {"empty", StDtype::f32, {0, 4}, 81, 81},
  };
  REQUIRE(r.tensors().size() == expected.size());
  for (std::size_t i = 0; i < expected.size(); ++i) {
    const TensorInfo& t = r.tensors()[i];
    INFO("tensor " << i << " " << t.name);
    CHECK(t.name == expected[i].name);
    CHECK(t.dtype == expected[i].dtype);
    CHECK(t.shape == expected[i].shape);
    CHECK(t.begin == expected[i].begin);
    CHECK(t.end == expected[i].end);
    CHECK(r.find(expected[i].name) == &t);
  }
  CHECK(r.find("missing") == nullptr);
  CHECK(r.find("__metadata__") == nullptr);
  CHECK(r.find("scalar")->numel() == 1);
  CHECK(r.find("empty")->numel() == 0);

  CHECK(values_of<float>(r, *r.find("z.weight")) == weight);
  CHECK(values_of<std::uint16_t>(r, *r.find("a.bias")) == bias);
  CHECK(values_of<std::uint16_t>(r, *r.find("half")) == half);
  CHECK(values_of<std::int32_t>(r, *r.find("ids")) == ids);
  CHECK(values_of<std::int64_t>(r, *r.find("steps")) == steps);
  CHECK(values_of<std::uint16_t>(r, *r.find("tokens")) == tokens);
  CHECK(values_of<std::uint8_t>(r, *r.find("bytes")) == bytes);
  CHECK(r.data(*r.find("empty")).empty());

  float got_scalar = 0;
  r.read_f32("scalar", std::span<float>(&got_scalar, 1));
  CHECK(got_scalar == 3.5f);
  std::vector<float> got(6);
  r.read_f32("z.weight", got);
  CHECK(got == weight);
  CHECK_NOTHROW(r.read_f32("empty", std::span<float>()));

  // The reader moves without unmapping.
  SafetensorsReader moved(std::move(r));
  CHECK(values_of<std::int64_t>(moved, *moved.find("steps")) == steps);
}

TEST_CASE("safetensors metadata round-trips, and is absent from the header when empty", "[checkpoint]") {
  test::TempDir dir;
  const std::string path = dir.path() + "/meta.safetensors";
  const std::map<std::string, std::string> metadata = {
      {"format", "pt"}, {"step", "1200"}, {"note", "\xc3\xbcnicode \"quoted\" {}"}, {"", "empty key"}};
  const float x = 7;
  write_safetensors(path, {{"x", StDtype::f32, {1}, &x}}, metadata);
  const SafetensorsReader r(path);
  CHECK(r.metadata() == metadata);
  REQUIRE(r.tensors().size() == 1);
  CHECK(r.tensors()[0].name == "x");

  write_safetensors(path, {{"x", StDtype::f32, {1}, &x}});  // overwrites in place
  const std::string file = read_bytes(path);
  const auto header = nlohmann::json::parse(file.substr(8, SafetensorsReader(path).data_start() - 8));
  CHECK_FALSE(header.contains("__metadata__"));
  CHECK(SafetensorsReader(path).metadata().empty());
}

TEST_CASE("a tiny safetensors file, byte by byte", "[checkpoint]") {
  test::TempDir dir;
  const std::string path = dir.path() + "/tiny.safetensors";
  const float values[2] = {1.0f, -2.0f};
  const std::uint32_t crc = write_safetensors(path, {{"a", StDtype::f32, {2}, values}});
  const std::string file = read_bytes(path);
  // {"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}} is 54 bytes, padded to 56.
  REQUIRE(file.size() == 8 + 56 + 8);
  CHECK(file.size() % 8 == 0);
  const unsigned char length[8] = {56, 0, 0, 0, 0, 0, 0, 0};
  CHECK(std::memcmp(file.data(), length, 8) == 0);
  const std::string header = file.substr(8, 56);
  CHECK(nlohmann::json::parse(header) == nlohmann::json::parse(R"({"a": {"dtype": "F32", "shape": [2],
                                                                        "data_offsets": [0, 8]}})"));
  CHECK(header.substr(54) == "  ");  // padded with spaces
  // 1.0f is 0x3F800000, -2.0f is 0xC0000000, little-endian.
  const unsigned char data[8] = {0x00, 0x00, 0x80, 0x3F, 0x00, 0x00, 0x00, 0xC0};
  CHECK(std::memcmp(file.data() + 64, data, 8) == 0);
  // zlib.crc32 of these 72 bytes, computed in Python from the bytes above.
  CHECK(crc == 0x07BADCF3u);
  CHECK(file_crc32(path) == 0x07BADCF3u);
}

TEST_CASE("bf16 and f16 convert to float32 exactly", "[checkpoint]") {
  CHECK(bf16_to_f32(0x3F80) == 1.0f);
  CHECK(bf16_to_f32(0xC020) == -2.5f);
  CHECK(bf16_to_f32(0x4780) == 65536.0f);
  CHECK(bf16_to_f32(0x3EAB) == 0.333984375f);            // 1.3359375 * 2^-2
  CHECK(bf16_to_f32(0x0001) == std::ldexp(1.0f, -133));  // a float subnormal
  CHECK(bf16_to_f32(0x7F80) == std::numeric_limits<float>::infinity());
  CHECK(bf16_to_f32(0xFF80) == -std::numeric_limits<float>::infinity());
  CHECK(std::isnan(bf16_to_f32(0x7FC0)));

  CHECK(f16_to_f32(0x3C00) == 1.0f);
  CHECK(f16_to_f32(0xC100) == -2.5f);
  CHECK(f16_to_f32(0x7BFF) == 65504.0f);                      // the largest half
  CHECK(f16_to_f32(0x3555) == 0.333251953125f);               // (1 + 341/1024) * 2^-2
  CHECK(f16_to_f32(0x0400) == std::ldexp(1.0f, -14));         // the smallest normal half
  CHECK(f16_to_f32(0x0001) == std::ldexp(1.0f, -24));         // the smallest subnormal
  CHECK(f16_to_f32(0x03FF) == 1023 * std::ldexp(1.0f, -24));  // the largest subnormal
  CHECK(f16_to_f32(0x8201) == -513 * std::ldexp(1.0f, -24));
  CHECK(f16_to_f32(0x0000) == 0.0f);
  CHECK(std::signbit(f16_to_f32(0x8000)));
  CHECK(f16_to_f32(0x8000) == 0.0f);
  CHECK(f16_to_f32(0x7C00) == std::numeric_limits<float>::infinity());
  CHECK(f16_to_f32(0xFC00) == -std::numeric_limits<float>::infinity());
  CHECK(std::isnan(f16_to_f32(0x7E00)));
  CHECK(std::isnan(f16_to_f32(0x7C01)));  // a signalling NaN stays a NaN, not inf

  // The same through a file, and read_f32's refusals.
  test::TempDir dir;
  const std::string path = dir.path() + "/half.safetensors";
  const std::uint16_t bf16[3] = {0x3F80, 0xC020, 0x0001};
  const std::uint16_t f16[4] = {0x3C00, 0xC100, 0x7BFF, 0x0001};
  const std::int32_t ints[2] = {1, 2};
  write_safetensors(
      path,
      {{"b", StDtype::bf16, {3}, bf16}, {"h", StDtype::f16, {2, 2}, f16}, {"i", StDtype::i32, {2}, ints}});
  const SafetensorsReader r(path);
  std::vector<float> out(3);
  r.read_f32("b", out);
  CHECK(out == std::vector<float>{1.0f, -2.5f, std::ldexp(1.0f, -133)});
  out.resize(4);
  r.read_f32("h", out);
  CHECK(out == std::vector<float>{1.0f, -2.5f, 65504.0f, std::ldexp(1.0f, -24)});
  CHECK(error_of<InputError>([&] { r.read_f32("h", std::span<float>(out.data(), 3)); }) ==
        path + ": tensor 'h' has 4 elements (shape [2, 2]), expected 3");
  CHECK(error_of<InputError>([&] { r.read_f32("i", std::span<float>(out.data(), 2)); }) ==
        path + ": tensor 'i' is I32, expected a float type (F32, BF16 or F16)");
  CHECK(error_of<InputError>([&] { r.read_f32("nope", out); }) == path + ": no tensor 'nope'");
}

TEST_CASE("malformed safetensors files are input errors naming the file and the tensor or byte",
          "[checkpoint]") {
  test::TempDir dir;
  const std::string p = dir.path();
  const auto opens = [](const std::string& path) {
    return error_of<InputError>([&] { SafetensorsReader{path}; });
  };

  CHECK(opens(p + "/missing.safetensors").find(p + "/missing.safetensors: cannot open") == 0);
  const auto short_file = dir.write("short", "abc");
  CHECK(opens(short_file) ==
        short_file + ": byte 3: file ends inside the 8-byte header length (3 bytes; not a safetensors file)");
  const auto long_header = dir.write("long_header", with_length(1000, "{}"));
  CHECK(opens(long_header) ==
        long_header + ": byte 0: header length 1000 runs past the end of the file (10 bytes)");
  const auto huge_header = dir.write("huge_header", with_length(~std::uint64_t(0), "{}"));
  CHECK(opens(huge_header).find(huge_header + ": byte 0: header length 18446744073709551615 runs past") == 0);
  CHECK(opens(raw_file(dir, "empty_header", "", 0)).find("header is not valid JSON") != std::string::npos);

  const std::string a_ok = R"("a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]})";
  struct Case {
    const char* name;
    std::string header;
    std::size_t data_bytes;
    std::string expected;  // the message after "PATH: "
  };
  const std::vector<Case> cases = {
      {"not_json", R"({"a": )", 0, "byte "},  // the offset of the parse error, then what it was
      {"not_json_detail", R"({"a": [1, 2})", 0, "header is not valid JSON"},
      {"not_object", "[1, 2]", 0, "byte 8: header must be a JSON object, got array"},
      {"entry_not_object", R"({"a": 3})", 0,
       "tensor 'a': expected an object with dtype, shape and data_offsets, got 3"},
      {"no_dtype", R"({"a": {"shape": [2], "data_offsets": [0, 8]}})", 8, "tensor 'a': missing \"dtype\""},
      {"no_shape", R"({"a": {"dtype": "F32", "data_offsets": [0, 8]}})", 8, "tensor 'a': missing \"shape\""},
      {"no_offsets", R"({"a": {"dtype": "F32", "shape": [2]}})", 8, "tensor 'a': missing \"data_offsets\""},
      {"dtype_number", R"({"a": {"dtype": 4, "shape": [2], "data_offsets": [0, 8]}})", 8,
       "tensor 'a': \"dtype\" must be a string, got 4"},
      {"shape_string", R"({"a": {"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}})", 8,
       "tensor 'a': \"shape\" must be an array of integers, got \"2\""},
      {"shape_float", R"({"a": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}})", 8,
       "tensor 'a': \"shape\" must be an array of integers, got [2.0]"},
      {"offsets_one", R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8]}})", 8,
       "tensor 'a': \"data_offsets\" must be [begin, end], two non-negative integers, got [8]"},
      {"offsets_string", R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, "8"]}})", 8,
       "tensor 'a': \"data_offsets\" must be [begin, end]"},
      {"offsets_negative", R"({"a": {"dtype": "F32", "shape": [0], "data_offsets": [-4, 0]}})", 8,
       "tensor 'a': \"data_offsets\" must be [begin, end]"},
      {"unknown_dtype", R"({"a": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}})", 8,
       "tensor 'a': unsupported dtype \"Q4\" (expected F32, BF16, F16, I32, I64, U16 or U8)"},
      {"negative_dim", R"({"a": {"dtype": "F32", "shape": [2, -1], "data_offsets": [0, 8]}})", 8,
       "tensor 'a': negative dim -1 in shape [2,-1]"},
      {"size_mismatch", R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}})", 8,
       "tensor 'a': data_offsets [0, 4] hold 4 bytes, but F32 [2] needs 8"},
      {"bf16_mismatch", R"({"a": {"dtype": "BF16", "shape": [3, 2], "data_offsets": [0, 8]}})", 8,
       "tensor 'a': data_offsets [0, 8] hold 8 bytes, but BF16 [3, 2] needs 12"},
      {"too_many_elements",
       R"({"a": {"dtype": "I64", "shape": [4294967296, 4294967296], "data_offsets": [0, 8]}})", 8,
       "tensor 'a': shape [4294967296, 4294967296] has too many elements"},
      {"past_end", R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", 4,
       "tensor 'a': data_offsets [0, 8] run past the end of the file"},
      {"end_before_begin", R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}})", 8,
       "tensor 'a': data_offsets [8, 0] end before they begin"},
      {"overlap", "{" + a_ok + R"(, "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})", 12,
       "tensor 'b': data_offsets [4, 12] overlap tensor 'a' [0, 8]"},
      {"overlap_inside", "{" + a_ok + R"(, "b": {"dtype": "U8", "shape": [1], "data_offsets": [7, 8]}})", 8,
       "overlap tensor 'a' [0, 8]"},
      {"duplicate", "{" + a_ok + ", " + a_ok + "}", 8, "header names 'a' more than once"},
      {"metadata_number", R"({"__metadata__": {"step": 5}})", 0,
       "\"__metadata__\" value of 'step' must be a string, got 5"},
      {"metadata_array", R"({"__metadata__": ["x"]})", 0, "\"__metadata__\" must be an object of strings"},
  };
  for (const auto& c : cases) {
    const std::string path = raw_file(dir, c.name, c.header, c.data_bytes);
    const std::string message = opens(path);
    INFO(c.name << ": " << message);
    CHECK(message.find(path + ": ") == 0);
    CHECK(message.find(c.expected) != std::string::npos);
  }
  // The exact message for bytes past the end: the header above is 61 bytes, so the data buffer
  // starts at byte 69, the tensor would end at 69 + 8 = 77 and the file has 69 + 4 = 73 bytes.
  const auto past_end = p + "/past_end";
  CHECK(opens(past_end) == past_end +
                               ": tensor 'a': data_offsets [0, 8] run past the end of the file: the tensor " +
                               "would end at byte 77, the file has 73 bytes");
  // The parse error's byte: `{"a": ` ends at file byte 8 + 6.
  CHECK(opens(p + "/not_json").find(p + "/not_json: byte 14: header is not valid JSON") == 0);

  // What is fine: an empty header, empty tensors anywhere, tensors listed out of file order.
  const auto empty = raw_file(dir, "empty_object", "{}", 0);
  CHECK(SafetensorsReader(empty).tensors().empty());
  const auto shuffled =
      raw_file(dir, "shuffled", R"({"a": {"dtype": "U8", "shape": [4], "data_offsets": [4, 8]},
      "b": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
      "c": {"dtype": "U8", "shape": [0], "data_offsets": [2, 2]}})",
               8);
  const SafetensorsReader r(shuffled);
  REQUIRE(r.tensors().size() == 3);
  CHECK(r.tensors()[0].name == "b");
  CHECK(r.tensors()[1].name == "c");
  CHECK(r.tensors()[2].name == "a");
  CHECK(r.find("a")->begin == 4);
}

TEST_CASE("failed safetensors writes are runtime errors that leave no temp file", "[checkpoint]") {
  test::TempDir dir;
  const float x[2] = {1, 2};
  const std::vector<TensorToWrite> tensors = {{"x", StDtype::f32, {2}, x}};

  const std::string nowhere = dir.path() + "/no/such/dir/model.safetensors";
  const std::string message = error_of<RuntimeError>([&] { write_safetensors(nowhere, tensors); });
  CHECK(message.find(nowhere + ": cannot create a temporary file beside it: No such file or directory") == 0);
  CHECK(std::filesystem::is_empty(dir.path()));

  // Links planted where a writer used to put its temporary file (PATH.tmp) and at the file itself
  // are never followed: the write lands in the folder, and what the links point to is untouched.
  const std::string path = dir.path() + "/model.safetensors";
  const std::string outside = dir.write("outside", "keep me");
  std::filesystem::create_symlink(outside, path + ".tmp");
  std::filesystem::create_symlink(outside, path);
  write_safetensors(path, tensors, {{"version", "new"}});
  CHECK(read_bytes(outside) == "keep me");
  CHECK_FALSE(std::filesystem::is_symlink(path));
  CHECK(SafetensorsReader(path).metadata().at("version") == "new");
  CHECK(std::filesystem::is_symlink(path + ".tmp"));  // not ours: left as it was
  std::filesystem::remove(path + ".tmp");
  // Nothing else is left beside the file: no temporary of any name.
  int entries = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator(dir.path())) ++entries;
  CHECK(entries == 2);  // model.safetensors and outside

  // Bad arguments fail before anything is created.
  const auto bad = [&](const std::vector<TensorToWrite>& t) {
    return error_of<RuntimeError>([&] { write_safetensors(dir.path() + "/bad.safetensors", t); });
  };
  CHECK(bad({{"x", StDtype::f32, {2}, x}, {"x", StDtype::f32, {2}, x}}) ==
        dir.path() + "/bad.safetensors: cannot write tensor 'x': a tensor of that name comes twice");
  CHECK(bad({{"x", StDtype::f32, {-2}, x}}).find("cannot write tensor 'x': shape [-2] has a negative dim") !=
        std::string::npos);
  CHECK(bad({{"x", StDtype::f32, {0, -2}, x}}).find("shape [0, -2] has a negative dim") != std::string::npos);
  CHECK(bad({{"__metadata__", StDtype::f32, {2}, x}}).find("reserved") != std::string::npos);
  CHECK(bad({{"x", StDtype::f32, {2}, nullptr}}).find("data is null") != std::string::npos);
  CHECK_FALSE(std::filesystem::exists(dir.path() + "/bad.safetensors"));
  CHECK_FALSE(std::filesystem::exists(dir.path() + "/bad.safetensors.tmp"));
}

TEST_CASE("file_crc32 is zlib's crc32 of the file's bytes", "[checkpoint]") {
  test::TempDir dir;
  CHECK(file_crc32(dir.write("check", "123456789")) == 0xCBF43926u);  // CRC-32's published check value
  CHECK(file_crc32(dir.write("empty", "")) == 0u);
  // Over 3 MiB, so that it is read in several chunks.
  std::string big(3 * 1024 * 1024 + 17, '\0');
  std::uint32_t state = 12345;
  for (auto& c : big) {
    state = state * 1664525u + 1013904223u;
    c = static_cast<char>(state >> 24);
  }
  CHECK(file_crc32(dir.write("big", big)) == builtin_crc(big));
  CHECK(error_of<RuntimeError>([&] {
          file_crc32(dir.path() + "/missing");
        }).find(dir.path() + "/missing: cannot open") == 0);
}

TEST_CASE("a large file (written past the page cache where the file system allows) holds its pieces and checksums",
          "[checkpoint]") {
  // Over two 8 MiB bounce buffers and a tail of whole blocks and a few bytes more; the pieces at
  // odd addresses and of odd lengths; CRC chunks of an odd size, so that they end inside buffers.
  test::TempDir dir;
  const std::size_t n = (std::size_t(17) << 20) / sizeof(float) + 4099;
  std::string source(n * sizeof(float) + 1, '\0');
  std::uint32_t state = 777;
  for (auto& c : source) {
    state = state * 1664525u + 1013904223u;
    c = static_cast<char>(state >> 24);
  }
  const char* at = source.data() + 1;  // floats at an address no O_DIRECT write could use as it is
  const std::size_t first = 3 * 1000 * 1001, second = 5 * 1024 * 1024 + 3;
  const std::vector<std::pair<const void*, std::size_t>> pieces = {
      {at, first}, {at + first, second}, {at + first + second, n * sizeof(float) - first - second}};
  const std::vector<std::int64_t> small = {1, 2, 3};
  const std::size_t crc_chunk = (std::size_t(1) << 20) + 3;
  const std::string path = dir.path() + "/big.safetensors";
  const std::uint64_t direct_before = direct_bytes_written();
  const FileChecksums sums = write_safetensors_checked(
      path, {{"w", StDtype::f32, {std::int64_t(n)}, nullptr, pieces}, {"r", StDtype::i64, {3}, small.data()}}, {},
      default_write_chunk, crc_chunk);

  const std::string file = read_bytes(path);
  CHECK(sums.crc32 == builtin_crc(file));
  REQUIRE(sums.chunks.size() == (file.size() + crc_chunk - 1) / crc_chunk);
  for (std::size_t c = 0; c < sums.chunks.size(); ++c) {
    CHECK(sums.chunks[c] == builtin_crc(file.substr(c * crc_chunk, crc_chunk)));
  }
  SafetensorsReader reader(path);
  REQUIRE(reader.find("w") != nullptr);
  REQUIRE(reader.find("r") != nullptr);
  const auto w = reader.data(*reader.find("w"));
  REQUIRE(w.size() == n * sizeof(float));
  CHECK(std::memcmp(w.data(), at, w.size()) == 0);
  CHECK(values_of<std::int64_t>(reader, *reader.find("r")) == small);
  CHECK(std::distance(std::filesystem::directory_iterator(dir.path()), std::filesystem::directory_iterator()) == 1);
  // Which way ran: where the file system takes O_DIRECT, every whole 4 KiB block of the file
  // went direct (the bytes under a block at its end, buffered).
  if (!takes_direct_writes(dir.path())) LLMTRAIN_SKIP(dir.path() + " does not take O_DIRECT writes: only the buffered way ran");
  CHECK(direct_bytes_written() - direct_before == file.size() / 4096 * 4096);
}

TEST_CASE("a refusal of O_DIRECT in the writer thread sends the rest buffered, and a real I/O error still fails",
          "[checkpoint]") {
  test::TempDir dir;
  if (!takes_direct_writes(dir.path())) LLMTRAIN_SKIP(dir.path() + " does not take O_DIRECT writes: no direct write to refuse");
  // 20 MiB and a few bytes: two full bounce buffers go through the writer thread, the first refused.
  const std::string bytes = noise((std::size_t(20) << 20) + 5, 99);
  const std::size_t crc_chunk = std::size_t(3) << 20;
  const auto write = [&](const std::string& name) {
    DiskWriter writer(dir.path() + "/" + name, default_write_chunk, crc_chunk);
    writer.reserve(bytes.size());
    writer.write(bytes.data(), bytes.size());
    writer.commit();
    return writer.direct_bytes();
  };
  // The hook off again however a case ends (an exception out of write() included).
  struct HookOff {
    ~HookOff() { fail_first_direct_write_for_test(0); }
  } hook_off;
  for (const int refusal : {EINVAL, EOPNOTSUPP, EPERM, ENOSYS}) {
    INFO("refused with " << std::strerror(refusal));
    fail_first_direct_write_for_test(refusal);
    const std::uint64_t direct = write("refused");
    fail_first_direct_write_for_test(0);
    CHECK(direct == 0);  // the refusal cleared O_DIRECT for the rest of the file
    CHECK(read_bytes(dir.path() + "/refused") == bytes);
  }
  CHECK(write("direct") == bytes.size() / 4096 * 4096);  // the same file, not refused: direct
  CHECK(read_bytes(dir.path() + "/direct") == bytes);
  for (const int failure : {ENOSPC, EIO, EDQUOT}) {
    INFO("failed with " << std::strerror(failure));
    fail_first_direct_write_for_test(failure);
    const std::string error = error_of<RuntimeError>([&] { write("failed"); });
    fail_first_direct_write_for_test(0);
    CHECK(error.find(std::string("failed: cannot write ")) != std::string::npos);
    CHECK(error.find(std::strerror(failure)) != std::string::npos);
    CHECK_FALSE(std::filesystem::exists(dir.path() + "/failed"));
  }
  CHECK(direct_refused(ENOTSUP));
  CHECK_FALSE(direct_refused(EROFS));
}
