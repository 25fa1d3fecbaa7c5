// llmtrain plan: parameter counts, memory per rank, mesh, pipeline and traffic figures, and
// --suggest's meshes; sizes and flags that do not fit exit 2 with one error line.
#include <sstream>
#include <string>
#include <vector>

#include "catch_compat.h"
#include "cli_check.h"
#include "process.h"

using llmtrain::test::run_llmtrain;
using llmtrain::test::TempDir;
using llmtrain::test::check_input_error;

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
