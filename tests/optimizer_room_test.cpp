// The optimizer room: a second optimizer, defined here alone (SGD with momentum), trains through
// optim/optimizer.h and optim/registry.h with no change to the trainer, checkpoints or plan. At
// one rank its weights follow a hand computation from the gradients it was given; at two ranks
// (this binary under mpirun, the hidden case below) under ZeRO 1 and ZeRO 3 they follow the
// one-rank run; a run stopped and resumed ends with the files of an uninterrupted one, bit for bit.
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "catch_compat.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/safetensors.h"
#include "config/config.h"
#include "core/error.h"
#include "ops/buffer.h"
#include "optim/optimizer.h"
#include "optim/registry.h"
#include "plan/memory_plan.h"
#include "process.h"
#include "run_metrics.h"
#include "train/run.h"

using namespace llmtrain;

namespace {

// What the one-rank reference run hands the test: the weights before the first update, the
// gradients of every update, and the parameter list (to find each tensor in the local arrays).
struct Recording {
  bool on = false;
  std::vector<float> initial;
  std::vector<std::vector<float>> grads;
  std::vector<double> lrs;
  std::vector<model::ParamInfo> infos;
};
Recording& recording() {
  static Recording r;
  return r;
}

// SGD with momentum (momentum optim.beta1): buffer = beta1 buffer + clipped gradient, then
// weights -= lr buffer. On the CPU only.
class SgdMomentum final : public optim::Optimizer {
 public:
  SgdMomentum(std::vector<optim::Piece> pieces, const config::OptimConfig& optim)
      : Optimizer(std::move(pieces)), momentum_(optim.beta1), buffer_(Device::cpu, std::size_t(size()) * sizeof(float)) {
    float* b = buffer().as<float>();
    for (std::int64_t i = 0; i < size(); ++i) b[i] = 0.0f;
  }

  void update(const optim::UpdateArgs& a) override {
    if (a.working.data) throw RuntimeError("sgd_momentum: no bf16 working copy in this test");
    float *w = a.params.as<float>(), *b = buffer().as<float>();
    const float* g = a.grads.as<float>();
    Recording& r = recording();
    if (r.on) {
      if (r.grads.empty()) r.initial.assign(w, w + size());
      r.grads.emplace_back(g, g + size());
      r.lrs.push_back(a.lr);
      r.infos = a.infos;
    }
    const double scale = a.grad_clip > 0 && a.grad_norm > a.grad_clip ? a.grad_clip / (a.grad_norm + 1e-6) : 1.0;
    for (std::int64_t i = 0; i < size(); ++i) {
      b[i] = float(momentum_) * b[i] + float(scale) * g[i];
      w[i] -= float(a.lr) * b[i];
    }
  }

  std::vector<optim::StateTensor> state() const override { return {{"sgd_momentum.buffer", buffer()}}; }

 private:
  Tensor buffer() const { return buffer_.view(DType::f32, {size()}); }
  double momentum_;
  ops::Buffer buffer_;
};

void register_sgd_momentum() {
  optim::register_optimizer(
      "sgd_momentum",
      {[](const config::OptimConfig&, const model::ParamInfo&) { return std::int64_t(4); },
       [](const config::OptimConfig&) { return std::int64_t(1); }, [](const model::ParamInfo&) { return true; },
       [](const config::OptimConfig& optim, const std::vector<model::ParamInfo>&, std::vector<optim::Piece> pieces,
          Device) -> std::unique_ptr<optim::Optimizer> { return std::make_unique<SgdMomentum>(std::move(pieces), optim); }});
}

constexpr int steps = 6;

// The toy's config over the shards in `dir`: 6 updates of 8 sequences at a constant learning rate,
// a checkpoint every 3.
std::string room_config(const std::string& dir) {
  return R"({"model": {"vocab_size": 256, "context_length": 16, "n_layer": 2, "n_head": 2, "d_model": 16},
    "data": {"train": ")" + dir + R"(/shards/train_*.bin", "val": ")" + dir + R"(/shards/val_*.bin"},
    "train": {"micro_batch_size": 2, "global_batch_size": 8, "max_steps": 6, "eval_every": 0, "grad_clip": 0},
    "optim": {"name": "sgd_momentum", "lr": 0.05, "warmup_steps": 0, "schedule": "constant", "beta1": 0.9},
    "dist": {"bucket_mb": 0.001},
    "checkpoint": {"every": 3, "keep_last": 5}})";
}

// Trains in this process (every rank of the job): `run` from scratch, or on from its checkpoints.
void train_run(const std::string& config_path, const std::string& run, std::vector<config::Override> sets) {
  train::TrainOptions options;
  options.config = config::load_config(config_path, sets);
  options.run_dir = run;
  options.progress = false;
  train::run_training(options);
}

std::string last_checkpoint(const std::string& run) {
  char step[32];
  std::snprintf(step, sizeof step, "/checkpoints/step_%08d", steps);
  return run + step;
}

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// The split run's last checkpoint holds the uninterrupted run's safetensors files, byte for byte.
void check_resume_equal(const std::string& run) {
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(last_checkpoint(run))) {
    if (entry.path().extension() != ".safetensors") continue;
    const std::string name = entry.path().filename().string();
    CAPTURE(run, name);
    CHECK(file_bytes(entry.path().string()) == file_bytes(last_checkpoint(run + "-split") + "/" + name));
    ++files;
  }
  CHECK(files >= 2);
}


// The message of the InputError that reading `json` as a config throws ("" when none).
std::string config_error(const std::string& json) {
  try {
    config::parse_config(json, "c.json", {});
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("optim.name selects a registered optimizer; plan counts its state per parameter", "[optim]") {
  config::OptimConfig adamw;
  model::ParamInfo info;
  info.name = "w";
  info.shape = {4, 4};
  info.numel = 16;
  CHECK(optim::state_bytes_of(adamw, info) == 8);
  CHECK(optim::state_arrays(adamw) == 2);
  config::OptimConfig sgd;
  sgd.name = "sgd_momentum";
  CHECK_THROWS_WITH(optim::state_arrays(sgd), "optim.name: expected one of \"adamw\", \"muon\", got \"sgd_momentum\"");
  CHECK(config_error(R"({"optim": {"name": "sgd_momentum"}})").find(
            "optim.name: expected one of \"adamw\", \"muon\", got \"sgd_momentum\"") != std::string::npos);
  register_sgd_momentum();
  CHECK(optim::state_bytes_of(sgd, info) == 4);
  CHECK(optim::state_arrays(sgd) == 1);
  const config::Config c = config::parse_config(R"({"optim": {"name": "sgd_momentum"}})", "c.json", {});
  CHECK(c.optim.name == "sgd_momentum");
  const std::string near_miss = config_error(R"({"optim": {"name": "sgd_momentun"}})");
  CAPTURE(near_miss);
  CHECK(near_miss.find("optim.name: expected one of \"adamw\", \"muon\", \"sgd_momentum\"") != std::string::npos);
  CHECK(near_miss.find("did you mean \"sgd_momentum\"?") != std::string::npos);
  // plan: 4 bytes of state per parameter where AdamW has 8, unsharded and as ZeRO 3's shards.
  config::Config with_adamw = c;
  with_adamw.optim.name = "adamw";
  const std::int64_t P = plan::parameter_count(c.model);
  CHECK(plan::plan_memory(c, 1, 0, false, 1).optimizer == 4 * P);
  CHECK(plan::plan_memory(with_adamw, 1, 0, false, 1).optimizer == 8 * P);
  CHECK(plan::plan_memory(c, 4, 3, false, 1).optimizer * 2 == plan::plan_memory(with_adamw, 4, 3, false, 1).optimizer);
}

TEST_CASE("a toy SGD with momentum trains through the optimizer interface on 1 and 2 ranks, ZeRO 1 and 3, and resumes",
          "[optim][train]") {
#ifndef LLMTRAIN_MPIEXEC
  LLMTRAIN_SKIP("built without MPI: the two-rank runs need mpirun");
#else
  register_sgd_momentum();
  test::TempDir dir;
  std::string text;
  for (int i = 0; i < 400; ++i) text += "line " + std::to_string(i) + " of the optimizer room corpus\n";
  REQUIRE(test::run_llmtrain({"tokenize", "--input", dir.write("corpus.txt", text), "--output", dir.path() + "/shards"})
              .exit_code == 0);
  const std::string config_path = dir.write("c.json", room_config(dir.path()));

  // One rank, recording what the optimizer was given.
  recording() = {};
  recording().on = true;
  const std::string one = dir.path() + "/one";
  train_run(config_path, one, {});
  Recording r = recording();
  recording().on = false;
  REQUIRE(r.grads.size() == std::size_t(steps));

  // By hand: buffer_k = 0.9 buffer_(k-1) + g_k, w_k = w_(k-1) - 0.05 buffer_k, from the initial
  // weights and the gradients of each update (grad_clip 0: no scaling), in double.
  std::vector<double> w(r.initial.begin(), r.initial.end()), b(w.size(), 0.0);
  for (int k = 0; k < steps; ++k) {
    CHECK(r.lrs[std::size_t(k)] == 0.05);
    for (std::size_t i = 0; i < w.size(); ++i) {
      b[i] = 0.9 * b[i] + double(r.grads[std::size_t(k)][i]);
      w[i] -= 0.05 * b[i];
    }
  }
  const checkpoint::Found found = checkpoint::find(last_checkpoint(one));
  const auto saved = checkpoint::load_model(found);
  double worst = 0.0, moved = 0.0;
  for (const model::ParamInfo& info : r.infos) {
    const float* got = saved->param(saved->param_info(info.name)).as<float>();
    for (std::int64_t i = 0; i < info.numel; ++i) {
      const std::size_t at = std::size_t(info.offset + i);
      worst = std::max(worst, std::abs(double(got[i]) - w[at]) / (std::abs(w[at]) + 1e-3));
      moved = std::max(moved, std::abs(w[at] - double(r.initial[at])));
    }
  }
  CAPTURE(worst, moved);
  CHECK(worst < 1e-5);
  CHECK(moved > 1e-3);  // the updates did change the weights
  // The checkpoint holds the toy's state by its name, and it is the hand-computed buffer.
  const checkpoint::SafetensorsReader optim_file(found.dir + "/optim-00000.safetensors");
  CHECK(optim_file.find("sgd_momentum.buffer") != nullptr);
  CHECK(optim_file.find("adamw.m") == nullptr);
  std::vector<float> buffer(w.size());
  checkpoint::load_state(found, checkpoint::StateKind::optimizer, {{0, std::int64_t(w.size())}}, {buffer.data()},
                         {"sgd_momentum.buffer"});
  double buffer_worst = 0.0;
  for (const model::ParamInfo& info : r.infos) {
    for (std::int64_t i = 0; i < info.numel; ++i) {
      const std::size_t local = std::size_t(info.offset + i), logical = std::size_t(info.logical_offset + i);
      buffer_worst = std::max(buffer_worst, std::abs(double(buffer[logical]) - b[local]) / (std::abs(b[local]) + 1e-3));
    }
  }
  CAPTURE(buffer_worst);
  CHECK(buffer_worst < 1e-5);

  // Stopped after 3 updates and resumed at one rank: the files of the uninterrupted run.
  train_run(config_path, one + "-split", {{"train.max_steps=3"}});
  train_run(config_path, one + "-split", {});
  check_resume_equal(one);

  // Two ranks, ZeRO 1 and ZeRO 3, each straight through and stopped after 3 updates and resumed:
  // the hidden case below under mpirun, one run per job (MPI starts once per process).
  const auto two_ranks = [&](const std::string& run, int zero, int max_steps) {
    const std::string command = "OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 LLMTRAIN_ROOM_CONFIG=" + config_path +
                                " LLMTRAIN_ROOM_RUN=" + run + " LLMTRAIN_ROOM_ZERO=" + std::to_string(zero) +
                                " LLMTRAIN_ROOM_STEPS=" + std::to_string(max_steps) + " " + LLMTRAIN_MPIEXEC +
                                " --allow-run-as-root --oversubscribe -np 2 " +
                                std::filesystem::read_symlink("/proc/self/exe").string() + " \"[.optim_room_mpi]\" >" +
                                run + ".log 2>&1";
    const int status = std::system(command.c_str());
    if (status != 0) FAIL("mpirun: " << file_bytes(run + ".log"));
  };
  for (const int zero : {1, 3}) {
    const std::string two = dir.path() + "/two-zero" + std::to_string(zero);
    two_ranks(two, zero, steps);
    two_ranks(two + "-split", zero, 3);
    two_ranks(two + "-split", zero, steps);
  }
  const std::vector<double> one_losses = test::training_losses(one);
  REQUIRE(one_losses.size() == std::size_t(steps));
  for (const int zero : {1, 3}) {
    const std::string two = dir.path() + "/two-zero" + std::to_string(zero);
    CAPTURE(zero);
    const std::vector<double> got = test::training_losses(two);
    REQUIRE(got.size() == one_losses.size());
    for (std::size_t i = 0; i < got.size(); ++i) CHECK(std::abs(got[i] - one_losses[i]) <= 1e-5 * one_losses[i]);
    // Each rank wrote its shard of the toy's state.
    for (const char* file : {"/optim-00000.safetensors", "/optim-00001.safetensors"}) {
      CHECK(checkpoint::SafetensorsReader(last_checkpoint(two) + file).find("sgd_momentum.buffer") != nullptr);
    }
    const auto weights = checkpoint::load_model(checkpoint::find(last_checkpoint(two)));
    double error = 0.0;
    for (const model::ParamInfo& info : saved->param_infos()) {
      const float *a = saved->param(info).as<float>(), *c = weights->param(weights->param_info(info.name)).as<float>();
      for (std::int64_t i = 0; i < info.numel; ++i) error = std::max(error, std::abs(double(a[i]) - double(c[i])));
    }
    CAPTURE(error);
    CHECK(error < 1e-5);
    check_resume_equal(two);
  }
#endif
}

// Run by the case above under mpirun -np 2: one training run of the toy optimizer (its config,
// run folder, ZeRO stage and max_steps from LLMTRAIN_ROOM_*).
TEST_CASE("the toy optimizer at two ranks: one run", "[.optim_room_mpi]") {
  register_sgd_momentum();
  const char *config = std::getenv("LLMTRAIN_ROOM_CONFIG"), *run = std::getenv("LLMTRAIN_ROOM_RUN");
  const char *zero = std::getenv("LLMTRAIN_ROOM_ZERO"), *max_steps = std::getenv("LLMTRAIN_ROOM_STEPS");
  REQUIRE((config && run && zero && max_steps));
  train_run(config, run, {{std::string("dist.zero_stage=") + zero}, {std::string("train.max_steps=") + max_steps}});
}
