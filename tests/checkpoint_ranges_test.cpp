// Checkpoint state by ranges: files written by several ranks, read back by other ranges (a resume
// on another mesh), the chunk checksums of what is read, the files a reader opens, and the time a
// million ranges take.
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
      files[f.name] = {{"crc32", f.crc32},
                       {"bytes", f.bytes},
                       {"chunk_bytes", f.chunk_bytes},
                       {"chunk_crc32", f.chunk_crc32},
                       {"spans", nlohmann::json::array()}};
      for (const FlatRange& span : f.spans) files[f.name]["spans"].push_back({span.begin, span.end});
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

// Four ranks' ZeRO 3-like shards, each a part of both halves of the flat buffer (so that each
// file's ranges reach across the others'): a reader of one rank's ranges opens that rank's file
// alone (the spans in state.json say which), one across a boundary the two files; a checkpoint
// whose state.json lists no spans (an earlier version's) is read by opening every file, to the
// same values.
TEST_CASE("a reader opens only the files whose spans hold its ranges, and without spans every file", "[checkpoint]") {
  test::TempDir dir;
  const auto model = model::make_model(tiny_model(), Device::cpu);
  const std::int64_t P = model->num_params(), q = P / 8, h = 4 * q;
  REQUIRE(q > 2);
  std::vector<std::vector<FlatRange>> parts;
  for (std::int64_t r = 0; r < 4; ++r) parts.push_back({{h + r * q, h + (r + 1) * q}, {r * q, (r + 1) * q}});
  parts[3][0].end = P;
  Found found = write_ranks(dir.path(), *model, parts);
  REQUIRE(found.state["files"]["model-00002.safetensors"]["spans"] == nlohmann::json({{2 * q, 3 * q}, {h + 2 * q, h + 3 * q}}));
  const auto check = [](const float* got, std::int64_t n, std::int64_t first, float scale) {
    for (std::int64_t i = 0; i < n; ++i) REQUIRE(got[i] == scale * float(first + i));
  };
  const std::size_t nq = static_cast<std::size_t>(2 * q);
  std::vector<float> w(nq), m(nq), v(nq);
  {
    const StateReader weights(found, StateKind::weights);
    CHECK(weights.files_opened() == 0);
    weights.read({{2 * q, 3 * q}, {h + 2 * q, h + 3 * q}}, {w.data()});  // rank 2's
    check(w.data(), q, 2 * q, 1.0f);
    check(w.data() + q, q, h + 2 * q, 1.0f);
    CHECK(weights.files_opened() == 1);
    weights.read({{2 * q + 1, 3 * q}}, {w.data()});  // the same file: opened once
    CHECK(weights.files_opened() == 1);
    weights.read({{h + q + 1, h + 2 * q + 1}}, {w.data()});  // across the boundary of ranks 1 and 2
    check(w.data(), q, h + q + 1, 1.0f);
    CHECK(weights.files_opened() == 2);
    const StateReader optimizer(found, StateKind::optimizer, {"adamw.m", "adamw.v"});
    optimizer.read({{3 * q, 3 * q + 2}, {0, 1}}, {m.data(), v.data()});  // ranks 3 and 0
    CHECK(m[0] == 2.0f * float(3 * q));
    CHECK(v[2] == 0.0f);
    CHECK(optimizer.files_opened() == 2);
  }
  for (auto& [name, listed] : found.state["files"].items()) listed.erase("spans");
  const StateReader old(found, StateKind::weights);
  CHECK(old.files_opened() == 4);
  std::fill(w.begin(), w.end(), -1.0f);
  old.read({{2 * q, 3 * q}}, {w.data()});
  check(w.data(), q, 2 * q, 1.0f);
  // Spans that are not [begin, end] pairs: named.
  found.state["files"]["model-00001.safetensors"]["spans"] = {{5, 2}};
  try {
    const StateReader bad(found, StateKind::weights);
    FAIL("no error");
  } catch (const DamagedCheckpoint& e) {
    CHECK(std::string(e.what()).find("files.model-00001.safetensors.spans: expected a list of [begin, end] with 0 <= "
                                     "begin <= end, got [[5,2]]") != std::string::npos);
  }
}

// A file's index: touching ranges joined, then the smallest gaps closed down to the limit.
TEST_CASE("index_spans covers the ranges with at most the limit's runs, closing the smallest gaps", "[checkpoint]") {
  using Pairs = std::vector<std::pair<std::int64_t, std::int64_t>>;
  const auto pairs = [](const std::vector<FlatRange>& runs) {
    Pairs out;
    for (const FlatRange& r : runs) out.emplace_back(r.begin, r.end);
    return out;
  };
  const std::vector<FlatRange> ranges = {{50, 60}, {0, 10}, {10, 20}, {23, 30}, {5, 5}, {100, 110}, {40, 45}};
  CHECK(pairs(index_spans(ranges)) == Pairs{{0, 20}, {23, 30}, {40, 45}, {50, 60}, {100, 110}});
  // gaps 3, 10, 5, 40: closing the two smallest (3, 5)
  CHECK(pairs(index_spans(ranges, 3)) == Pairs{{0, 30}, {40, 60}, {100, 110}});
  CHECK(pairs(index_spans(ranges, 1)) == Pairs{{0, 110}});
  CHECK(index_spans({{3, 3}}).empty());
  // A layout of more ranges than the limit: still covered.
  std::vector<FlatRange> rows;
  for (std::int64_t i = 0; i < 1000; ++i) rows.push_back({10 * i, 10 * i + 3});
  const std::vector<FlatRange> covered = index_spans(rows);
  CHECK(covered.size() == max_index_spans);
  for (const FlatRange& r : rows) {
    CHECK(std::any_of(covered.begin(), covered.end(), [&](const FlatRange& c) { return c.begin <= r.begin && r.end <= c.end; }));
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
