// A checkpoint's commit: the marker that records state.json's checksum, the chunk checksums that
// must combine to a file's, and a save of a step whose complete checkpoint exists already (the old
// one whole until the new one is complete, then swapped in).
#include <algorithm>
#include <cstdio>
#include <memory>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "catch_compat.h"
#include "checkpoint/checkpoint.h"
#include "core/crc32.h"
#include "dist/communicator.h"
#include "process.h"

using namespace llmtrain;
using namespace llmtrain::checkpoint;

namespace {

namespace fs = std::filesystem;

// As a reader resolves it from state.json (defaults filled in).
config::Config tiny_config() {
  config::Config c;
  c.model.vocab_size = 64;
  c.model.context_length = 8;
  c.model.n_layer = 1;
  c.model.n_head = 2;
  c.model.d_model = 8;
  return config::parse_config(config::to_json(c).dump(), "tiny config");
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

void write_text(const std::string& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

// A one-rank save of step `step` whose weights, m and v are all `value`.
struct Saver {
  explicit Saver(const std::string& root) : model(model::make_model(tiny_config().model, Device::cpu)) {
    request.root = root;
    request.model = model.get();
    request.state = {{"tokens_seen", 0}, {"sampler", {{"epoch", 0}, {"next_sample", 0}}}, {"world_size", 1},
                     {"zero_stage", 0}, {"config", config::to_json(tiny_config())}};
  }
  SaveRequest& with(std::int64_t step, float value) {
    const std::int64_t P = model->num_params();
    state.assign(std::size_t(P), value);
    request.step = step;
    request.part = {{{0, P}}, state.data(), {{"adamw.m", state.data()}, {"adamw.v", state.data()}}};
    return request;
  }
  // The first weight of the checkpoint at `path`, as a reader finds it.
  float first_weight(const std::string& path) const {
    const Found found = find(path);
    float w = 0;
    load_state(found, StateKind::weights, {{0, 1}}, {&w});
    return w;
  }
  std::unique_ptr<model::Model> model;
  std::vector<float> state;
  SaveRequest request;
};

std::vector<std::string> names_in(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

template <class E, class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "(no error of the expected type)";
}

}  // namespace

TEST_CASE("a complete checkpoint of the step being saved stays whole until its replacement is complete", "[checkpoint]") {
  test::TempDir dir;
  const auto comm = dist::make_single_communicator();
  const std::string root = dir.path() + "/checkpoints", step = root + "/step_00000005";
  Saver saver(root);
  save(saver.with(5, 1.0f), *comm);
  REQUIRE(saver.first_weight(root) == 1.0f);
  // The same step again, with other values: at every moment before its commit the first is whole.
  const SaveRequest& again = saver.with(5, 2.0f);
  const std::string written = prepare_dir(root, 5, *comm);
  CHECK(written != step);
  CHECK(saver.first_weight(step) == 1.0f);
  const WrittenPart part = write_part(again, written, 0, 1);
  REQUIRE(part.error.empty());
  CHECK(saver.first_weight(step) == 1.0f);
  CHECK(commit(again, part, *comm).dir == step);
  CHECK(saver.first_weight(root) == 2.0f);
  CHECK(saver.first_weight(step) == 2.0f);
  remove_pruned(root);
  CHECK(names_in(root) == std::vector<std::string>{"latest", "step_00000005"});
  // An incomplete attempt at a step is no checkpoint: it is replaced where it lies.
  fs::create_directories(root + "/step_00000006");
  write_text(root + "/step_00000006/model.safetensors", "partial");
  CHECK(prepare_dir(root, 6, *comm) == root + "/step_00000006");
  CHECK(names_in(root + "/step_00000006").empty());
}

TEST_CASE("state.json is checked against the checksum its commit marker records, and an empty marker records none",
          "[checkpoint]") {
  test::TempDir dir;
  const auto comm = dist::make_single_communicator();
  const std::string root = dir.path() + "/checkpoints", step = root + "/step_00000003";
  Saver saver(root);
  save(saver.with(3, 1.5f), *comm);
  const std::string state = read_text(step + "/state.json");
  const nlohmann::json marker = nlohmann::json::parse(read_text(step + "/COMPLETE"));
  CHECK(marker.at("state.json").at("crc32").get<std::uint32_t>() == crc32(state));
  CHECK(marker.at("state.json").at("bytes").get<std::size_t>() == state.size());
  // A digit changed: still valid JSON, still a valid state.json, but not the one committed.
  std::string damaged = state;
  const std::size_t at = damaged.find("\"tokens_seen\": 0");
  REQUIRE(at != std::string::npos);
  damaged[at + 15] = '7';
  write_text(step + "/state.json", damaged);
  CHECK(error_of<DamagedCheckpoint>([&] { find(step); }).find(step + "/state.json: ") == 0);
  // An earlier version's empty marker: no checksum to check, and the checkpoint loads.
  write_text(step + "/COMPLETE", "");
  CHECK(saver.first_weight(step) == 1.5f);
  write_text(step + "/COMPLETE", "[1]");
  CHECK(error_of<InputError>([&] { find(step); }).find(step + "/COMPLETE: expected") == 0);
}

TEST_CASE("a file's chunk checksums must combine to its recorded checksum", "[checkpoint]") {
  test::TempDir dir;
  const auto comm = dist::make_single_communicator();
  const std::string root = dir.path() + "/checkpoints", step = root + "/step_00000004";
  Saver saver(root);
  save(saver.with(4, 0.5f), *comm);
  nlohmann::json state = nlohmann::json::parse(read_text(step + "/state.json"));
  // Chunks of 100 bytes: several, listed with their right checksums (computed here).
  const std::string weights = read_text(step + "/model.safetensors");
  nlohmann::json chunks = nlohmann::json::array();
  for (std::size_t c = 0; c < weights.size(); c += 100) chunks.push_back(crc32(weights.substr(c, 100)));
  nlohmann::json& listed = state["files"]["model.safetensors"];
  listed["chunk_bytes"] = 100;
  listed["chunk_crc32"] = chunks;
  REQUIRE(chunks.size() > 2);
  const auto recommit = [&] {
    const std::string text = state.dump(2) + "\n";
    write_text(step + "/state.json", text);
    write_text(step + "/COMPLETE", complete_marker(text));
  };
  recommit();
  CHECK(saver.first_weight(step) == 0.5f);  // right chunks, right whole: accepted
  listed["crc32"] = (listed["crc32"].get<std::uint32_t>() ^ 1u);
  recommit();
  const std::string error = error_of<DamagedCheckpoint>([&] { find(step); });
  CHECK(error.find("files.model.safetensors: the chunk checksums combine to crc32") != std::string::npos);
}
