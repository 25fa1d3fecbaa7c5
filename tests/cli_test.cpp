// The llmtrain binary as users call it: exit codes, one-line errors, --help, info, check-config.
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "catch_compat.h"
#include "process.h"
#include "run_metrics.h"

using llmtrain::test::run_llmtrain;
using llmtrain::test::TempDir;
using llmtrain::test::training_losses;

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

// Token shards (byte tokenizer) of a small repeated English text, in DIR/shards; returns that folder.
std::string fox_shards(const TempDir& dir) {
  std::string text;
  for (int i = 0; i < 400; ++i) text += "the quick brown fox jumps over the lazy dog " + std::to_string(i % 7) + "\n";
  const std::string shards = dir.path() + "/shards";
  REQUIRE(run_llmtrain({"tokenize", "--input", dir.write("corpus.txt", text), "--output", shards}).exit_code == 0);
  return shards;
}

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

TEST_CASE("plan: GPT-2 124M's parameter count and memory per rank", "[cli][plan]") {
  const auto r = run_llmtrain({"plan", "--config", LLMTRAIN_SOURCE_DIR "/configs/gpt2-124m.json", "--world-size", "8"});
  CAPTURE(r.out, r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(r.out.find("parameters: 124,439,808") != std::string::npos);
  // fp32 weights: 4 x 124,439,808 B = 474.70 MiB. ZeRO 1 at 8 ranks: m and v of a shard of
  // ceil(124,439,808 / 8) = 15,554,976 parameters, 8 B each = 118.68 MiB.
  CHECK(r.out.find("fp32 ZeRO 0     474.70 MiB") != std::string::npos);
  CHECK(r.out.find("fp32 ZeRO 1     474.70 MiB   474.70 MiB   118.68 MiB") != std::string::npos);
  // ZeRO 3 at 8 ranks: units ln_f 1,536, 12 layers of 7,087,872, wpe + wte 39,383,808, shards
  // 192 + 12 x 885,984 + 4,922,976 = 15,554,976 parameters (4 B: 59.34 MiB). The embedding
  // outweighs a layer, so the ends' units keep slots of their own (parallel/zero3_slots.h):
  // weight slots of 2 layers and of the two ends' units, 2 x 8 x 885,984 + 8 x (4,922,976 + 192) =
  // 53,561,088, the gradient slots as long plus their parts (1/8): 4 x 113,817,312 B = 434.18 MiB.
  CHECK(r.out.find("fp32 ZeRO 3      59.34 MiB    59.34 MiB   118.68 MiB   434.18 MiB") != std::string::npos);
  // Sent per update: ZeRO 0 all-reduces 4 x 124,439,808 B: 2 x 7/8 of it = 830.73 MiB. ZeRO 3
  // (4 micro-steps): per micro-step 12 layers x 7 x 885,984 x (4 + 4 + 4) B and the ends' units
  // reduced once, 7 x 4,923,168 x 4 B; once per update the ends' weights, 7 x 4,923,168 x 4 B;
  // less the first layer's forward gather in micro-steps 2-4, 3 x 7 x 885,984 x 4 B: 3.90 GiB.
  const auto row = [&](const std::string& label) { return r.out.substr(r.out.find(label), r.out.find('\n', r.out.find(label)) - r.out.find(label)); };
  CHECK(row("fp32 ZeRO 0").find(" 830.73 MiB ") != std::string::npos);
  CHECK(row("fp32 ZeRO 3").find(" 3.90 GiB ") != std::string::npos);
  check_input_error(run_llmtrain({"plan", "--config", LLMTRAIN_SOURCE_DIR "/configs/gpt2-124m.json", "--world-size",
                                  "3"}),
                    "train.global_batch_size: must be a multiple of train.micro_batch_size x data-parallel size (16 x 3 = 48)");
}

TEST_CASE("plan: the mesh, and sizes that do not divide the world", "[cli][plan]") {
  const std::string config = LLMTRAIN_SOURCE_DIR "/configs/gpt2-124m.json";
  // 8 ranks, 2 per tensor group: 4 data-parallel replicas of tensor rank 1's part (25,129 of the
  // 50,257 vocabulary rows): each layer's 6 x 768 norm and bias values whole and (4 C C + 3 C + 2 F
  // C + F) / 2 = 3,541,632 split, ln_f, wpe and 25,129 x 768 rows of wte: 12 x 3,546,240 +
  // 1,536 + 786,432 + 19,299,072 = 62,641,920 parameters (4 B: 238.96 MiB). ZeRO 1 shards m and v
  // four ways: 15,660,480 x 8 B = 119.48 MiB; the padded gradient buffer and shard 5 x 15,660,480
  // x 4 B = 298.70 MiB.
  const auto r = run_llmtrain({"plan", "--config", config, "--world-size", "8", "--set", "dist.tensor_parallel=2"});
  CAPTURE(r.out, r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(r.out.find("mesh: 8 rank(s) = tensor 2 x data 4 x pipeline 1") != std::string::npos);
  CHECK(r.out.find("tensor parallel 2: the figures below are tensor rank 1's, which holds most: 62,641,920 "
                   "parameters") != std::string::npos);
  CHECK(r.out.find("fp32 ZeRO 1     238.96 MiB   238.96 MiB   119.48 MiB   298.70 MiB") != std::string::npos);
  // The tensor group, 8 micro-steps of 16 x 1,024 tokens: (1 + 4 x 12 + 1) all-reduces of N x 768
  // f32 and the cross-entropy's 3 N values, 2,516,779,008 B each micro-step, all sent at 2 ranks;
  // and the norm's 8 B: 20,134,232,072 B = 18.75 GiB in 8 x 52 + 1 = 417 all-reduces.
  CHECK(r.out.find("tensor group: 18.75 GiB sent per update on the fp32 rows, 18.75 GiB on the bf16 rows, in 417 "
                   "all-reduces, 0 reduce-scatters and 0 all-gathers") != std::string::npos);
  // Sequence parallelism, per micro-step: 6 x 12 + 2 = 74 all-gathers and 4 x 12 + 2 = 50
  // reduce-scatters of N x 768 values, half of each sent (25,165,824 B in f32, half that for the
  // bf16 all-gathers), and 27 all-reduces: the cross-entropy's 3 N and 25 norms' 2 x 768 f32
  // values, 350,208 B. Eight of them and the norm's 8 B: 24,967,299,080 B = 23.25 GiB in fp32,
  // 17,518,215,176 B = 16.32 GiB in bf16.
  const auto sp = run_llmtrain({"plan", "--config", config, "--world-size", "8", "--set", "dist.tensor_parallel=2",
                                "--set", "dist.sequence_parallel=true"});
  CAPTURE(sp.out, sp.err);
  REQUIRE(sp.exit_code == 0);
  CHECK(sp.out.find("tensor parallel 2 with sequence parallelism: ") != std::string::npos);
  CHECK(sp.out.find("tensor group: 23.25 GiB sent per update on the fp32 rows, 16.32 GiB on the bf16 rows, in 217 "
                    "all-reduces, 400 reduce-scatters and 592 all-gathers") != std::string::npos);
  check_input_error(run_llmtrain({"plan", "--config", LLMTRAIN_SOURCE_DIR "/configs/tiny-llama.json", "--world-size",
                                  "4", "--set", "dist.tensor_parallel=4", "--set", "dist.sequence_parallel=true", "--set",
                                  "train.micro_batch_size=1", "--set", "model.context_length=63"}),
                    "tiny-llama.json: dist.sequence_parallel: train.micro_batch_size x model.context_length (1 x 63) "
                    "must be a multiple of dist.tensor_parallel (4)");
  // A size the heads do not divide: exit 2, naming the file and the keys.
  check_input_error(run_llmtrain({"plan", "--config", config, "--world-size", "8", "--set", "dist.tensor_parallel=8"}),
                    "gpt2-124m.json: dist.tensor_parallel = 8 must divide model.n_head (12)");
  check_input_error(run_llmtrain({"plan", "--config", config, "--world-size", "6", "--set", "dist.pipeline_parallel=4"}),
                    "dist.tensor_parallel x dist.pipeline_parallel (1 x 4 = 4) must divide the number of ranks, 6");
  // Training refuses what pipelines do not do yet (ZeRO 3 with one), and a tensor group larger than
  // the job.
  TempDir dir;
  check_input_error(run_llmtrain({"train", "--config", config, "--run-dir", dir.path() + "/run", "--set",
                                  "dist.pipeline_parallel=2", "--set", "dist.zero_stage=3"}),
                    "dist.pipeline_parallel = 2: not with dist.zero_stage 3 (use ZeRO 0, 1 or 2)");
  check_input_error(run_llmtrain({"train", "--config", config, "--run-dir", dir.path() + "/run", "--set",
                                  "dist.pipeline_parallel=2"}),
                    "dist.tensor_parallel x dist.pipeline_parallel (1 x 2 = 2) must divide the number of ranks, 1");
  check_input_error(run_llmtrain({"train", "--config", config, "--run-dir", dir.path() + "/run", "--set",
                                  "dist.tensor_parallel=2"}),
                    "dist.tensor_parallel x dist.pipeline_parallel (2 x 1 = 2) must divide the number of ranks, 1");
}

TEST_CASE("plan: a 1F1B pipeline's stages, bubble and transfers", "[cli][plan]") {
  const std::string config = LLMTRAIN_SOURCE_DIR "/configs/tiny-llama.json";  // 2 layers, 8 x 64 tokens, d_model 64
  const auto r = run_llmtrain({"plan", "--config", config, "--world-size", "2", "--set", "dist.pipeline_parallel=2"});
  CAPTURE(r.out, r.err);
  REQUIRE(r.exit_code == 0);
  // 2 micro-batches (16 / 8) through 2 stages: (2 - 1) / (2 + 2 - 1) idle.
  CHECK(r.out.find("pipeline: 2 stages, 1F1B, 2 micro-batches per update: bubble 33.3% of each stage's step") !=
        std::string::npos);
  CHECK(r.out.find("fp32 ZeRO 3   n/a with a pipeline") != std::string::npos);
  // Stage 0: layer 0 (2 norms 128, q and o 64 x 64, k and v 2 x 16 x 64, gate, up and down 176 x
  // 64: 46,208) and the embedding 256 x 64: 62,592 parameters, 16 B each in fp32 ZeRO 0 =
  // 978 KiB; stage 1: layer 1, the final norm and the untied head: 62,656 (979 KiB). Each sends 2
  // micro-batches of 8 x 64 x 64 f32 (activations forward, or gradients back), 256 KiB, and the
  // loss and norm doubles.
  CHECK(r.out.find("0     0 + embedding                       62,592   978.00 KiB") != std::string::npos);
  CHECK(r.out.find("(2 slots)") != std::string::npos);
  CHECK(r.out.find("1     1 + head                            62,656   979.00 KiB") != std::string::npos);
  CHECK(r.out.find("(1 slot)") != std::string::npos);
  CHECK(r.out.find("256.00 KiB (2 sends)   256.02 KiB\n") != std::string::npos);
  // Interleaved: the bubble of its formula, (2 - 1) / (2 x 4 + 2 - 1); each stage holds two
  // chunks of one layer (virtual stages s and s + 2).
  const auto i = run_llmtrain({"plan", "--config", config, "--world-size", "2", "--set", "dist.pipeline_parallel=2",
                               "--set", "dist.pipeline_schedule=interleaved", "--set", "dist.virtual_stages=2", "--set",
                               "model.n_layer=4", "--set", "train.global_batch_size=32"});
  CAPTURE(i.out, i.err);
  REQUIRE(i.exit_code == 0);
  CHECK(i.out.find("interleaved with 2 chunks per stage, 4 micro-batches per update: bubble 11.1%") != std::string::npos);
  CHECK(i.out.find("0     0, 2 + embedding ") != std::string::npos);
  CHECK(i.out.find("1     1, 3 + head ") != std::string::npos);
  // Fewer micro-batches than stages: exit 2, as train says it.
  check_input_error(run_llmtrain({"plan", "--config", config, "--world-size", "2", "--set", "dist.pipeline_parallel=2",
                                  "--set", "train.global_batch_size=8"}),
                    "tiny-llama.json: ");
}

TEST_CASE("plan --suggest: meshes that fit, least communication first, none that fits, bad flags", "[cli][plan]") {
  const std::string config = LLMTRAIN_SOURCE_DIR "/configs/tiny-llama.json";  // 125,248 parameters, fp32
  const auto r = run_llmtrain({"plan", "--config", config, "--suggest", "--gpus", "2", "--device-memory", "1GB"});
  CAPTURE(r.out, r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(r.out.find("on 2 device(s) of 1GB") != std::string::npos);
  // The rows between the header and the "fit:" line, with their sent/update in bytes.
  std::vector<std::string> rows;
  std::vector<double> sent;
  {
    std::istringstream lines(r.out.substr(r.out.find("mesh t x d x p")));
    std::string line;
    std::getline(lines, line);
    while (std::getline(lines, line) && line.rfind("fit:", 0) != 0) {
      rows.push_back(line);
      // ... sent/update (number, unit), then "of it tensor": a number and unit, or "-".
      std::vector<std::string> words;
      std::istringstream split(line);
      for (std::string w; split >> w;) words.push_back(w);
      words.pop_back();  // max micro-batch
      REQUIRE(words.size() >= 5);
      const std::size_t at = words.back() == "-" ? words.size() - 3 : words.size() - 4;
      const std::string& u = words[at + 1];
      const double scale = u == "B" ? 1 : u == "KiB" ? 1024.0 : u == "MiB" ? 1024.0 * 1024 : u == "GiB" ? 1024.0 * 1024 * 1024 : 0;
      CHECK(scale > 0);
      sent.push_back(std::stod(words[at]) * scale);
    }
  }
  REQUIRE(rows.size() >= 2);
  for (std::size_t i = 1; i < sent.size(); ++i) CHECK(sent[i - 1] <= sent[i]);
  // Plain data parallelism over 2 ranks, ZeRO 0: one all-reduce of 125,248 x 4 B, half of it
  // sent twice: 500,992 B = 489.25 KiB; one micro-step (16 = 8 x 2). ZeRO 1 and 2 send as much
  // and hold more at 2 ranks (a padded gradient buffer and shard next to the whole gradients):
  // left out.
  bool data_parallel = false;
  for (const auto& line : rows) {
    data_parallel = data_parallel || line.rfind("1 x 2 x 1           0           1 ", 0) == 0;
    CHECK(line.rfind("1 x 2 x 1           1", 0) != 0);
    CHECK(line.rfind("1 x 2 x 1           2", 0) != 0);
  }
  CHECK(data_parallel);
  // Its max micro-batch: 16 sequences over 2 data ranks, all 8 at once (a few MiB of 1 GB).
  CHECK(r.out.find("489.25 KiB             -               8\n") != std::string::npos);
  // Tensor parallel 2, 2 micro-steps: per micro-step all-reduces of 8 x 64
  // tokens x 64 f32 for the embedding, 4 per layer (2 layers) and the head's input gradient, and
  // the cross-entropy's 3 x 512 values: 329,216 x 4 B, each all sent at 2 ranks; twice, and the
  // norm's 8 B: 2,633,736 B = 2.51 MiB, all of it over the tensor group.
  bool tensor_parallel = false;
  for (const auto& line : rows) {
    tensor_parallel = tensor_parallel || (line.rfind("2 x 1 x 1           0           2 ", 0) == 0 &&
                                          line.find("2.51 MiB      2.51 MiB") != std::string::npos);
  }
  CHECK(tensor_parallel);
  // Two pipeline stages (1F1B) send least: a stage's 8 x 64 x 64 x 4 B activations
  // (or their gradients) once per micro-step, 2 micro-steps, and the loss and norm doubles:
  // 262,160 B = 256.02 KiB. The larger stage is the first (the embedding and 2 micro-batches'
  // activations): 10.36 MiB, as plan prints it for that mesh. No ZeRO 3 with a pipeline. Host per
  // GPU rank at a save: 2 GiB + a 32 MiB chunk + the staging of its (stage's) parameters, 12 bytes
  // each (f32 weights, m, v): 2.03 GiB.
  CHECK(rows[0].rfind("1 x 1 x 2           0           2     10.36 MiB      2.03 GiB    256.02 KiB             -", 0) == 0);
  for (const auto& line : rows) CHECK(line.rfind("1 x 1 x 2           3", 0) != 0);
  CHECK(r.out.find("every row is exact") != std::string::npos);

  // --gpus defaults to --world-size; nothing fits in 1 MB: said, and exit 0.
  const auto none = run_llmtrain({"plan", "--config", config, "--suggest", "--world-size", "2", "--device-memory", "1MB"});
  CHECK(none.exit_code == 0);
  CHECK(none.out.find("on 2 device(s) of 1MB") != std::string::npos);
  CHECK(none.out.find("none fits: no mesh of 2 device(s) with ZeRO 0-3 fits in 1MB") != std::string::npos);

  check_input_error(run_llmtrain({"plan", "--config", config, "--suggest", "--gpus", "0"}), "--gpus: expected an integer from 1 to 1048576, got 0");
  check_input_error(run_llmtrain({"plan", "--config", config, "--gpus", "2"}), "--gpus requires --suggest");
  check_input_error(run_llmtrain({"plan", "--config", config, "--suggest", "--device-memory", "lots"}), "--device-memory lots");
}

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
