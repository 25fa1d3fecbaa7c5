// The llmtrain binary as users call it: exit codes, one-line errors, --help, info, check-config,
// tokenize, and train, eval, generate, export and inspect end to end on a tiny run.
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "catch_compat.h"
#include "cli_check.h"
#include "process.h"

using llmtrain::test::run_llmtrain;
using llmtrain::test::TempDir;
using llmtrain::test::check_input_error;
using llmtrain::test::fox_shards;

TEST_CASE("--help and --version work for the program and every subcommand", "[cli]") {
  const auto version = run_llmtrain({"--version"});
  CHECK(version.exit_code == 0);
  CHECK(version.out.rfind("llmtrain 0.", 0) == 0);
  for (const std::string sub : {"info", "check-config", "tokenize", "train", "eval", "generate", "export", "plan", "inspect"}) {
    CAPTURE(sub);
    const auto help = run_llmtrain({sub, "--help"});
    CHECK(help.exit_code == 0);
    CHECK(help.out.find("Usage:") != std::string::npos);
  }
  const auto top = run_llmtrain({"--help"});
  CHECK(top.exit_code == 0);
  CHECK(top.out.find("check-config") != std::string::npos);
}

TEST_CASE("bad command lines exit 2 with one error line", "[cli]") {
  check_input_error(run_llmtrain({}), "subcommand");
  check_input_error(run_llmtrain({"chek-config"}), "unknown subcommand 'chek-config'; did you mean 'check-config'?");
  check_input_error(run_llmtrain({"check-config"}), "--config");
  check_input_error(run_llmtrain({"info", "--bogus"}), "--bogus");
}

TEST_CASE("check-config prints the resolved config", "[cli]") {
  TempDir dir;
  const std::string path = dir.write("c.json", R"({"model": {"n_layer": 3}})");
  const auto r = run_llmtrain({"check-config", "--config", path, "--set", "optim.lr=0.001", "--set", "model.n_head=4"});
  CAPTURE(r.err);
  REQUIRE(r.exit_code == 0);
  const auto resolved = nlohmann::json::parse(r.out);
  CHECK(resolved["model"]["n_layer"] == 3);
  CHECK(resolved["model"]["n_head"] == 4);
  CHECK(resolved["model"]["n_kv_head"] == 4);
  CHECK(resolved["optim"]["lr"] == 0.001);
  CHECK(resolved["model"]["attention"] == "auto");  // the default; train resolves it at start-up
  const auto flash = run_llmtrain({"check-config", "--config", path, "--set", "model.attention=flash"});
  REQUIRE(flash.exit_code == 0);
  CHECK(nlohmann::json::parse(flash.out)["model"]["attention"] == "flash");
}

TEST_CASE("check-config rejects bad configs with exit 2 naming the file and key", "[cli]") {
  TempDir dir;
  check_input_error(run_llmtrain({"check-config", "--config", dir.path() + "/missing.json"}),
                    "missing.json: cannot open (expected a JSON config file)");
  const std::string bad = dir.write("bad.json", R"({"optim": {"lr": -1}})");
  check_input_error(run_llmtrain({"check-config", "--config", bad}),
                    "optim.lr: expected a number > 0, got -1 (in " + bad + ")");
  const std::string broken = dir.write("broken.json", "{\n  \"model\": {\"n_layer\": 2,}\n}\n");
  check_input_error(run_llmtrain({"check-config", "--config", broken}), "broken.json:2:26: malformed JSON");
  const std::string good = dir.write("good.json", "{}");
  check_input_error(run_llmtrain({"check-config", "--config", good, "--set", "train.micro_batchsize=2"}),
                    "train.micro_batchsize: unknown key; did you mean 'train.micro_batch_size'? "
                    "(from --set train.micro_batchsize=2)");
}

TEST_CASE("info reports the build and the devices, or why there are none", "[cli]") {
  const auto r = run_llmtrain({"info"});
  CAPTURE(r.out, r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(r.out.find("llmtrain 0.") == 0);
  CHECK(r.out.find("blas") != std::string::npos);
  CHECK(r.out.find("mpi") != std::string::npos);
  CHECK(r.out.find("cpu threads") != std::string::npos);
  const bool cuda_build = r.out.find("cublaslt") != std::string::npos;
  if (cuda_build) {
    CHECK(r.out.find("nccl") != std::string::npos);
    // Either devices are listed or the reason for none is given.
    CHECK((r.out.find("cuda:0") != std::string::npos || r.out.find("no CUDA device: ") != std::string::npos));
  } else {
    CHECK(r.out.find("not built (CPU-only build)") != std::string::npos);
  }
}

TEST_CASE("tokenize writes shards, and bad input exits 2 without touching existing shards", "[cli]") {
  TempDir dir;
  const std::string text = dir.write("a.txt", "hello world\n");
  const std::string out = dir.path() + "/out";
  const auto ok = run_llmtrain({"tokenize", "--input", text, "--output", out, "--val-fraction", "0"});
  CAPTURE(ok.err);
  REQUIRE(ok.exit_code == 0);
  CHECK(ok.out.find("12 train + 0 val tokens (vocab 256)") != std::string::npos);

  check_input_error(run_llmtrain({"tokenize", "--input", dir.path() + "/nope.txt", "--output", out}), "nope.txt");
  check_input_error(run_llmtrain({"tokenize", "--input", text, "--output", out}),
                    out + ": already holds shards (train_000000.bin); use --force to replace them");
  check_input_error(run_llmtrain({"tokenize", "--input", text, "--output", out, "--tokenizer", "bpe:12", "--force"}),
                    "--tokenizer bpe:12: expected bpe:VOCAB_SIZE with VOCAB_SIZE >= 257");
  check_input_error(run_llmtrain({"tokenize", "--input", text, "--output", out, "--val-fraction", "1.5", "--force"}),
                    "--val-fraction: expected a number in [0, 1)");
  // The shards of the first run are still there and whole: 1024 header bytes + 12 uint16 tokens.
  CHECK(std::filesystem::file_size(out + "/train_000000.bin") == 1024 + 2 * 12);
}

TEST_CASE("train, eval, generate and export work end to end on a tiny run", "[cli][train]") {
  TempDir dir;
  const std::string shards = fox_shards(dir);
  const std::string config = dir.write("tiny.json", R"({
    "model": {"vocab_size": 256, "context_length": 16, "n_layer": 1, "n_head": 2, "d_model": 16},
    "data": {"train": ")" + shards + R"(/train_*.bin", "val": ")" + shards + R"(/val_*.bin"},
    "train": {"micro_batch_size": 2, "global_batch_size": 4, "max_steps": 6, "log_every": 2, "eval_every": 3,
              "eval_batches": 2},
    "optim": {"lr": 0.01, "warmup_steps": 1},
    "checkpoint": {"every": 2, "keep_last": 2}})");
  const std::string run = dir.path() + "/run";

  const auto trained = run_llmtrain({"train", "--config", config, "--run-dir", run});
  CAPTURE(trained.err);
  REQUIRE(trained.exit_code == 0);
  CHECK(trained.err.find("step 6/6 | loss") != std::string::npos);
  // model.attention "auto" (the default) is resolved at start-up and said once.
  CHECK(trained.err.find("attention: flash (CPU: ") != std::string::npos);
  CHECK(nlohmann::json::parse(std::ifstream(run + "/config.json"))["model"]["attention"] == "auto");
  // metrics.jsonl: one line per step, plus the validation lines at steps 3 and 6.
  std::ifstream metrics(run + "/metrics.jsonl");
  int steps = 0, evals = 0, saves = 0;
  for (std::string line; std::getline(metrics, line);) {
    const auto m = nlohmann::json::parse(line);
    if (m.contains("checkpoint")) {
      CHECK(m["step"] == 2 * ++saves);
      CHECK(m["checkpoint_bytes"].get<std::int64_t>() > 0);
      CHECK(m["checkpoint_write_s"].get<double>() > 0);
      CHECK(m["checkpoint_stall_s"].get<double>() >= 0);
    } else if (m.contains("val_loss")) {
      ++evals;
    } else {
      CHECK(m["step"] == ++steps);
      CHECK(m["loss"].get<double>() > 0);
      CHECK(m.contains("lr"));
      CHECK(m.contains("grad_norm"));
      CHECK(m.contains("tokens_per_s"));
    }
  }
  CHECK(steps == 6);
  CHECK(evals == 2);
  CHECK(saves == 3);  // checkpoint.every 2: each save's size, write time and stall
  CHECK(nlohmann::json::parse(std::ifstream(run + "/config.json"))["train"]["max_steps"] == 6);
  // Checkpoints at 2, 4 and 6; keep_last 2 leaves 4 and 6.
  CHECK(!std::filesystem::exists(run + "/checkpoints/step_00000002"));
  CHECK(!std::filesystem::exists(run + "/checkpoints/.pruned-step_00000002"));  // deleted before the end
  CHECK(std::filesystem::exists(run + "/checkpoints/step_00000004/COMPLETE"));
  CHECK(std::filesystem::exists(run + "/checkpoints/step_00000006/optim-00000.safetensors"));

  // A new run into the same folder is refused; nothing is touched.
  check_input_error(run_llmtrain({"train", "--config", config, "--run-dir", run, "--resume", "never"}),
                    "already holds a run");

  const auto evaluated = run_llmtrain({"eval", "--checkpoint", run});
  CAPTURE(evaluated.err);
  CHECK(evaluated.exit_code == 0);
  CHECK(evaluated.out.find("step 6: val_loss") != std::string::npos);

  const std::vector<std::string> generate = {"generate", "--checkpoint", run, "--prompt", "the ", "--max-new-tokens",
                                             "12", "--seed", "5", "--top-k", "20"};
  const auto first = run_llmtrain(generate);
  const auto second = run_llmtrain(generate);
  CAPTURE(first.err);
  REQUIRE(first.exit_code == 0);
  CHECK(first.out.rfind("the ", 0) == 0);
  CHECK(first.out.size() == 4 + 12 + 1);  // prompt, 12 byte tokens, newline
  CHECK(first.out == second.out);        // same seed, same text

  const auto exported = run_llmtrain({"export", "--checkpoint", run + "/checkpoints/step_00000004", "--output",
                                      dir.path() + "/hf"});
  CHECK(exported.exit_code == 0);
  CHECK(std::filesystem::exists(dir.path() + "/hf/model.safetensors"));
  CHECK(std::filesystem::exists(dir.path() + "/hf/config.json"));

  const auto inspected = run_llmtrain({"inspect", "--checkpoint", run});
  CAPTURE(inspected.out);
  CHECK(inspected.exit_code == 0);
  CHECK(inspected.out.find("step 6, 384 tokens seen, world size 1") != std::string::npos);
  CHECK(inspected.out.find("every file verifies") != std::string::npos);

  // A damaged checkpoint file is detected by its checksum.
  {
    std::fstream f(run + "/checkpoints/step_00000006/model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-1, std::ios::end);
    f.put('\x7f');
  }
  check_input_error(run_llmtrain({"eval", "--checkpoint", run}), "model.safetensors: checksum mismatch");
  const auto damaged = run_llmtrain({"inspect", "--checkpoint", run});
  CHECK(damaged.exit_code == 2);
  CHECK(damaged.out.find("model.safetensors") != std::string::npos);
  CHECK(damaged.out.find("CHECKSUM MISMATCH") != std::string::npos);
}
