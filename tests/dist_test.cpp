// Data and tensor parallelism under mpirun: world sizes 1, 2 and 4, ZeRO stages 0, 1, 2 and 3 and
// tensor-parallel sizes 1, 2 and 4 train the same model to the same losses and weights.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <utility>

#include <nlohmann/json.hpp>

#include "catch_compat.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/safetensors.h"
#include "process.h"
#include "weights_compare.h"

using llmtrain::test::run_llmtrain;
using llmtrain::test::TempDir;

namespace {

std::vector<double> losses(const std::string& run) {
  std::vector<double> out;
  std::ifstream in(run + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    const auto m = nlohmann::json::parse(line);
    if (m.contains("checkpoint")) continue;  // a save's size and timings
    out.push_back(m.contains("loss") ? m["loss"].get<double>() : m["val_loss"].get<double>());
  }
  return out;
}

// Runs `llmtrain ARGS` under mpirun with `ranks` processes, one thread each.
int mpirun(int ranks, const std::string& args, const std::string& log) {
  const std::string command = "OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 " LLMTRAIN_MPIEXEC
                              " --allow-run-as-root --oversubscribe -np " + std::to_string(ranks) + " " +
                              LLMTRAIN_BINARY " " + args + " >" + log + " 2>&1";
  const int status = std::system(command.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
}

// One layout of the ranks: world size, tensor-parallel size (the data-parallel size is the
// quotient) and ZeRO stage.
struct Layout {
  int ranks, tensor, zero;
  bool sequence_parallel = false;
  int pipeline = 1;
  int virtual_stages = 1;  // more: the interleaved schedule
};

// Trains the model of `model_json` (a "model" section) on one rank, then in each of `layouts`,
// and checks that every run logs the same losses and ends with the same weights.
// `lr` and `steps`: tensor parallelism sums partial results in another order than one rank does,
// and AdamW magnifies last-bit differences of the gradients where they are near zero; this tiny
// model at a high learning rate carries them past 1e-5 within 20 updates. The tensor-parallel
// layouts train 10 updates at 0.003, as the issue's criterion has it.
void check_layout_invariance(const std::string& model_json, const std::vector<Layout>& layouts, std::int64_t d_model,
                             double lr = 0.01, int steps = 20) {
  TempDir dir;
  std::string text;
  for (int i = 0; i < 3000; ++i) text += "alpha beta gamma delta "[i % 24];
  for (int i = 0; i < 3000; ++i) text += std::to_string(i * 7919 % 1000) + " ";
  const std::string corpus = dir.write("corpus.txt", text);
  REQUIRE(run_llmtrain({"tokenize", "--input", corpus, "--output", dir.path() + "/shards"}).exit_code == 0);
  // 20 updates of 8 sequences: 4 micro-steps of 2 at world size 1, 2 at 2, 1 at 4. Small
  // buckets, so that the gradient all-reduce runs in many pieces.
  const std::string config = dir.write("c.json", R"({
    "model": )" + model_json + R"(,
    "data": {"train": ")" + dir.path() + R"(/shards/train_*.bin", "val": ")" + dir.path() + R"(/shards/val_*.bin"},
    "train": {"micro_batch_size": 2, "global_batch_size": 8, "max_steps": )" + std::to_string(steps) +
                                                  R"(, "eval_every": )" + std::to_string(steps / 2) + R"(, "eval_batches": 2},
    "optim": {"lr": )" + std::to_string(lr) + R"(, "warmup_steps": 2},
    "dist": {"bucket_mb": 0.01, "replica_check_every": 5},
    "checkpoint": {"every": )" + std::to_string(steps / 2) + R"(}})");
  char last[32];
  std::snprintf(last, sizeof last, "/checkpoints/step_%08d", steps);

  const std::string reference = dir.path() + "/w1";
  REQUIRE(run_llmtrain({"train", "--config", config, "--run-dir", reference}).exit_code == 0);
  const auto reference_losses = losses(reference);
  REQUIRE(reference_losses.size() == std::size_t(steps + 2));  // the steps, 2 validations
  // The whole model as the checkpoint holds it, whichever ranks wrote which ranges.
  const auto reference_weights = llmtrain::checkpoint::load_model(llmtrain::checkpoint::find(reference + last));
  const auto tensor_values = [](const llmtrain::model::Model& m, const llmtrain::model::ParamInfo& info) {
    const float* p = m.param(info).as<float>();
    return std::vector<float>(p, p + info.numel);
  };

  for (const auto [ranks, tensor, zero, sequence_parallel, pipeline, virtual_stages] : layouts) {
    {
      CAPTURE(ranks, tensor, zero, sequence_parallel, pipeline, virtual_stages);
      const std::string run = dir.path() + "/w" + std::to_string(ranks) + "t" + std::to_string(tensor) + "p" +
                              std::to_string(pipeline) + "v" + std::to_string(virtual_stages) + "z" +
                              std::to_string(zero) + (sequence_parallel ? "sp" : "");
      const std::string schedule = virtual_stages > 1 ? " --set dist.pipeline_schedule=interleaved --set "
                                                        "dist.virtual_stages=" + std::to_string(virtual_stages)
                                                      : "";
      const int status = mpirun(ranks, "train --config " + config + " --run-dir " + run + " --set dist.zero_stage=" +
                                           std::to_string(zero) + " --set dist.tensor_parallel=" + std::to_string(tensor) +
                                           " --set dist.pipeline_parallel=" + std::to_string(pipeline) +
                                           " --set dist.sequence_parallel=" + (sequence_parallel ? "true" : "false") +
                                           schedule,
                                run + ".log");
      if (status != 0) {
        std::ifstream log(run + ".log");
        FAIL("mpirun exit " << status << ": " << std::string(std::istreambuf_iterator<char>(log), {}));
      }
      const auto got = losses(run);
      REQUIRE(got.size() == reference_losses.size());
      for (std::size_t i = 0; i < got.size(); ++i) {
        REQUIRE(std::abs(got[i] - reference_losses[i]) <= 1e-5 * std::abs(reference_losses[i]));
      }
      const std::string step_dir = run + last;
      const auto weights = llmtrain::checkpoint::load_model(llmtrain::checkpoint::find(step_dir));
      double whole[2] = {0.0, 0.0};  // the whole model's squared error and squared norm
      for (const auto& t : reference_weights->param_infos()) {
        const std::vector<float> a = tensor_values(*reference_weights, t), b = tensor_values(*weights, t);
        bool key_bias_ok = false;
        const double error =
            llmtrain::test::weights_relative_error(t.name, b, a, d_model, steps * lr, &key_bias_ok, &whole);
        CAPTURE(t.name, error);
        // Tensor parallelism's partial sums differ from one rank's in the last bits, which AdamW
        // magnifies where a gradient is near zero (elements of ~1e-5 relative in a few tensors
        // of these tiny models); without it the forward is the same arithmetic.
        CHECK(error <= (tensor > 1 ? 1e-4 : 1e-5));
        CHECK(key_bias_ok);
      }
      // The issue's criterion, the final weights within 1e-5 relative, over the whole model in
      // every layout (each tensor above, at 1e-4 with tensor parallelism).
      const double whole_error = std::sqrt(whole[0] / whole[1]);
      CAPTURE(whole_error);
      CHECK(whole_error <= 1e-5);
      // ZeRO: one optimizer file per rank; without it, the ranks of the first data-parallel
      // replica write theirs (rank 0 the whole state without tensor parallelism).
      CHECK(std::filesystem::exists(step_dir + "/optim-00000.safetensors"));
      const bool sharded = zero == 3 || (zero > 0 && ranks > tensor * pipeline);
      const int optimizer_files = sharded ? ranks : tensor * pipeline;
      CHECK(std::filesystem::exists(step_dir + "/optim-00001.safetensors") == (optimizer_files > 1));
      const auto state = nlohmann::json::parse(std::ifstream(step_dir + "/state.json"));
      CHECK(state["world_size"] == ranks);
      // The weights beside them: each writing rank its ranges (model-RANK), no rank the whole
      // model, except where one rank holds all of the state (model.safetensors).
      CHECK(state["files"].size() == std::size_t(2 * optimizer_files));
      CHECK(std::filesystem::exists(step_dir + "/model.safetensors") == (optimizer_files == 1));
      CHECK(std::filesystem::exists(step_dir + "/model-00001.safetensors") == (optimizer_files > 1));
    }
  }
}

}  // namespace

// Data parallelism: world sizes 2 and 4 with each ZeRO stage, and ZeRO 3 on one rank (its layers
// streamed through the slots).
const std::vector<Layout> data_parallel = {{1, 1, 3}, {2, 1, 0}, {2, 1, 1}, {2, 1, 2}, {2, 1, 3},
                                           {4, 1, 0}, {4, 1, 1}, {4, 1, 2}, {4, 1, 3}};
// Tensor parallelism 2, alone and with data parallelism 2 (ZeRO 0, 1 and 3 over the data group),
// without and with sequence parallelism.
const std::vector<Layout> tensor_parallel = {{2, 2, 0},       {2, 2, 3},       {4, 2, 0},       {4, 2, 1},
                                             {4, 2, 3},       {2, 2, 0, true}, {4, 2, 1, true}, {4, 2, 3, true}};

TEST_CASE("world sizes 1, 2, 4 and ZeRO 0, 1, 2, 3 give the same losses and weights", "[dist][mpi]") {
  check_layout_invariance(R"({"vocab_size": 256, "context_length": 16, "n_layer": 2, "n_head": 2, "d_model": 16})",
                          data_parallel, 16);
}

TEST_CASE("Llama: world sizes 1, 2, 4 and ZeRO 0, 1, 2, 3 give the same losses and weights", "[dist][mpi][llama]") {
  check_layout_invariance(R"({"arch": "llama", "vocab_size": 256, "context_length": 16, "n_layer": 2,
                              "n_head": 4, "n_kv_head": 2, "d_model": 16, "ffn_hidden": 40})",
                          data_parallel, 16);
}

// An odd vocabulary (251): the ranks' rows of the embedding and head differ in number.
TEST_CASE("tensor parallelism 2 and 4, alone, with data parallelism and ZeRO, and with sequence parallelism, gives "
          "the same losses and weights",
          "[dist][mpi][tensor]") {
  auto layouts = tensor_parallel;
  layouts.push_back({4, 4, 0});
  layouts.push_back({4, 4, 3});
  layouts.push_back({4, 4, 0, true});
  check_layout_invariance(R"({"vocab_size": 251, "context_length": 16, "n_layer": 2, "n_head": 4, "d_model": 32})",
                          layouts, 32);
}

// At tensor parallel 4 each of the 2 key/value heads is replicated on the 2 ranks whose query heads use it.
TEST_CASE("Llama (GQA, untied head): tensor parallelism 2 and 4, alone, with data parallelism and ZeRO, and with "
          "sequence parallelism, same losses and weights", "[dist][mpi][tensor][llama]") {
  auto layouts = tensor_parallel;
  layouts.push_back({4, 4, 0});
  layouts.push_back({4, 4, 3});
  layouts.push_back({4, 4, 0, true});
  check_layout_invariance(R"({"arch": "llama", "vocab_size": 251, "context_length": 16, "n_layer": 2,
                              "n_head": 4, "n_kv_head": 2, "d_model": 32, "ffn_hidden": 40})",
                          layouts, 32, 0.003, 10);
}

// Pipelines of 2 and 4 stages (1F1B), with data parallelism 2 (ZeRO 0 and 1), with tensor
// parallelism 2 (and sequence parallelism), and the whole 3-D mesh, 2 x 2 x 2, on 8 ranks; the
// interleaved schedule (2 stages of 2 chunks: one layer each) alone, with data parallelism 2 (2
// micro-batches per update) and with tensor parallelism 2.
const std::vector<Layout> pipeline_parallel = {
    {2, 1, 0, false, 2},    {4, 1, 0, false, 4},    {4, 1, 1, false, 2},   {4, 2, 0, false, 2}, {4, 2, 0, true, 2},
    {8, 2, 1, false, 2},    {2, 1, 0, false, 2, 2}, {4, 1, 1, false, 2, 2}, {4, 2, 0, false, 2, 2}};

TEST_CASE("pipelines of 2 and 4 stages, 1F1B and interleaved, with data and tensor parallelism, give the same losses "
          "and weights",
          "[dist][mpi][pipeline]") {
  check_layout_invariance(R"({"vocab_size": 251, "context_length": 16, "n_layer": 4, "n_head": 4, "d_model": 32})",
                          pipeline_parallel, 32, 0.003, 10);
}

TEST_CASE("Llama (GQA, untied head) in pipelines of 2 and 4 stages, 1F1B and interleaved, with data and tensor "
          "parallelism, same losses and weights", "[dist][mpi][pipeline][llama]") {
  check_layout_invariance(R"({"arch": "llama", "vocab_size": 251, "context_length": 16, "n_layer": 4,
                              "n_head": 4, "n_kv_head": 2, "d_model": 32, "ffn_hidden": 40})",
                          pipeline_parallel, 32, 0.003, 10);
}

namespace {

// The "loss", "grad_norm" and "val_loss" values of a run's metrics.jsonl as written, and each
// update's "collectives" and "tensor_collectives" (calls and bytes per kind), as text: compared
// bit for bit.
std::vector<std::string> logged(const std::string& run) {
  std::vector<std::string> out;
  std::ifstream in(run + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    for (const std::string key : {"\"loss\":", "\"val_loss\":", "\"grad_norm\":"}) {
      const auto at = line.find(key);
      if (at != std::string::npos) out.push_back(key + line.substr(at + key.size(), line.find_first_of(",}", at) - at - key.size()));
    }
    const auto m = nlohmann::json::parse(line);
    for (const std::string key : {"collectives", "tensor_collectives"}) {
      if (m.contains(key)) out.push_back(m[key].dump());
    }
  }
  return out;
}

}  // namespace

// Every collective and transfer in pieces of at most 100 elements (LLMTRAIN_COMM_MAX_ELEMENTS:
// what a count beyond 2^31 elements takes, made small enough for these models' layers, buckets
// and activations) against the same runs in whole calls: the same losses and validation losses
// bit for bit, and the same collectives counted (one each, bytes once).
TEST_CASE("collectives in pieces give losses identical bit for bit: ZeRO 3 and tensor parallelism at world sizes 2 and 4",
          "[dist][mpi][pieces]") {
  TempDir dir;
  std::string text;
  for (int i = 0; i < 3000; ++i) text += std::to_string(i * 7919 % 1000) + " ";
  const std::string corpus = dir.write("corpus.txt", text);
  REQUIRE(run_llmtrain({"tokenize", "--input", corpus, "--output", dir.path() + "/shards"}).exit_code == 0);
  const std::string config = dir.write("c.json", R"({
    "model": {"vocab_size": 251, "context_length": 16, "n_layer": 2, "n_head": 4, "d_model": 32},
    "data": {"train": ")" + dir.path() + R"(/shards/train_*.bin", "val": ")" + dir.path() + R"(/shards/val_*.bin"},
    "train": {"micro_batch_size": 2, "global_batch_size": 8, "max_steps": 6, "eval_every": 3, "eval_batches": 2},
    "optim": {"lr": 0.003, "warmup_steps": 2},
    "dist": {"bucket_mb": 0.01},
    "checkpoint": {"every": 0}})");
  const std::vector<Layout> layouts = {{2, 1, 3}, {4, 1, 3}, {2, 2, 0}, {4, 2, 3}, {4, 2, 3, true}, {4, 4, 0}};
  for (const auto [ranks, tensor, zero, sequence_parallel, pipeline, virtual_stages] : layouts) {
    CAPTURE(ranks, tensor, zero, sequence_parallel);
    const std::string args = "train --config " + config + " --set dist.zero_stage=" + std::to_string(zero) +
                             " --set dist.tensor_parallel=" + std::to_string(tensor) +
                             " --set dist.sequence_parallel=" + (sequence_parallel ? "true" : "false");
    const std::string run = dir.path() + "/w" + std::to_string(ranks) + "t" + std::to_string(tensor) + "z" +
                            std::to_string(zero) + (sequence_parallel ? "sp" : "");
    std::vector<std::string> got[2];
    for (const int forced : {0, 1}) {
      const std::string run_dir = run + (forced ? "-pieces" : "-whole");
      setenv("LLMTRAIN_COMM_MAX_ELEMENTS", "100", 1);
      if (!forced) unsetenv("LLMTRAIN_COMM_MAX_ELEMENTS");
      const int status = mpirun(ranks, args + " --run-dir " + run_dir, run_dir + ".log");
      unsetenv("LLMTRAIN_COMM_MAX_ELEMENTS");
      if (status != 0) {
        std::ifstream log(run_dir + ".log");
        FAIL("mpirun exit " << status << ": " << std::string(std::istreambuf_iterator<char>(log), {}));
      }
      got[forced] = logged(run_dir);
      // Each update's host wait for the data- and tensor-parallel groups: some, and no more than
      // the time since the start (elapsed_s).
      std::ifstream metrics(run_dir + "/metrics.jsonl");
      int updates = 0;
      for (std::string line; std::getline(metrics, line);) {
        const auto m = nlohmann::json::parse(line);
        if (!m.contains("loss")) continue;
        ++updates;
        REQUIRE(m.contains("comm_wait_s"));
        CHECK(m["comm_wait_s"].get<double>() > 0.0);
        CHECK(m["comm_wait_s"].get<double>() <= m["elapsed_s"].get<double>());
      }
      CHECK(updates == 6);
    }
    REQUIRE(got[0].size() == 6 * 4 + 2);  // 6 updates' loss, norm and both collectives; 2 validations
    CHECK(got[1] == got[0]);
  }
}

TEST_CASE("a weighted mixture with named validation sets trains alike at world sizes 1, 2 and 4, and resumes across them",
          "[dist][mpi][mixture]") {
  TempDir dir;
  std::string a, b;
  for (int i = 0; i < 2000; ++i) a += "alpha beta gamma delta "[i % 24];
  for (int i = 0; i < 1500; ++i) b += std::to_string(i * 7919 % 1000) + " ";
  for (const auto& [name, text] : {std::pair{"a", a}, std::pair{"b", b}}) {
    const std::string corpus = dir.write(std::string(name) + ".txt", text);
    REQUIRE(run_llmtrain({"tokenize", "--input", corpus, "--output", dir.path() + "/" + name}).exit_code == 0);
  }
  const std::string config = dir.write("c.json", R"({
    "model": {"vocab_size": 256, "context_length": 16, "n_layer": 1, "n_head": 2, "d_model": 16},
    "data": {"train": [{"path": ")" + dir.path() + R"(/a/train_*.bin", "weight": 0.7},
                       {"path": ")" + dir.path() + R"(/b/train_*.bin", "weight": 0.3, "name": "numbers"}],
             "val": {"words": ")" + dir.path() + R"(/a/val_*.bin", "numbers": ")" + dir.path() + R"(/b/val_*.bin"}},
    "train": {"micro_batch_size": 2, "global_batch_size": 8, "max_steps": 10, "eval_every": 5, "eval_batches": 1},
    "optim": {"lr": 0.01, "warmup_steps": 2, "schedule": "constant"},
    "checkpoint": {"every": 5}})");
  // Every figure of the metrics lines that must not depend on the ranks.
  const auto figures = [](const std::string& run) {
    std::vector<std::pair<std::string, double>> out;
    std::ifstream in(run + "/metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
      const auto m = nlohmann::json::parse(line);
      for (const char* key : {"loss", "val_loss", "val_loss/words", "val_loss/numbers", "tokens_seen/0", "tokens_seen/numbers"}) {
        if (m.contains(key)) out.emplace_back(key + std::string("@") + std::to_string(m["step"].get<int>()), m[key].get<double>());
      }
    }
    return out;
  };
  const std::string reference = dir.path() + "/w1";
  REQUIRE(run_llmtrain({"train", "--config", config, "--run-dir", reference}).exit_code == 0);
  const auto expected = figures(reference);
  REQUIRE(expected.size() == 10 * 3 + 2 * 3);
  const auto same = [&](const std::string& run) {
    const auto got = figures(run);
    REQUIRE(got.size() == expected.size());
    for (std::size_t i = 0; i < got.size(); ++i) {
      CAPTURE(got[i].first);
      REQUIRE(got[i].first == expected[i].first);
      CHECK(std::abs(got[i].second - expected[i].second) <= 1e-5 * std::abs(expected[i].second));
    }
  };
  for (const int ranks : {2, 4}) {
    CAPTURE(ranks);
    const std::string run = dir.path() + "/w" + std::to_string(ranks);
    REQUIRE(mpirun(ranks, "train --config " + config + " --run-dir " + run, run + ".log") == 0);
    same(run);
  }
  // Stopped after step 5 at world size 1, resumed at world size 2.
  const std::string resumed = dir.path() + "/resumed";
  REQUIRE(run_llmtrain({"train", "--config", config, "--run-dir", resumed, "--set", "train.max_steps=5"}).exit_code == 0);
  REQUIRE(mpirun(2, "train --config " + config + " --run-dir " + resumed, resumed + ".log") == 0);
  same(resumed);
}
