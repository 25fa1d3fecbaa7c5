// The TensorBoard file of a short run, decoded here: every record's CRCs verify and the loss
// scalars equal metrics.jsonl's.
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>

#include <nlohmann/json.hpp>

#include "catch_compat.h"
#include "process.h"
#include "train/tensorboard.h"

using namespace llmtrain;

namespace {

// A minimal protocol-buffer reader: varints, fixed64/32 and length-delimited fields.
struct Reader {
  std::string_view data;
  std::size_t at = 0;
  bool done() const { return at >= data.size(); }
  std::uint64_t varint() {
    std::uint64_t v = 0;
    for (int shift = 0;; shift += 7) {
      const auto b = static_cast<unsigned char>(data.at(at++));
      v |= std::uint64_t(b & 0x7F) << shift;
      if (!(b & 0x80)) return v;
    }
  }
  template <class T>
  T fixed() {
    T v;
    std::memcpy(&v, data.substr(at, sizeof(T)).data(), sizeof(T));
    at += sizeof(T);
    return v;
  }
  std::string_view bytes() {
    const auto n = std::size_t(varint());
    const auto out = data.substr(at, n);
    at += n;
    return out;
  }
};

}  // namespace

TEST_CASE("CRC-32C matches its published check value", "[tensorboard]") {
  CHECK(train::crc32c("123456789") == 0xE3069283u);
  CHECK(train::crc32c("") == 0u);
}

TEST_CASE("a run's TensorBoard records verify and hold metrics.jsonl's losses", "[tensorboard]") {
  test::TempDir dir;
  std::string text;
  for (int i = 0; i < 300; ++i) text += "tensorboard test line " + std::to_string(i) + "\n";
  const std::string corpus = dir.write("corpus.txt", text);
  REQUIRE(test::run_llmtrain({"tokenize", "--input", corpus, "--output", dir.path() + "/shards"}).exit_code == 0);
  const std::string config = dir.write("c.json", R"({
    "model": {"vocab_size": 256, "context_length": 16, "n_layer": 1, "n_head": 2, "d_model": 16},
    "data": {"train": ")" + dir.path() + R"(/shards/train_*.bin", "val": ")" + dir.path() + R"(/shards/val_*.bin"},
    "train": {"micro_batch_size": 2, "global_batch_size": 4, "max_steps": 8, "eval_every": 4, "eval_batches": 1},
    "optim": {"warmup_steps": 1}})");
  const std::string run = dir.path() + "/run";
  REQUIRE(test::run_llmtrain({"train", "--config", config, "--run-dir", run}).exit_code == 0);

  std::string file;
  for (const auto& entry : std::filesystem::directory_iterator(run + "/tb")) file = entry.path().string();
  REQUIRE(file.find("events.out.tfevents.") != std::string::npos);
  std::ifstream in(file, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), {});

  std::map<std::int64_t, float> loss, val_loss;
  int records = 0;
  std::string version;
  for (std::size_t at = 0; at < bytes.size(); ++records) {
    REQUIRE(at + 12 <= bytes.size());
    std::uint64_t length;
    std::uint32_t length_crc, data_crc;
    std::memcpy(&length, bytes.data() + at, 8);
    std::memcpy(&length_crc, bytes.data() + at + 8, 4);
    REQUIRE(length_crc == train::masked_crc32c(std::string_view(bytes).substr(at, 8)));
    const std::string_view data = std::string_view(bytes).substr(at + 12, length);
    std::memcpy(&data_crc, bytes.data() + at + 12 + length, 4);
    REQUIRE(data_crc == train::masked_crc32c(data));
    at += 12 + length + 4;

    Reader event{data};
    std::int64_t step = -1;
    while (!event.done()) {
      const auto key = event.varint();
      if (key == (1 << 3 | 1)) event.fixed<double>();                      // wall_time
      else if (key == (2 << 3 | 0)) step = std::int64_t(event.varint());   // step
      else if (key == (3 << 3 | 2)) version = std::string(event.bytes());  // file_version
      else if (key == (5 << 3 | 2)) {                                      // summary
        Reader summary{event.bytes()};
        while (!summary.done()) {
          REQUIRE(summary.varint() == (1 << 3 | 2));  // value
          Reader value{summary.bytes()};
          std::string tag;
          float number = 0;
          while (!value.done()) {
            const auto k = value.varint();
            if (k == (1 << 3 | 2)) tag = std::string(value.bytes());
            else if (k == (2 << 3 | 5)) number = value.fixed<float>();
            else FAIL("unexpected field in Summary.Value");
          }
          if (tag == "loss") loss[step] = number;
          if (tag == "val_loss") val_loss[step] = number;
        }
      } else {
        FAIL("unexpected field in Event");
      }
    }
  }
  CHECK(version == "brain.Event:2");
  CHECK(records == 1 + 8 * 5 + 2);  // version, 5 scalars per step (loss, lr, grad_norm, tokens_per_s, memory_gb), 2 validations
  std::ifstream metrics(run + "/metrics.jsonl");
  int compared = 0;
  for (std::string line; std::getline(metrics, line);) {
    const auto m = nlohmann::json::parse(line);
    const auto step = m["step"].get<std::int64_t>();
    if (m.contains("loss")) {
      CHECK(loss.at(step) == static_cast<float>(m["loss"].get<double>()));
      ++compared;
    }
    if (m.contains("val_loss")) CHECK(val_loss.at(step) == static_cast<float>(m["val_loss"].get<double>()));
  }
  CHECK(compared == 8);
}
