// Checkpoint state by ranges: files written by several ranks, read back by other ranges (a resume
// on another mesh), the chunk checksums of what is read, and the time a million ranges take.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <numeric>
#include <random>
#include <vector>

#include <nlohmann/json.hpp>

#include "catch_compat.h"
#include "checkpoint/checkpoint.h"
#include "core/crc32.h"
#include "process.h"

using namespace llmtrain;
using namespace llmtrain::checkpoint;

namespace {

config::ModelConfig tiny_model() {
  config::ModelConfig c;
  c.vocab_size = 64;
  c.context_length = 8;
  c.n_layer = 1;
  c.n_head = 2;
  c.d_model = 8;
  return c;
}

// A checkpoint folder whose ranks each wrote `parts[r]` (their weights, m and v: the element's
// index, times 2 and times 3, so that every value says where it came from), listed in state.json
// as commit() lists them.
Found write_ranks(const std::string& dir, const model::Model& model, const std::vector<std::vector<FlatRange>>& parts) {
  nlohmann::json files = nlohmann::json::object();
  for (std::size_t r = 0; r < parts.size(); ++r) {
    std::vector<float> w, m, v;
    for (const FlatRange& range : parts[r]) {
      for (std::int64_t i = range.begin; i < range.end; ++i) {
        w.push_back(float(i));
        m.push_back(2.0f * float(i));
        v.push_back(3.0f * float(i));
      }
    }
    SaveRequest request;
    request.model = &model;
    request.part = {parts[r], w.data(), {{"adamw.m", m.data()}, {"adamw.v", v.data()}}};
    const WrittenPart written = write_part(request, dir, int(r), int(parts.size()));
    REQUIRE(written.error.empty());
    for (const auto& f : written.files) {
      files[f.name] = {{"crc32", f.crc32}, {"bytes", f.bytes}, {"chunk_bytes", f.chunk_bytes}, {"chunk_crc32", f.chunk_crc32}};
    }
  }
  Found found;
  found.dir = dir;
  found.state = {{"files", files}};
  found.config.model = model.config();
  return found;
}

}  // namespace

TEST_CASE("ranges written by some ranks read back by others, whichever files hold them", "[checkpoint]") {
  test::TempDir dir;
  const auto model = model::make_model(tiny_model(), Device::cpu);
  // Rank 0 holds [0, 10) and [30, 40), rank 1 [10, 30) and [40, 50).
  const Found found = write_ranks(dir.path(), *model, {{{0, 10}, {30, 40}}, {{10, 30}, {40, 50}}});
  const std::vector<FlatRange> wanted = {{45, 50}, {5, 35}, {0, 2}};  // any order, across files
  const std::int64_t n = 5 + 30 + 2;
  std::vector<float> w(n), m(n), v(n);
  load_state(found, StateKind::weights, wanted, {w.data()});
  load_state(found, StateKind::optimizer, wanted, {m.data(), v.data()}, {"adamw.m", "adamw.v"});
  std::int64_t at = 0;
  for (const FlatRange& r : wanted) {
    for (std::int64_t i = r.begin; i < r.end; ++i, ++at) {
      REQUIRE(w[std::size_t(at)] == float(i));
      REQUIRE(m[std::size_t(at)] == 2.0f * float(i));
      REQUIRE(v[std::size_t(at)] == 3.0f * float(i));
    }
  }
  // Elements no file holds: a damaged checkpoint, named.
  std::vector<float> more(10);
  try {
    load_state(found, StateKind::weights, {{45, 55}}, {more.data()});
    FAIL("no error");
  } catch (const DamagedCheckpoint& e) {
    CHECK(std::string(e.what()).find("cover 5 of the 10 elements") != std::string::npos);
  }
}

TEST_CASE("a damaged chunk is found by the reader that reads it, and only by it", "[checkpoint]") {
  test::TempDir dir;
  const auto model = model::make_model(tiny_model(), Device::cpu);
  // One rank's file of 3 MB, checked in chunks of 1 MiB: a byte flipped in its last chunk.
  const std::int64_t n = 750'000;
  Found found = write_ranks(dir.path(), *model, {{{0, n}}, {{n, n + 10}}});
  const std::string file = dir.path() + "/model-00000.safetensors";
  // The writer's chunks are default_crc_chunk (8 MiB): one here. List the file as read in chunks
  // of 1 MiB instead (their CRCs computed here) to see a reader skip the chunks it does not need.
  std::ifstream in(file, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), {});
  const std::size_t chunk = std::size_t(1) << 20;
  nlohmann::json crcs = nlohmann::json::array();
  for (std::size_t at = 0; at < bytes.size(); at += chunk) crcs.push_back(crc32(bytes.data() + at, std::min(chunk, bytes.size() - at)));
  found.state["files"]["model-00000.safetensors"]["chunk_bytes"] = chunk;
  found.state["files"]["model-00000.safetensors"]["chunk_crc32"] = crcs;
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(std::streamoff(bytes.size() - 5));
    f.put(char(bytes[bytes.size() - 5] ^ 0x40));
  }
  std::vector<float> w(1000);
  load_state(found, StateKind::weights, {{0, 1000}}, {w.data()});  // the first chunk: intact
  CHECK(w[999] == 999.0f);
  try {
    load_state(found, StateKind::weights, {{n - 1000, n}}, {w.data()});
    FAIL("no error");
  } catch (const DamagedCheckpoint& e) {
    CHECK(std::string(e.what()).find("model-00000.safetensors: checksum mismatch in bytes 2097152 to") != std::string::npos);
  }
}

TEST_CASE("a million ranges resume by a sorted merge, in seconds", "[checkpoint]") {
  test::TempDir dir;
  const auto model = model::make_model(tiny_model(), Device::cpu);
  // Two ranks' files of 10^6 ranges each, interleaved as tensor-parallel column splits are:
  // rank 0 [4i, 4i + 2), rank 1 [4i + 2, 4i + 4). The reader wants 10^6 ranges [4i + 1, 4i + 3),
  // each half in one file and half in the other, in shuffled order.
  const std::int64_t count = 1'000'000;
  std::vector<std::vector<FlatRange>> parts(2);
  for (std::int64_t i = 0; i < count; ++i) {
    parts[0].push_back({4 * i, 4 * i + 2});
    parts[1].push_back({4 * i + 2, 4 * i + 4});
  }
  const Found found = write_ranks(dir.path(), *model, parts);
  std::vector<FlatRange> wanted;
  for (std::int64_t i = 0; i < count; ++i) wanted.push_back({4 * i + 1, 4 * i + 3});
  std::shuffle(wanted.begin(), wanted.end(), std::mt19937(5));
  std::vector<float> m(std::size_t(2 * count)), v(m.size());
  const auto start = std::chrono::steady_clock::now();
  load_state(found, StateKind::optimizer, wanted, {m.data(), v.data()}, {"adamw.m", "adamw.v"});
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("load_state: 10^6 wanted ranges over 2 x 10^6 held: %.2f s\n", seconds);
  for (std::size_t k = 0; k < wanted.size(); ++k) {
    REQUIRE(m[2 * k] == 2.0f * float(wanted[k].begin));
    REQUIRE(v[2 * k + 1] == 3.0f * float(wanted[k].begin + 1));
  }
  // A nested loop over 10^6 x 2 x 10^6 pairs would take hours; the merge takes about a second.
  // The bound only guards against a return to quadratic time on a loaded machine.
  CHECK(seconds < 60.0);
}
