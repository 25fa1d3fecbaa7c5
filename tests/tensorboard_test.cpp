// The TensorBoard file of a short run, decoded here: every record's CRCs verify and the loss
// scalars equal metrics.jsonl's.
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>

#include <nlohmann/json.hpp>

#include "catch_compat.h"
#include "process.h"
#include "tensorboard_events.h"
#include "train/tensorboard.h"

using namespace llmtrain;
using test::Events;
using test::read_events;

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

  const Events events = read_events(run);
  const auto& loss = events.scalars.at("loss");
  const auto& val_loss = events.scalars.at("val_loss");
  const int records = events.records;
  const std::string version = events.version;
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
