// Shard files: round trips, and every malformed file rejected naming the file and byte offset.
#include <cstring>
#include <fstream>
#include <numeric>

#include "catch_compat.h"
#include "core/error.h"
#include "data/dataset.h"
#include "data/shard.h"
#include "process.h"

using namespace llmtrain;
using namespace llmtrain::data;

namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const InputError& e) {
    return e.what();
  }
  return "(no InputError)";
}

// A raw file with this header and `payload_bytes` zero bytes after it.
std::string raw_shard(const test::TempDir& dir, const std::string& name, std::int32_t magic, std::int32_t version,
                      std::int32_t count, std::size_t payload_bytes) {
  std::string bytes(shard_header_bytes + payload_bytes, '\0');
  const std::int32_t header[3] = {magic, version, count};
  std::memcpy(bytes.data(), header, sizeof header);
  return dir.write(name, bytes);
}

}  // namespace

TEST_CASE("shards round-trip as uint16 and uint32", "[data]") {
  test::TempDir dir;
  std::vector<std::uint32_t> small(1000);
  std::iota(small.begin(), small.end(), 65000u);  // crosses 65535: needs version 2
  std::vector<std::uint32_t> narrow(small.begin(), small.begin() + 5);
  write_shard(dir.path() + "/a.bin", narrow);
  write_shard(dir.path() + "/b.bin", small);
  const ShardFile a(dir.path() + "/a.bin"), b(dir.path() + "/b.bin");
  CHECK(a.version() == 1);
  CHECK(a.num_tokens() == 5);
  CHECK(b.version() == 2);
  CHECK(b.num_tokens() == 1000);
  std::vector<std::int32_t> out(1000);
  b.read_tokens(0, 1000, 1u << 20, out.data());
  for (int i = 0; i < 1000; ++i) REQUIRE(out[i] == 65000 + i);
  a.read_tokens(2, 3, 65536, out.data());
  CHECK(out[0] == 65002);
  CHECK(out[2] == 65004);
  // The format is llm.c's: 1024 header bytes, then little-endian uint16.
  std::ifstream raw(dir.path() + "/a.bin", std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(raw)), {});
  REQUIRE(bytes.size() == 1024 + 10);
  std::int32_t header[3];
  std::memcpy(header, bytes.data(), 12);
  CHECK(header[0] == 20240520);
  CHECK(header[1] == 1);
  CHECK(header[2] == 5);
  CHECK((unsigned char)bytes[1024] == (65000 & 0xFF));
  CHECK((unsigned char)bytes[1025] == (65000 >> 8));
}

TEST_CASE("malformed shards are input errors naming file and byte offset", "[data]") {
  test::TempDir dir;
  const auto p = dir.path();
  CHECK(error_of([&] { ShardFile(p + "/missing.bin"); }).find(p + "/missing.bin: cannot open shard") == 0);
  const auto short_file = dir.write("short.bin", std::string(100, '\0'));
  CHECK(error_of([&] { ShardFile{short_file}; }) ==
        short_file + ": byte 100: file ends inside the 1024-byte header (100 bytes)");
  const auto magic = raw_shard(dir, "magic.bin", 12345, 1, 0, 0);
  CHECK(error_of([&] { ShardFile{magic}; }) ==
        magic + ": byte 0: bad magic 12345, expected 20240520 (not a token shard)");
  const auto version = raw_shard(dir, "version.bin", shard_magic, 3, 0, 0);
  CHECK(error_of([&] { ShardFile{version}; }) ==
        version + ": byte 4: unsupported version 3, expected 1 (uint16) or 2 (uint32)");
  const auto negative = raw_shard(dir, "negative.bin", shard_magic, 1, -5, 0);
  CHECK(error_of([&] { ShardFile{negative}; }) == negative + ": byte 8: negative token count -5");
  const auto truncated = raw_shard(dir, "truncated.bin", shard_magic, 1, 10, 19);
  CHECK(error_of([&] { ShardFile{truncated}; }) ==
        truncated + ": byte 8: header says 10 tokens (1044 bytes) but the file has 1043 bytes");
  const auto wide = raw_shard(dir, "wide.bin", shard_magic, 2, 10, 20);  // version 2 needs 40 bytes
  CHECK(error_of([&] { ShardFile{wide}; }).find("header says 10 tokens (1064 bytes)") != std::string::npos);

  std::vector<std::uint32_t> tokens = {1, 2, 3, 300, 4};
  write_shard(p + "/vocab.bin", tokens);
  const ShardFile f(p + "/vocab.bin");
  std::vector<std::int32_t> out(5);
  CHECK_NOTHROW(f.read_tokens(0, 3, 256, out.data()));
  CHECK(error_of([&] { f.read_tokens(0, 5, 256, out.data()); }) ==
        p + "/vocab.bin: byte 1030: token 300 is not below model.vocab_size (256)");
}

TEST_CASE("globs expand sorted, and a pattern matching nothing names its key", "[data]") {
  test::TempDir dir;
  for (const char* name : {"train_000002.bin", "train_000000.bin", "train_000001.bin", "val_000000.bin"}) {
    dir.write(name, "");
  }
  const auto paths = expand_paths({dir.path() + "/train_*.bin", dir.path() + "/val_*.bin"}, "data.train");
  REQUIRE(paths.size() == 4);
  CHECK(paths[0] == dir.path() + "/train_000000.bin");
  CHECK(paths[2] == dir.path() + "/train_000002.bin");
  CHECK(paths[3] == dir.path() + "/val_000000.bin");
  CHECK(error_of([&] { expand_paths({dir.path() + "/nope_*.bin"}, "data.val"); }) ==
        "data.val: no file matches '" + dir.path() + "/nope_*.bin'");
}

TEST_CASE("samples are T + 1 token windows, files in order", "[data]") {
  test::TempDir dir;
  std::vector<std::uint32_t> first(100), second(20);
  std::iota(first.begin(), first.end(), 0u);
  std::iota(second.begin(), second.end(), 1000u);
  write_shard(dir.path() + "/a.bin", first);
  write_shard(dir.path() + "/b.bin", second);
  const TokenDataset data({dir.path() + "/a.bin", dir.path() + "/b.bin"}, 8, 2000);
  CHECK(data.num_samples() == 12 + 2);  // (100 - 1) / 8 and (20 - 1) / 8
  std::vector<std::int32_t> in(8), target(8);
  data.read_sample(11, in.data(), target.data());
  CHECK(in == std::vector<std::int32_t>{88, 89, 90, 91, 92, 93, 94, 95});
  CHECK(target == std::vector<std::int32_t>{89, 90, 91, 92, 93, 94, 95, 96});
  data.read_sample(13, in.data(), target.data());
  CHECK(in[0] == 1008);
  CHECK(target[7] == 1016);
}

TEST_CASE("the loader delivers the sampler's micro-batches in order and surfaces read errors", "[data]") {
  test::TempDir dir;
  std::vector<std::uint32_t> tokens(4 * 64 + 1);
  std::iota(tokens.begin(), tokens.end(), 0u);
  write_shard(dir.path() + "/a.bin", tokens);
  const TokenDataset data({dir.path() + "/a.bin"}, 4, 1000);  // 64 samples: sample i starts at token 4 i
  const SamplerOptions options{64, 8, 2, 2, 1, true, 7};
  DistributedSampler reference(options);
  BatchLoader loader(data, options, {});
  REQUIRE(loader.micro_steps() == 2);
  std::vector<std::int64_t> expected(2);
  for (int update = 0; update < 20; ++update) {  // 8 updates per epoch: crosses two epoch ends
    for (int m = 0; m < 2; ++m) {
      const MicroBatch batch = loader.next();
      reference.micro_batch(m, expected);
      CHECK(batch.micro_step == m);
      for (int b = 0; b < 2; ++b) {
        REQUIRE(batch.inputs[b * 4] == expected[b] * 4);
        REQUIRE(batch.targets[b * 4 + 3] == expected[b] * 4 + 4);
      }
      CHECK(batch.after == reference.state_after_update());
    }
    reference.advance();
  }

  const TokenDataset small_vocab({dir.path() + "/a.bin"}, 4, 100);  // tokens >= 100 are invalid
  BatchLoader failing(small_vocab, {64, 64, 64, 1, 0, false, 0}, {});
  CHECK_THROWS_AS(failing.next(), InputError);
}
