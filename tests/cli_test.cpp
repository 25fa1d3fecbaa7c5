// The llmtrain binary as users call it: exit codes, one-line errors, --help, info, check-config.
#include <filesystem>

#include <nlohmann/json.hpp>

#include "catch_compat.h"
#include "process.h"

using llmtrain::test::run_llmtrain;
using llmtrain::test::TempDir;

namespace {

// Exit 2 with exactly one line on stderr, "llmtrain: error: ...", containing `expected`.
void check_input_error(const llmtrain::test::ProcessResult& r, const std::string& expected) {
  CAPTURE(r.err);
  CHECK(r.exit_code == 2);
  CHECK(r.err.rfind("llmtrain: error: ", 0) == 0);
  CHECK(r.err.find(expected) != std::string::npos);
  CHECK(r.err.find('\n') == r.err.size() - 1);  // one line
  CHECK(r.out.empty());
}

}  // namespace

TEST_CASE("--help and --version work for the program and every subcommand", "[cli]") {
  const auto version = run_llmtrain({"--version"});
  CHECK(version.exit_code == 0);
  CHECK(version.out.rfind("llmtrain 0.", 0) == 0);
  for (const std::string sub : {"info", "check-config", "tokenize"}) {
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
}

TEST_CASE("check-config rejects bad configs with exit 2 naming the file and key", "[cli]") {
  TempDir dir;
  check_input_error(run_llmtrain({"check-config", "--config", dir.path() + "/missing.json"}),
                    "missing.json: cannot open config file");
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
