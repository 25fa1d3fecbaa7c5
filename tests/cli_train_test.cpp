// llmtrain train beyond the basic run: the NaN guard, Llama with recomputation and export, CUDA and
// bf16 runs against the CPU's losses, the attention choice (flash or cuDNN) and --device auto.
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "catch_compat.h"
#include "cli_check.h"
#include "process.h"
#include "run_metrics.h"

using llmtrain::test::run_llmtrain;
using llmtrain::test::TempDir;
using llmtrain::test::training_losses;
using llmtrain::test::check_input_error;
using llmtrain::test::fox_shards;

namespace {

// A tiny bf16 Llama config (GQA, head size 64, which cuDNN's fused attention supports) on `shards`.
std::string cudnn_llama_config(const TempDir& dir, const std::string& shards, int max_steps, int warmup_steps) {
  return dir.write("c.json", R"({
    "model": {"arch": "llama", "vocab_size": 256, "context_length": 64, "n_layer": 2, "n_head": 2, "n_kv_head": 1,
              "d_model": 128},
    "data": {"train": ")" + shards + R"(/train_*.bin"},
    "train": {"micro_batch_size": 4, "global_batch_size": 8, "max_steps": )" + std::to_string(max_steps) +
                               R"(, "log_every": 1, "precision": "bf16"},
    "optim": {"lr": 0.003, "warmup_steps": )" + std::to_string(warmup_steps) + "}}");
}

// Why cuDNN's attention cannot be tested here, from the "attention: ..." line a bf16 run with
// model.attention "auto" logs on a GPU (empty when it chose cuDNN): cuDNN not built, older than the
// attention needs, without NVRTC or a device it runs on, or refusing the run's shape all make
// "auto" fall back to flash and say why.
std::string cudnn_unusable(const std::string& err) {
  const auto start = err.find("attention: ");
  if (start == std::string::npos) return "the run logged no attention line";
  const std::string line = err.substr(start, err.find('\n', start) - start);
  const std::string fallback = "attention: flash (bf16, but ";
  if (line.rfind(fallback, 0) != 0) return "";
  return "cuDNN's attention cannot run here: " + line.substr(fallback.size(), line.size() - fallback.size() - 1);
}

}  // namespace

TEST_CASE("NaN guard: non-finite updates are skipped, and too many in a row stop the run", "[cli][train]") {
  TempDir dir;
  std::string text;
  for (int i = 0; i < 300; ++i) text += "some text to train on " + std::to_string(i) + "\n";
  const std::string corpus = dir.write("corpus.txt", text);
  REQUIRE(run_llmtrain({"tokenize", "--input", corpus, "--output", dir.path() + "/shards"}).exit_code == 0);
  // A learning rate of 1e38 sends the weights to infinity after the first update.
  const std::string config = dir.write("c.json", R"({
    "model": {"vocab_size": 256, "context_length": 16, "n_layer": 1, "n_head": 2, "d_model": 16},
    "data": {"train": ")" + dir.path() + R"(/shards/train_*.bin"},
    "train": {"micro_batch_size": 2, "global_batch_size": 2, "max_steps": 50, "grad_clip": 0, "max_bad_steps": 3},
    "optim": {"lr": 1e38, "min_lr": 0, "warmup_steps": 0, "schedule": "constant", "weight_decay": 0}})");
  const auto r = run_llmtrain({"train", "--config", config, "--run-dir", dir.path() + "/run"});
  CAPTURE(r.err);
  CHECK(r.exit_code == 1);
  CHECK(r.err.find("update skipped (1 in a row)") != std::string::npos);
  CHECK(r.err.find("llmtrain: error: 3 updates in a row had a non-finite loss or gradient norm") != std::string::npos);
  std::ifstream metrics(dir.path() + "/run/metrics.jsonl");
  int skipped = 0;
  for (std::string line; std::getline(metrics, line);) skipped += nlohmann::json::parse(line).value("skipped", false);
  CHECK(skipped == 3);

  // The same guard in mixed precision.
  const auto bf16 = run_llmtrain({"train", "--config", config, "--run-dir", dir.path() + "/run2", "--set",
                                  "train.precision=bf16"});
  CAPTURE(bf16.err);
  CHECK(bf16.exit_code == 1);
  CHECK(bf16.err.find("llmtrain: error: 3 updates in a row had a non-finite loss or gradient norm") != std::string::npos);
}

TEST_CASE("Llama: train with recomputation, generate, export, and start a run from the export", "[cli][train][llama]") {
  TempDir dir;
  const std::string shards = fox_shards(dir);
  const auto write_config = [&](const std::string& name, const std::string& extra_model, int steps) {
    return dir.write(name, R"({
      "model": {"arch": "llama", "vocab_size": 256, "context_length": 16, "n_layer": 2, "n_head": 4, "n_kv_head": 2,
                "d_model": 16, "ffn_hidden": 40)" + extra_model + R"(},
      "data": {"train": ")" + shards + R"(/train_*.bin", "val": ")" + shards + R"(/val_*.bin"},
      "train": {"micro_batch_size": 2, "global_batch_size": 4, "max_steps": )" + std::to_string(steps) + R"(,
                "log_every": 1, "eval_every": 0, "recompute": "full"},
      "optim": {"lr": 0.02, "warmup_steps": 1},
      "checkpoint": {"every": 10}})");
  };
  const std::string run = dir.path() + "/run";
  const auto trained = run_llmtrain({"train", "--config", write_config("llama.json", "", 20), "--run-dir", run});
  CAPTURE(trained.err);
  REQUIRE(trained.exit_code == 0);
  const std::vector<double> losses = training_losses(run);
  REQUIRE(losses.size() == 20);
  CAPTURE(losses.front(), losses.back());
  CHECK(losses.back() < losses.front() - 1.0);  // it learns (from about ln 256 = 5.5)

  const std::vector<std::string> generate = {"generate", "--checkpoint", run, "--prompt", "the ", "--max-new-tokens",
                                             "12", "--seed", "5"};
  const auto first = run_llmtrain(generate);
  CAPTURE(first.err);
  REQUIRE(first.exit_code == 0);
  CHECK(first.out.size() == 4 + 12 + 1);
  CHECK(first.out == run_llmtrain(generate).out);

  const std::string hf = dir.path() + "/hf";
  const auto exported = run_llmtrain({"export", "--checkpoint", run, "--output", hf});
  CHECK(exported.exit_code == 0);
  CHECK(exported.out.find("(LlamaForCausalLM)") != std::string::npos);

  // A new run initialised from the export starts where the first one ended.
  const std::string second = dir.path() + "/second";
  const auto resumed = run_llmtrain(
      {"train", "--config", write_config("from-hf.json", R"(, "init_from": ")" + hf + R"(")", 1), "--run-dir", second});
  CAPTURE(resumed.err);
  REQUIRE(resumed.exit_code == 0);
  std::string first_line;
  std::getline(std::ifstream(second + "/metrics.jsonl") >> std::ws, first_line);
  CAPTURE(first_line);
  CHECK(nlohmann::json::parse(first_line)["loss"].get<double>() < losses.front() - 1.0);
}

TEST_CASE("train --device cuda follows the CPU run's losses", "[cli][train][cuda]") {
  TempDir dir;
  const std::string shards = fox_shards(dir);
  for (const std::string arch : {"gpt2", "llama"}) {
    const std::string config = dir.write(arch + ".json", R"({
      "model": {"arch": ")" + arch + R"(", "vocab_size": 256, "context_length": 32, "n_layer": 2, "n_head": 4,
                "d_model": 64},
      "data": {"train": ")" + shards + R"(/train_*.bin", "val": ")" + shards + R"(/val_*.bin"},
      "train": {"micro_batch_size": 4, "global_batch_size": 8, "max_steps": 8, "log_every": 1, "eval_every": 4},
      "optim": {"lr": 0.003, "warmup_steps": 2}})");
    const auto cpu = run_llmtrain({"train", "--config", config, "--run-dir", dir.path() + "/cpu-" + arch});
    REQUIRE(cpu.exit_code == 0);
    const auto gpu =
        run_llmtrain({"train", "--config", config, "--run-dir", dir.path() + "/gpu-" + arch, "--device", "cuda"});
    if (gpu.exit_code == 2 && gpu.err.find("no usable CUDA device") != std::string::npos) {
      LLMTRAIN_SKIP("no CUDA device: " + gpu.err);
    }
    CAPTURE(arch, gpu.err);
    REQUIRE(gpu.exit_code == 0);
    CHECK(gpu.err.find("attention: flash (fp32: ") != std::string::npos);  // "auto" in fp32
    std::ifstream a(dir.path() + "/cpu-" + arch + "/metrics.jsonl"), b(dir.path() + "/gpu-" + arch + "/metrics.jsonl");
    int lines = 0;
    for (std::string la, lb; std::getline(a, la) && std::getline(b, lb); ++lines) {
      const auto ma = nlohmann::json::parse(la), mb = nlohmann::json::parse(lb);
      const char* key = ma.contains("loss") ? "loss" : "val_loss";
      CAPTURE(la, lb);
      CHECK(std::abs(ma[key].get<double>() - mb[key].get<double>()) <= 1e-4 * ma[key].get<double>());
    }
    CHECK(lines == 10);  // 8 steps, 2 validations
  }
  // Determinism: no atomics in any reduction, so a second run gives the same weights bit for bit.
  const auto again = run_llmtrain({"train", "--config", dir.path() + "/llama.json", "--run-dir",
                                   dir.path() + "/gpu-llama-again", "--device", "cuda"});
  REQUIRE(again.exit_code == 0);
  const auto bytes = [](const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  const std::string last = "/checkpoints/step_00000008/model.safetensors";
  CHECK(bytes(dir.path() + "/gpu-llama" + last) == bytes(dir.path() + "/gpu-llama-again" + last));
}

TEST_CASE("bf16 on the GPU follows the CPU's bf16 emulation, with flash and cuDNN attention", "[cli][train][cuda][bf16]") {
  TempDir dir;
  const std::string shards = fox_shards(dir);
  const std::string config = cudnn_llama_config(dir, shards, 8, 2);
  const auto losses = [&](const std::string& name, const std::vector<std::string>& extra) -> std::vector<double> {
    std::vector<std::string> args = {"train", "--config", config, "--run-dir", dir.path() + "/" + name};
    args.insert(args.end(), extra.begin(), extra.end());
    const auto r = run_llmtrain(args);
    CAPTURE(name, r.err);
    REQUIRE(r.exit_code == 0);
    return training_losses(dir.path() + "/" + name);
  };
  const auto probe = run_llmtrain({"train", "--config", config, "--run-dir", dir.path() + "/probe", "--device", "cuda",
                                   "--set", "train.max_steps=1", "--set", "optim.warmup_steps=0"});
  if (probe.exit_code == 2 && probe.err.find("no usable CUDA device") != std::string::npos) {
    LLMTRAIN_SKIP("no CUDA device: " + probe.err);
  }
  CAPTURE(probe.err);
  REQUIRE(probe.exit_code == 0);
  const auto gpu = losses("gpu", {"--device", "cuda", "--set", "model.attention=flash"});
  const auto cpu = losses("cpu", {});
  REQUIRE(cpu.size() == 8);
  REQUIRE(gpu.size() == 8);
  bool flash_close = true;
  for (std::size_t i = 0; i < cpu.size(); ++i) {
    CAPTURE(i, cpu[i], gpu[i]);
    CHECK(std::abs(gpu[i] - cpu[i]) <= 1e-2 * cpu[i]);
    flash_close = flash_close && std::abs(gpu[i] - cpu[i]) <= 1e-2 * cpu[i];
  }
  REQUIRE(flash_close);  // (a skip below must not hide a failure above)
  // cuDNN's attention where it runs and accepts this shape ("auto" in the probe run said which).
  if (const std::string why = cudnn_unusable(probe.err); !why.empty()) LLMTRAIN_SKIP("the cudnn half: " + why);
  const auto cudnn = losses("cudnn", {"--device", "cuda", "--set", "model.attention=cudnn"});
  REQUIRE(cudnn.size() == 8);
  for (std::size_t i = 0; i < cpu.size(); ++i) {
    CAPTURE(i, cpu[i], cudnn[i]);
    CHECK(std::abs(cudnn[i] - cpu[i]) <= 1e-2 * cpu[i]);
  }
}

TEST_CASE("the cuDNN tests skip, with the reason, where cuDNN is absent, too old or refuses the shape", "[cli]") {
  // The attention lines "auto" logs on a GPU, faked: each fallback to flash names why.
  CHECK(cudnn_unusable("attention: flash (bf16, but this build has no cuDNN (LLMTRAIN_CUDNN off, or cudnn.h/libcudnn "
                       "not found))\n") ==
        "cuDNN's attention cannot run here: this build has no cuDNN (LLMTRAIN_CUDNN off, or cudnn.h/libcudnn not found)");
  CHECK(cudnn_unusable("dist: local\nattention: flash (bf16, but cuDNN 9.10.0 is older than 9.16.0)\nstep 1\n") ==
        "cuDNN's attention cannot run here: cuDNN 9.10.0 is older than 9.16.0");
  CHECK(cudnn_unusable("attention: flash (bf16, but cuDNN 9.19.0 refuses B=4 T=64 C=128 NH=2 NKV=1 (head size 64): no "
                       "cuDNN engine runs this graph)\n") ==
        "cuDNN's attention cannot run here: cuDNN 9.19.0 refuses B=4 T=64 C=128 NH=2 NKV=1 (head size 64): no cuDNN "
        "engine runs this graph");
  CHECK(cudnn_unusable("attention: cudnn (bf16, cuDNN 9.19.0 accepts B=4 T=64 C=128 NH=2 NKV=1 (head size 64))\n").empty());
  CHECK(cudnn_unusable("no attention line") == "the run logged no attention line");
}

TEST_CASE("auto attention picks cuDNN on a GPU in bf16 where cuDNN accepts the shape, and a refused cudnn stops at start-up",
          "[cli][train][cuda][bf16]") {
  TempDir dir;
  const std::string shards = fox_shards(dir);
  const std::string config = cudnn_llama_config(dir, shards, 2, 0);
  const auto run = run_llmtrain({"train", "--config", config, "--run-dir", dir.path() + "/auto", "--device", "cuda"});
  if (run.exit_code == 2 && run.err.find("no usable CUDA device") != std::string::npos) {
    LLMTRAIN_SKIP("no CUDA device: " + run.err);
  }
  CAPTURE(run.err);
  REQUIRE(run.exit_code == 0);
  // Where cuDNN cannot run (not built, older than 9.16, no NVRTC, a GPU before Ampere) or refuses
  // this GQA shape, auto says so and uses flash: skipped, with that reason.
  REQUIRE(run.err.find("attention: ") != std::string::npos);
  if (const std::string why = cudnn_unusable(run.err); !why.empty()) LLMTRAIN_SKIP(why);
  CHECK(run.err.find("attention: cudnn (bf16, cuDNN ") != std::string::npos);
  // Head size 12, not a multiple of 8: cuDNN refuses it, and an explicit "cudnn" is an input error
  // before the run folder is written.
  const auto refused = run_llmtrain({"train", "--config", config, "--run-dir", dir.path() + "/refused", "--device",
                                     "cuda", "--set", "model.attention=cudnn", "--set", "model.d_model=24"});
  check_input_error(refused, R"(model.attention: "cudnn": cuDNN )");
  CHECK(refused.err.find("refuses B=4 T=64 C=24 NH=2 NKV=1 (head size 12)") != std::string::npos);
  CHECK_FALSE(std::filesystem::exists(dir.path() + "/refused/config.json"));
}

TEST_CASE("bf16 mixed precision trains along the fp32 loss curve (CPU emulation)", "[cli][train][bf16]") {
  TempDir dir;
  const std::string shards = fox_shards(dir);
  const std::string config = dir.write("c.json", R"({
    "model": {"arch": "llama", "vocab_size": 256, "context_length": 16, "n_layer": 2, "n_head": 4, "n_kv_head": 2,
              "d_model": 32},
    "data": {"train": ")" + shards + R"(/train_*.bin"},
    "train": {"micro_batch_size": 4, "global_batch_size": 8, "max_steps": 12, "log_every": 1},
    "optim": {"lr": 0.01, "warmup_steps": 2}})");
  const auto losses = [&](const std::string& precision) {
    const std::string run = dir.path() + "/" + precision;
    const auto r = run_llmtrain({"train", "--config", config, "--run-dir", run, "--set", "train.precision=" + precision});
    CAPTURE(r.err);
    REQUIRE(r.exit_code == 0);
    return training_losses(run);
  };
  const auto f32 = losses("fp32"), bf16 = losses("bf16");
  REQUIRE(f32.size() == 12);
  REQUIRE(bf16.size() == 12);
  for (std::size_t i = 0; i < f32.size(); ++i) {
    CAPTURE(i, f32[i], bf16[i]);
    CHECK(std::abs(bf16[i] - f32[i]) <= 2e-2 * f32[i]);
  }
  CHECK(bf16.back() < bf16.front() - 0.5);  // and it learns
}

TEST_CASE("train --device auto on a machine with a GPU trains on it: the losses of --device cuda, bit for bit",
          "[cli][train][cuda]") {
  const auto info = run_llmtrain({"info"});
  REQUIRE(info.exit_code == 0);
  if (info.out.find("cuda:0") == std::string::npos) LLMTRAIN_SKIP("no CUDA device listed by llmtrain info");
  TempDir dir;
  const std::string shards = fox_shards(dir);
  const std::string config = dir.write("c.json", R"({
    "model": {"vocab_size": 256, "context_length": 16, "n_layer": 1, "n_head": 2, "d_model": 32},
    "data": {"train": ")" + shards + R"(/train_*.bin"},
    "train": {"micro_batch_size": 2, "global_batch_size": 2, "max_steps": 3, "log_every": 1},
    "optim": {"warmup_steps": 0}})");
  const auto picked = run_llmtrain({"train", "--config", config, "--run-dir", dir.path() + "/auto", "--device", "auto"});
  const auto cuda = run_llmtrain({"train", "--config", config, "--run-dir", dir.path() + "/cuda", "--device", "cuda"});
  CAPTURE(picked.err);
  REQUIRE(picked.exit_code == 0);
  REQUIRE(cuda.exit_code == 0);
  CHECK(picked.err.find("train: device auto: cuda (this build has CUDA and ") != std::string::npos);
  const std::vector<double> losses = training_losses(dir.path() + "/auto");
  REQUIRE(losses.size() == 3);
  CHECK(losses == training_losses(dir.path() + "/cuda"));  // the same device, the same kernels: the same bits
}

TEST_CASE("train --device auto picks CUDA where info lists a device, else the CPU, and says why", "[cli][train]") {
  const auto info = run_llmtrain({"info"});
  REQUIRE(info.exit_code == 0);
  const bool gpu_visible = info.out.find("cuda:0") != std::string::npos;  // info lists each device it sees
  TempDir dir;
  const std::string shards = fox_shards(dir);
  const std::string config = dir.write("c.json", R"({
    "model": {"vocab_size": 256, "context_length": 16, "n_layer": 1, "n_head": 2, "d_model": 16},
    "data": {"train": ")" + shards + R"(/train_*.bin"},
    "train": {"micro_batch_size": 2, "global_batch_size": 2, "max_steps": 2, "log_every": 1},
    "optim": {"warmup_steps": 0}})");
  const auto r = run_llmtrain({"train", "--config", config, "--run-dir", dir.path() + "/run", "--device", "auto"});
  CAPTURE(r.err);
  REQUIRE(r.exit_code == 0);
  if (gpu_visible) {
    CHECK(r.err.find("train: device auto: cuda (this build has CUDA and ") != std::string::npos);
  } else {
    CHECK(r.err.find("train: device auto: cpu (no CUDA device: ") != std::string::npos);
    // A CPU-only build names that as the reason.
    if (info.out.find("not built (CPU-only build)") != std::string::npos) {
      CHECK(r.err.find("device auto: cpu (no CUDA device: built without CUDA)") != std::string::npos);
    }
  }
  // An explicit device is not "auto": no such line.
  const auto cpu = run_llmtrain({"train", "--config", config, "--run-dir", dir.path() + "/run-cpu", "--device", "cpu"});
  CHECK(cpu.exit_code == 0);
  CHECK(cpu.err.find("device auto") == std::string::npos);
  // --help says what auto means.
  CHECK(run_llmtrain({"train", "--help"}).out.find("auto: cuda when this build has CUDA and every rank of a node") !=
        std::string::npos);
}
