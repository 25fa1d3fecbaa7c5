// Weighted mixtures and named validation sets in whole runs: tokens per source and each set's
// validation loss in the log, metrics.jsonl and TensorBoard; a one-source list trains exactly as
// the plain list; a mixture resumes exactly, and refuses other weights or shards unless told;
// eval reports the same named losses.
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>

#include <nlohmann/json.hpp>

#include "catch_compat.h"
#include "process.h"
#include "tensorboard_events.h"

using namespace llmtrain;
using test::run_llmtrain;
using test::TempDir;

namespace {

// Two corpora of different text, each tokenized (bytes) into DIR/NAME/{train,val}_*.bin.
void make_sources(const TempDir& dir) {
  std::string a, b;
  for (int i = 0; i < 300; ++i) a += "the quick brown fox jumps over dog " + std::to_string(i) + "\n";
  for (int i = 0; i < 400; ++i) b += std::to_string(i * 7919 % 1000) + " + " + std::to_string(i % 17) + " = ?\n";
  for (const auto& [name, text] : {std::pair{"a", a}, std::pair{"b", b}}) {
    const std::string corpus = dir.write(std::string(name) + ".txt", text);
    REQUIRE(run_llmtrain({"tokenize", "--input", corpus, "--output", dir.path() + "/" + name}).exit_code == 0);
  }
}

std::vector<nlohmann::json> metrics(const std::string& run) {
  std::vector<nlohmann::json> out;
  std::ifstream in(run + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
  return out;
}

std::string config_text(const std::string& data, const std::string& extra = "") {
  return R"({
    "model": {"vocab_size": 256, "context_length": 16, "n_layer": 1, "n_head": 2, "d_model": 16},
    "data": )" + data + R"(,
    "train": {"micro_batch_size": 2, "global_batch_size": 4, "max_steps": 8, "eval_every": 4, "eval_batches": 2)" +
         extra + R"(},
    "optim": {"warmup_steps": 1, "schedule": "constant"}})";
}

}  // namespace

TEST_CASE("a mixture reports tokens per source, named sets their losses, in the log, metrics and TensorBoard",
          "[mixture][tensorboard]") {
  TempDir dir;
  make_sources(dir);
  const std::string a = dir.path() + "/a", b = dir.path() + "/b";
  const std::string config = dir.write("c.json", config_text(R"({
      "train": [{"path": ")" + a + R"(/train_*.bin", "weight": 0.75}, {"path": ")" + b + R"(/train_*.bin", "weight": 0.25, "name": "numbers"}],
      "val": {"words": ")" + a + R"(/val_*.bin", "numbers": ")" + b + R"(/val_*.bin"}})"));
  const std::string run = dir.path() + "/run";
  const auto trained = run_llmtrain({"train", "--config", config, "--run-dir", run});
  REQUIRE(trained.exit_code == 0);

  const test::Events events = test::read_events(run);
  int steps = 0, validations = 0;
  std::map<std::string, double> last_val;
  for (const auto& m : metrics(run)) {
    const auto step = m["step"].get<std::int64_t>();
    if (m.contains("loss")) {
      ++steps;
      // Weights 3:1 over 4 samples an update: every update takes 3 and 1 (every prefix is within
      // one sample of its share), 16 tokens each.
      CHECK(m["tokens_seen/0"] == 3 * step * 16);
      CHECK(m["tokens_seen/numbers"] == step * 16);
      CHECK(events.scalars.at("tokens_seen/0").at(step) == float(3 * step * 16));
      CHECK(events.scalars.at("tokens_seen/numbers").at(step) == float(step * 16));
    }
    if (m.contains("val_loss")) {
      ++validations;
      const double words = m["val_loss/words"], numbers = m["val_loss/numbers"];
      CHECK(std::abs(m["val_loss"].get<double>() - (words + numbers) / 2) < 1e-12);  // the mean of the sets'
      CHECK(words != numbers);
      for (const char* tag : {"val_loss", "val_loss/words", "val_loss/numbers"}) {
        CAPTURE(tag);
        CHECK(events.scalars.at(tag).at(step) == static_cast<float>(m[tag].get<double>()));
      }
      // The progress line: val_loss, then each set's, to four places.
      char line[256];
      std::snprintf(line, sizeof line, "step %lld/8 | val_loss %.4f | val_loss/numbers %.4f | val_loss/words %.4f",
                    static_cast<long long>(step), m["val_loss"].get<double>(), numbers, words);
      CHECK(trained.err.find(line) != std::string::npos);
      last_val = {{"words", words}, {"numbers", numbers}};
    }
  }
  CHECK(steps == 8);
  CHECK(validations == 2);
  // version; per step loss, lr, grad_norm, tokens_per_s, memory_gb and the 2 sources; 2 validations of 3
  CHECK(events.records == 1 + 8 * 7 + 2 * 3);

  // eval on the last checkpoint (step 8): the run's named sets by default, or --data NAME=PATH.
  char expected[128];
  std::snprintf(expected, sizeof expected, "val_loss/numbers %.4f | val_loss/words %.4f", last_val["numbers"],
                last_val["words"]);
  const auto by_default = run_llmtrain({"eval", "--checkpoint", run, "--batches", "2"});
  REQUIRE(by_default.exit_code == 0);
  CHECK(by_default.out.find(expected) != std::string::npos);
  const auto named = run_llmtrain({"eval", "--checkpoint", run, "--batches", "2", "--data",
                                   "words=" + a + "/val_*.bin", "--data", "numbers=" + b + "/val_*.bin"});
  REQUIRE(named.exit_code == 0);
  std::snprintf(expected, sizeof expected, "val_loss/words %.4f | val_loss/numbers %.4f", last_val["words"],
                last_val["numbers"]);
  CHECK(named.out.find(expected) != std::string::npos);  // in the order given
  const auto mixed = run_llmtrain({"eval", "--checkpoint", run, "--data", "words=" + a + "/val_*.bin", "--data",
                                   b + "/val_*.bin"});
  CHECK(mixed.exit_code == 2);
  CHECK(mixed.err.find("give every set a name (NAME=PATH) or none") != std::string::npos);
}

TEST_CASE("a one-source weighted list trains exactly as the plain list, and a mixture resumes exactly", "[mixture]") {
  TempDir dir;
  make_sources(dir);
  const std::string a = dir.path() + "/a", b = dir.path() + "/b";
  const auto losses = [](const std::string& run) {
    std::vector<double> out;
    for (const auto& m : metrics(run)) {
      if (m.contains("loss")) out.push_back(m["loss"].get<double>());
    }
    return out;
  };
  const std::string plain = dir.write("plain.json", config_text(R"({"train": ")" + a + R"(/train_*.bin"})"));
  const std::string one = dir.write("one.json", config_text(R"({"train": [{"path": ")" + a + R"(/train_*.bin", "weight": 0.3}]})"));
  REQUIRE(run_llmtrain({"train", "--config", plain, "--run-dir", dir.path() + "/plain"}).exit_code == 0);
  REQUIRE(run_llmtrain({"train", "--config", one, "--run-dir", dir.path() + "/one"}).exit_code == 0);
  CHECK(losses(dir.path() + "/plain").size() == 8);
  CHECK(losses(dir.path() + "/one") == losses(dir.path() + "/plain"));
  CHECK_FALSE(metrics(dir.path() + "/one").front().contains("tokens_seen/0"));  // one source: no mixture

  // A mixture: 8 updates at once, and 3 then resumed to 8 (the checkpoint at step 3 holds the
  // stream position alone).
  const std::string mix = dir.write("mix.json", config_text(R"({
      "train": [{"path": ")" + a + R"(/train_*.bin", "weight": 2}, {"path": ")" + b + R"(/train_*.bin", "weight": 1}]})"));
  REQUIRE(run_llmtrain({"train", "--config", mix, "--run-dir", dir.path() + "/whole"}).exit_code == 0);
  REQUIRE(run_llmtrain({"train", "--config", mix, "--run-dir", dir.path() + "/resumed", "--set", "train.max_steps=3"})
              .exit_code == 0);
  const auto resumed = run_llmtrain({"train", "--config", mix, "--run-dir", dir.path() + "/resumed"});
  REQUIRE(resumed.exit_code == 0);
  CHECK(resumed.err.find("resum") != std::string::npos);
  const auto whole = losses(dir.path() + "/whole");
  REQUIRE(whole.size() == 8);
  CHECK(losses(dir.path() + "/resumed") == whole);
  nlohmann::json last;
  for (const auto& m : metrics(dir.path() + "/resumed")) {
    if (m.contains("loss")) last = m;
  }
  CHECK(last["step"] == 8);
  // 2:1 over 32 samples: within one sample of 21.33 from the first source
  CHECK(last["tokens_seen/0"].get<std::int64_t>() + last["tokens_seen/1"].get<std::int64_t>() == 32 * 16);
  CHECK(std::abs(last["tokens_seen/0"].get<double>() / 16 - 32.0 * 2 / 3) < 1.0);
}

// The checkpoint records data.train's sources (weights and shard files): a resume on another
// mixture stops with one line naming what changed, unless data.resume_changed_mixture says to go on.
TEST_CASE("a mixture resumed with other weights or shards is refused, or continues when told to", "[mixture]") {
  TempDir dir;
  make_sources(dir);
  const std::string a = dir.path() + "/a", b = dir.path() + "/b";
  const auto mix = [&](const std::string& name, const char* wa, const char* wb) {
    return dir.write(name, config_text(R"({
      "train": [{"path": ")" + a + R"(/train_*.bin", "weight": )" + wa + R"(}, {"path": ")" + b +
                                       R"(/train_*.bin", "weight": )" + wb + R"(, "name": "numbers"}]})"));
  };
  const std::string run = dir.path() + "/run";
  const auto last_step = [&] {
    std::int64_t step = 0;
    for (const auto& m : metrics(run)) {
      if (m.contains("loss")) step = m["step"].get<std::int64_t>();
    }
    return step;
  };
  const auto errors = [](const std::string& err) {
    std::size_t n = 0;
    for (std::size_t at = err.find("error:"); at != std::string::npos; at = err.find("error:", at + 1)) ++n;
    return n;
  };
  REQUIRE(run_llmtrain({"train", "--config", mix("2_1.json", "2", "1"), "--run-dir", run, "--set", "train.max_steps=3"})
              .exit_code == 0);
  const std::string checkpoint = run + "/checkpoints/step_00000003";
  const nlohmann::json state = nlohmann::json::parse(std::ifstream(checkpoint + "/state.json"));
  REQUIRE(state.at("data").at("sources").size() == 2);
  CHECK(state["data"]["sources"][1]["weight"] == 1.0);
  CHECK(state["data"]["sources"][1]["shards"].size() == 1);

  // Other weights: refused, one line naming the source, both weights and the way on.
  const auto other = run_llmtrain({"train", "--config", mix("1_1.json", "1", "1"), "--run-dir", run});
  CHECK(other.exit_code == 2);
  CHECK(other.err.find("llmtrain: error: data.train[0]: weight 1 (a share of 0.5), the checkpoint's 2 (a share of "
                       "0.666667): the checkpoint " + checkpoint +
                       " was trained on another mixture; set data.resume_changed_mixture=true to continue with this "
                       "one from step 3") != std::string::npos);
  CHECK(errors(other.err) == 1);

  // A shard more under a glob: refused, naming it.
  const std::string extra = b + "/train_zz.bin";
  std::filesystem::copy_file(state["data"]["sources"][1]["shards"][0]["path"].get<std::string>(), extra);
  const auto more = run_llmtrain({"train", "--config", mix("2_1b.json", "2", "1"), "--run-dir", run});
  std::filesystem::remove(extra);
  CHECK(more.exit_code == 2);
  CHECK(more.err.find("llmtrain: error: data.train[1] (numbers) = [\"" + b + "/train_*.bin\"]: shard 1 is " + extra) !=
        std::string::npos);
  CHECK(more.err.find(", new (the checkpoint's 1 shards)") != std::string::npos);
  CHECK(errors(more.err) == 1);
  CHECK(last_step() == 3);  // neither trained

  // The same mixture (4:2 are the shares of 2:1): resumes as before, without a note.
  const auto same = run_llmtrain({"train", "--config", mix("4_2.json", "4", "2"), "--run-dir", run, "--set",
                                  "train.max_steps=5"});
  CHECK(same.exit_code == 0);
  CHECK(same.err.find("resum") != std::string::npos);
  CHECK(same.err.find("note:") == std::string::npos);
  CHECK(last_step() == 5);

  // Told to: continues with the new mixture from step 5, with a note.
  const auto told = run_llmtrain({"train", "--config", mix("1_1c.json", "1", "1"), "--run-dir", run, "--set",
                                  "data.resume_changed_mixture=true"});
  CHECK(told.exit_code == 0);
  CHECK(told.err.find("continuing with the new mixture from step 5 (data.resume_changed_mixture)") != std::string::npos);
  CHECK(last_step() == 8);
  const nlohmann::json after = nlohmann::json::parse(std::ifstream(run + "/checkpoints/step_00000008/state.json"));
  CHECK(after["data"]["sources"][0]["weight"] == 1.0);  // the new mixture, recorded
}
