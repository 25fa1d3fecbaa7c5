// Muon (optim/muon.h): its config keys and their errors, which parameters it takes, the mesh
// axes it accepts, a training run that checkpoints its state by name and resumes bit for bit, and the refusal
// to resume another optimizer's checkpoint. The hidden case "[.muon_dump]" writes Newton-Schulz
// results and Muon updates on random inputs for tests/muon_reference_test.py, which checks them
// against NumPy and torch.optim.Muon.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "catch_compat.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/safetensors.h"
#include "config/config.h"
#include "core/error.h"
#include "model/model.h"
#include "optim/muon.h"
#include "optim/newton_schulz.h"
#include "optim/registry.h"
#include "plan/memory_plan.h"
#include "process.h"
#include "run_metrics.h"

using namespace llmtrain;

namespace {

// The message of the InputError that reading `json` as a config throws ("" when none).
std::string config_error(const std::string& json, std::vector<config::Override> sets = {}) {
  try {
    config::parse_config(json, "c.json", sets);
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

std::vector<std::string> matrix_names(const std::string& model_json) {
  const config::Config c = config::parse_config(R"({"model": )" + model_json + "}", "c.json", {});
  const auto model = model::make_model(c.model, Device::cpu);
  std::vector<std::string> names;
  for (const optim::MuonMatrix& m : optim::muon_matrices(model->param_infos())) {
    names.push_back(m.name + " " + std::to_string(m.rows) + "x" + std::to_string(m.cols));
  }
  return names;
}

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::vector<float> random_normal(std::mt19937& rng, std::size_t n, float scale) {
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> out(n);
  for (float& x : out) x = normal(rng);
  return out;
}

// torch.optim.Muon's Newton-Schulz in double, by plain loops: u (rows, cols) row-major.
std::vector<double> newton_schulz_double(const float* u, std::int64_t rows, std::int64_t cols,
                                         const optim::NewtonSchulz& p) {
  const bool tall = rows > cols;
  const std::int64_t m = std::min(rows, cols), n = std::max(rows, cols);
  std::vector<double> x(std::size_t(m * n));
  double squares = 0.0;
  for (std::int64_t i = 0; i < rows * cols; ++i) squares += double(u[i]) * u[i];
  const double norm = std::max(std::sqrt(squares), p.eps);
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < cols; ++c)
      x[std::size_t(tall ? c * n + r : r * n + c)] = u[r * cols + c] / norm;
  }
  std::vector<double> a(std::size_t(m * m)), poly(std::size_t(m * m)), next(x.size());
  for (std::int64_t step = 0; step < p.steps; ++step) {
    for (std::int64_t i = 0; i < m; ++i) {  // A = X X^T
      for (std::int64_t j = 0; j < m; ++j) {
        double s = 0.0;
        for (std::int64_t k = 0; k < n; ++k) s += x[std::size_t(i * n + k)] * x[std::size_t(j * n + k)];
        a[std::size_t(i * m + j)] = s;
      }
    }
    for (std::int64_t i = 0; i < m; ++i) {  // b A + c A A
      for (std::int64_t j = 0; j < m; ++j) {
        double s = 0.0;
        for (std::int64_t k = 0; k < m; ++k) s += a[std::size_t(i * m + k)] * a[std::size_t(k * m + j)];
        poly[std::size_t(i * m + j)] = p.b * a[std::size_t(i * m + j)] + p.c * s;
      }
    }
    for (std::int64_t i = 0; i < m; ++i) {  // a X + poly X
      for (std::int64_t j = 0; j < n; ++j) {
        double s = 0.0;
        for (std::int64_t k = 0; k < m; ++k) s += poly[std::size_t(i * m + k)] * x[std::size_t(k * n + j)];
        next[std::size_t(i * n + j)] = p.a * x[std::size_t(i * n + j)] + s;
      }
    }
    std::swap(x, next);
  }
  std::vector<double> out(x.size());
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < cols; ++c)
      out[std::size_t(r * cols + c)] = x[std::size_t(tall ? c * n + r : r * n + c)];
  }
  return out;
}

}  // namespace

TEST_CASE("optim.muon: defaults, every key read, and one clear error per bad value", "[optim][muon][config]") {
  const config::Config d = config::parse_config(R"({"optim": {"name": "muon"}})", "c.json", {});
  CHECK(d.optim.name == "muon");
  CHECK(!d.optim.muon.lr.has_value());
  CHECK(!d.optim.muon.weight_decay.has_value());
  CHECK(d.optim.muon.momentum == 0.95);
  CHECK(d.optim.muon.nesterov);
  CHECK(d.optim.muon.ns_steps == 5);
  CHECK(d.optim.muon.ns_coefficients == std::vector<double>{3.4445, -4.7750, 2.0315});
  CHECK(d.optim.muon.adjust_lr == "match_rms_adamw");
  CHECK(d.optim.muon.eps == 1e-7);
  const config::Config c = config::parse_config(
      R"({"optim": {"name": "muon", "muon": {"lr": 0.02, "momentum": 0.9, "nesterov": false, "ns_steps": 3,
          "ns_coefficients": [2, -1.5, 0.5], "adjust_lr": "original", "weight_decay": 0, "eps": 1e-6}}})",
      "c.json", {{"optim.muon.momentum=0.8"}});
  CHECK(*c.optim.muon.lr == 0.02);
  CHECK(c.optim.muon.momentum == 0.8);
  CHECK(!c.optim.muon.nesterov);
  CHECK(c.optim.muon.ns_steps == 3);
  CHECK(c.optim.muon.ns_coefficients == std::vector<double>{2, -1.5, 0.5});
  CHECK(c.optim.muon.adjust_lr == "original");
  CHECK(*c.optim.muon.weight_decay == 0.0);
  CHECK(c.optim.muon.eps == 1e-6);
  // The resolved config writes it back and reads the same.
  const config::Config again = config::parse_config(config::to_json(c).dump(), "again.json", {});
  CHECK(again.optim.muon == c.optim.muon);
  CHECK(config::to_json(d)["optim"]["muon"].contains("lr") == false);

  const auto error_of = [](const std::string& muon) {
    return config_error(R"({"optim": {"name": "muon", "muon": )" + muon + "}}");
  };
  CHECK(error_of(R"({"lr": 0})") == "optim.muon.lr: expected a number > 0, got 0 (in c.json)");
  CHECK(error_of(R"({"momentum": 1})") == "optim.muon.momentum: expected a number in [0, 1), got 1 (in c.json)");
  CHECK(error_of(R"({"nesterov": 1})") == "optim.muon.nesterov: expected true or false, got 1 (in c.json)");
  CHECK(error_of(R"({"ns_steps": 2.5})") == "optim.muon.ns_steps: expected an integer from 1 to 99, got 2.5 (in c.json)");
  CHECK(error_of(R"({"ns_coefficients": [1, 2]})") ==
        "optim.muon.ns_coefficients: expected a list of 3 finite numbers [a, b, c], got [1,2] (in c.json)");
  CHECK(error_of(R"({"adjust_lr": "match_rms_adam"})") ==
        "optim.muon.adjust_lr: expected one of \"original\", \"match_rms_adamw\", got \"match_rms_adam\"; did you mean "
        "\"match_rms_adamw\"? (in c.json)");
  CHECK(error_of(R"({"weight_decay": -1})") == "optim.muon.weight_decay: expected a number >= 0, got -1 (in c.json)");
  CHECK(error_of(R"({"eps": 0})") == "optim.muon.eps: expected a number > 0, got 0 (in c.json)");
  const std::string unknown = error_of(R"({"momentun": 0.9})");
  CAPTURE(unknown);
  CHECK(unknown.starts_with("optim.muon.momentun: unknown key"));
  CHECK(unknown.find("did you mean 'optim.muon.momentum'?") != std::string::npos);
  CHECK(error_of("3") == "optim.muon: expected an object of Muon's keys, got 3 (in c.json)");
  CHECK(config_error("{}", {{"optim.muon.lr=-2"}}) == "optim.muon.lr: expected a number > 0, got -2 (from --set optim.muon.lr=-2)");
  // Every mesh axis is accepted: ZeRO's shards and tensor-parallel slices are gathered.
  CHECK(config_error(R"({"optim": {"name": "muon"}, "dist": {"tensor_parallel": 2}})").empty());
  CHECK(config_error(R"({"optim": {"name": "muon"}, "dist": {"zero_stage": 3}})").empty());
  CHECK(config_error(R"({"optim": {"name": "adamw"}, "dist": {"tensor_parallel": 2}})").empty());
}

TEST_CASE("Muon takes each layer's 2-D matrices (GPT-2's c_attn as q, k, v) by logical (out, in) shape", "[optim][muon]") {
  // A MoE layer: each expert's (out, in) matrix apart and the shared expert's; not the router.
  const std::vector<std::string> moe =
      matrix_names(R"({"arch": "llama", "vocab_size": 64, "context_length": 8, "n_layer": 1, "n_head": 4, "n_kv_head": 2,
                       "d_model": 16, "ffn_hidden": 24, "moe": {"experts": 2, "top_k": 1, "ffn_hidden": 8, "shared_experts": 1}})");
  std::vector<std::string> mlp;
  for (const std::string& name : moe) {
    if (name.find(".mlp.") != std::string::npos) mlp.push_back(name.substr(name.find(".mlp.") + 1));
  }
  CHECK(moe.size() == 4 + mlp.size());  // q, k, v, o
  CHECK(mlp == std::vector<std::string>{"mlp.experts.gate_proj[0] 8x16", "mlp.experts.gate_proj[1] 8x16",
                                        "mlp.experts.up_proj[0] 8x16",   "mlp.experts.up_proj[1] 8x16",
                                        "mlp.experts.down_proj[0] 16x8", "mlp.experts.down_proj[1] 16x8",
                                        "mlp.shared_experts.gate_proj.weight 8x16", "mlp.shared_experts.up_proj.weight 8x16",
                                        "mlp.shared_experts.down_proj.weight 16x8"});
  CHECK(matrix_names(R"({"arch": "gpt2", "vocab_size": 64, "context_length": 8, "n_layer": 1, "n_head": 2, "d_model": 16})") ==
        std::vector<std::string>{"transformer.h.0.attn.c_attn.weight[q] 16x16", "transformer.h.0.attn.c_attn.weight[k] 16x16",
                                 "transformer.h.0.attn.c_attn.weight[v] 16x16", "transformer.h.0.attn.c_proj.weight 16x16",
                                 "transformer.h.0.mlp.c_fc.weight 64x16", "transformer.h.0.mlp.c_proj.weight 16x64"});
  CHECK(matrix_names(R"({"arch": "llama", "vocab_size": 64, "context_length": 8, "n_layer": 1, "n_head": 4, "n_kv_head": 2,
                         "d_model": 16, "ffn_hidden": 24})") ==
        std::vector<std::string>{"model.layers.0.self_attn.q_proj.weight 16x16", "model.layers.0.self_attn.k_proj.weight 8x16",
                                 "model.layers.0.self_attn.v_proj.weight 8x16", "model.layers.0.self_attn.o_proj.weight 16x16",
                                 "model.layers.0.mlp.gate_proj.weight 24x16", "model.layers.0.mlp.up_proj.weight 24x16",
                                 "model.layers.0.mlp.down_proj.weight 16x24"});
  CHECK(std::abs(optim::muon_adjusted_lr(0.1, "original", 64, 16) - 0.2) < 1e-12);       // 0.1 sqrt(4)
  CHECK(std::abs(optim::muon_adjusted_lr(0.1, "original", 16, 64) - 0.1) < 1e-12);       // wide: no boost
  CHECK(std::abs(optim::muon_adjusted_lr(0.1, "match_rms_adamw", 16, 64) - 0.16) < 1e-12);  // 0.1 0.2 sqrt(64)
  config::OptimConfig muon;
  muon.name = "muon";
  CHECK(optim::state_arrays(muon) == 3);
  // plan: 4 bytes of state per element of a hidden matrix, 8 per other parameter element
  // (counted here from the model's own parameter list), unsharded and as ZeRO's shards.
  const config::Config c = config::parse_config(R"({"optim": {"name": "muon"}})", "c.json", {});
  config::Config with_adamw = c;
  with_adamw.optim.name = "adamw";
  const std::int64_t P = plan::parameter_count(c.model);
  std::int64_t in_matrices = 0;
  for (const model::ParamInfo& info : model::make_model(c.model, Device::cpu)->param_infos()) {
    CHECK(optim::state_bytes_of(muon, info) == (info.layer >= 0 && info.shape.size() == 2 ? 4 : 8));
    CHECK(optim::state_bytes_of(with_adamw.optim, info) == 8);
    if (info.layer >= 0 && info.shape.size() == 2) in_matrices += info.numel;
  }
  REQUIRE(in_matrices > P / 2);
  CHECK(plan::plan_memory(c, 1, 0, false, 1).optimizer == 4 * in_matrices + 8 * (P - in_matrices));
  CHECK(plan::plan_memory(with_adamw, 1, 0, false, 1).optimizer == 8 * P);
  // ZeRO 1 on 4 ranks: the largest rank's (every shard of ceil(P / 4) within 8 bytes a parameter).
  const std::int64_t zero1 = plan::plan_memory(c, 4, 1, false, 1).optimizer;
  CHECK(zero1 <= 8 * ((P + 3) / 4));
  CHECK(zero1 >= (4 * in_matrices + 8 * (P - in_matrices)) / 4);
  CHECK(plan::plan_memory(c, 4, 3, false, 1).optimizer < plan::plan_memory(with_adamw, 4, 3, false, 1).optimizer);
}

TEST_CASE("Newton-Schulz gives a matrix whose singular values lie near 1", "[optim][muon]") {
  // The quintic's fixed point band: singular values of O in about [0.7, 1.2] for a random input.
  std::mt19937 rng(7);
  const std::vector<float> u = random_normal(rng, 12 * 20, 1.0f);
  std::vector<float> o(u.size());
  optim::NewtonSchulzWork work;
  optim::newton_schulz(Tensor(const_cast<float*>(u.data()), DType::f32, Device::cpu, {12, 20}),
                       Tensor(o.data(), DType::f32, Device::cpu, {12, 20}), {}, work);
  // O O^T (12 x 12): diagonal near 1 (between 0.7^2 and 1.2^2), the rest small.
  double worst_diag = 0.0, worst_off = 0.0;
  for (int i = 0; i < 12; ++i) {
    for (int j = 0; j < 12; ++j) {
      double dot = 0.0;
      for (int k = 0; k < 20; ++k) dot += double(o[std::size_t(i * 20 + k)]) * o[std::size_t(j * 20 + k)];
      if (i == j) worst_diag = std::max(worst_diag, std::abs(dot - 1.0));
      else worst_off = std::max(worst_off, std::abs(dot));
    }
  }
  CAPTURE(worst_diag, worst_off);
  CHECK(worst_diag < 0.5);
  CHECK(worst_off < 0.5);
}

TEST_CASE("Newton-Schulz batched over matrices of one shape: each as alone, and as computed in double",
          "[optim][muon]") {
  // B matrices lying apart in one array (as in the optimizer's), batched in one call, in batches of
  // two (batch_bytes), and in place: each result bit for bit the single-matrix call's (the same
  // products, matrix by matrix, on the CPU), and within the precision of a double computation.
  std::mt19937 rng(21);
  optim::NewtonSchulzWork work;
  for (const bool bf16 : {false, true}) {
    for (const auto& [rows, cols, B] : std::vector<std::tuple<std::int64_t, std::int64_t, std::int64_t>>{
             {24, 40, 3}, {40, 24, 3}, {7, 5, 5}, {1, 6, 2}, {16, 16, 4}}) {
      INFO((bf16 ? "bf16 " : "f32 ") << B << " x " << rows << "x" << cols);
      const std::int64_t gap = 3, stride = rows * cols + gap;  // the matrices apart
      std::vector<float> u = random_normal(rng, std::size_t(B * stride), 0.3f);
      std::vector<float> batched(u.size(), 0.0f), chunked(u.size(), 0.0f), in_place = u;
      std::vector<Tensor> us, outs, chunked_outs, in_place_outs;
      for (std::int64_t b = 0; b < B; ++b) {
        const auto at = [&](std::vector<float>& v) {
          return Tensor(v.data() + b * stride, DType::f32, Device::cpu, {rows, cols});
        };
        us.push_back(at(u));
        outs.push_back(at(batched));
        chunked_outs.push_back(at(chunked));
        in_place_outs.push_back(at(in_place));
      }
      optim::NewtonSchulz ns;
      ns.bf16 = bf16;
      optim::newton_schulz(us, outs, ns, work);
      optim::newton_schulz(in_place_outs, in_place_outs, ns, work);
      optim::NewtonSchulz two = ns;
      two.batch_bytes = std::size_t(2 * (3 * rows * cols + 3 * std::min(rows, cols) * std::min(rows, cols))) *
                        (bf16 ? 2 : 4);  // two matrices' work
      optim::newton_schulz(us, chunked_outs, two, work);
      for (std::int64_t b = 0; b < B; ++b) {
        INFO("matrix " << b);
        std::vector<float> single(std::size_t(rows * cols));
        optim::newton_schulz(us[std::size_t(b)], Tensor(single.data(), DType::f32, Device::cpu, {rows, cols}),
                             ns, work);
        const auto same = [&](const std::vector<float>& v) {
          return std::equal(single.begin(), single.end(), v.begin() + b * stride);
        };
        CHECK(same(batched));
        CHECK(same(chunked));
        CHECK(same(in_place));
        const std::vector<double> want = newton_schulz_double(u.data() + b * stride, rows, cols, ns);
        double err = 0.0, largest = 0.0;
        for (std::size_t i = 0; i < want.size(); ++i) {
          err = std::max(err, std::abs(double(batched[std::size_t(b * stride) + i]) - want[i]));
          largest = std::max(largest, std::abs(want[i]));
        }
        CAPTURE(err, largest);
        // bf16: X, A and the polynomial rounded in each of the five steps (measured up to 4.1e-2).
        CHECK(err < (bf16 ? 6e-2 : 2e-5) * largest);
        CHECK(largest > 0.1);
      }
      // The gaps between the matrices are left alone.
      for (std::int64_t b = 0; b < B; ++b) {
        for (std::int64_t g = 0; g < gap; ++g)
          CHECK(batched[std::size_t(b * stride + rows * cols + g)] == 0.0f);
      }
    }
  }
  // Matrices of two shapes in one call: refused, naming the odd one.
  std::vector<float> a(12), b(12);
  try {
    optim::newton_schulz({Tensor(a.data(), DType::f32, Device::cpu, {3, 4}),
                          Tensor(b.data(), DType::f32, Device::cpu, {4, 3})},
                         {Tensor(a.data(), DType::f32, Device::cpu, {3, 4}),
                          Tensor(b.data(), DType::f32, Device::cpu, {4, 3})},
                         {}, work);
    FAIL("no error for matrices of two shapes");
  } catch (const RuntimeError& e) {
    CHECK(std::string(e.what()).find("matrix 1 of 2") != std::string::npos);
  }
}

TEST_CASE("Muon trains, checkpoints muon.momentum, resumes bit for bit, and refuses an AdamW resume", "[optim][muon][train]") {
  test::TempDir dir;
  std::string text;
  for (int i = 0; i < 300; ++i) text += "line " + std::to_string(i) + " of the muon corpus\n";
  REQUIRE(test::run_llmtrain({"tokenize", "--input", dir.write("corpus.txt", text), "--output", dir.path() + "/shards"})
              .exit_code == 0);
  const std::string config = dir.write("c.json", R"({"model": {"vocab_size": 256, "context_length": 16, "n_layer": 2,
      "n_head": 2, "d_model": 16},
    "data": {"train": ")" + dir.path() + R"(/shards/train_*.bin", "val": ")" + dir.path() + R"(/shards/val_*.bin"},
    "train": {"micro_batch_size": 4, "global_batch_size": 8, "max_steps": 6, "eval_every": 0, "grad_clip": 1.0},
    "optim": {"name": "muon", "lr": 0.003, "warmup_steps": 0, "schedule": "constant", "muon": {"lr": 0.02}},
    "checkpoint": {"every": 3, "keep_last": 5}})");
  const auto train = [&](const std::string& run, std::vector<std::string> extra) {
    std::vector<std::string> args{"train", "--config", config, "--run-dir", run};
    args.insert(args.end(), extra.begin(), extra.end());
    return test::run_llmtrain(args);
  };
  const std::string one = dir.path() + "/one", split = dir.path() + "/split";
  const auto whole = train(one, {});
  REQUIRE(whole.exit_code == 0);
  REQUIRE(train(split, {"--set", "train.max_steps=3"}).exit_code == 0);
  REQUIRE(train(split, {}).exit_code == 0);
  const std::string last = "/checkpoints/step_00000006";
  const checkpoint::SafetensorsReader state(one + last + "/optim-00000.safetensors");
  CHECK(state.find("muon.momentum") != nullptr);
  CHECK(state.find("adamw.m") != nullptr);
  CHECK(state.find("adamw.v") != nullptr);
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(one + last)) {
    if (entry.path().extension() != ".safetensors") continue;
    CAPTURE(entry.path().filename().string());
    CHECK(file_bytes(entry.path().string()) == file_bytes(split + last + "/" + entry.path().filename().string()));
    ++files;
  }
  CHECK(files >= 2);
  // Saved from the state tensors themselves (checkpoint.async false; above from the background
  // save's staging copy): each kept for its own elements, written with zeros where it keeps none,
  // the same bytes.
  REQUIRE(train(dir.path() + "/sync", {"--set", "checkpoint.async=false"}).exit_code == 0);
  CHECK(file_bytes(dir.path() + "/sync" + last + "/optim-00000.safetensors") ==
        file_bytes(one + last + "/optim-00000.safetensors"));
  // The loss fell (a working optimizer, not a no-op): the last logged loss below the first.
  const std::vector<double> losses = test::training_losses(one);
  REQUIRE(losses.size() == 6);
  CHECK(losses.back() < losses.front());
  // bf16 (Newton-Schulz's products rounded to bf16, the bf16 working copy written by Muon): the
  // fp32 run's losses within bf16's drift, and further from a run whose matrices stay put.
  REQUIRE(train(dir.path() + "/bf16", {"--set", "train.precision=bf16"}).exit_code == 0);
  REQUIRE(train(dir.path() + "/still", {"--set", "optim.muon.lr=1e-9"}).exit_code == 0);
  const std::vector<double> bf16 = test::training_losses(dir.path() + "/bf16");
  const std::vector<double> still = test::training_losses(dir.path() + "/still");
  REQUIRE(bf16.size() == losses.size());
  REQUIRE(still.size() == losses.size());
  double drift = 0.0;
  for (std::size_t i = 0; i < losses.size(); ++i) drift = std::max(drift, std::abs(bf16[i] - losses[i]));
  CAPTURE(drift, still.back(), losses.back());
  CHECK(drift < 0.01);
  CHECK(std::abs(still.back() - losses.back()) > 5 * drift);
  // Resuming with AdamW: exit 2 and one line naming optim.name.
  const auto refused = train(one, {"--set", "optim.name=adamw", "--set", "train.max_steps=8"});
  CAPTURE(refused.err);
  CHECK(refused.exit_code == 2);
  CHECK(refused.err.find("optim.name: the checkpoint") != std::string::npos);
  CHECK(refused.err.find("holds the state of optimizer \"muon\", the config asks for \"adamw\"") != std::string::npos);
}

// Writes $LLMTRAIN_MUON_DUMP (JSON): Newton-Schulz on random matrices, and Muon's updates of a
// tiny GPT-2's and a tiny Llama's parameters on random gradients, with every input the references
// need (tests/muon_reference_test.py).
TEST_CASE("Muon: inputs and results for the NumPy and PyTorch references", "[.muon_dump]") {
  const char* path = std::getenv("LLMTRAIN_MUON_DUMP");
  REQUIRE(path);
  std::mt19937 rng(1234);
  nlohmann::json out;
  optim::NewtonSchulzWork work;
  for (const auto& [rows, cols, bf16] : std::vector<std::tuple<int, int, bool>>{
           {5, 7, false}, {7, 5, false}, {16, 16, false}, {1, 8, false}, {8, 1, false}, {48, 16, false}, {24, 40, true}}) {
    std::vector<float> u = random_normal(rng, std::size_t(rows * cols), 0.3f);
    std::vector<float> o(u.size());
    optim::NewtonSchulz ns;
    ns.bf16 = bf16;
    optim::newton_schulz(Tensor(u.data(), DType::f32, Device::cpu, {rows, cols}),
                         Tensor(o.data(), DType::f32, Device::cpu, {rows, cols}), ns, work);
    out["newton_schulz"].push_back({{"rows", rows}, {"cols", cols}, {"bf16", bf16}, {"steps", ns.steps},
                                    {"coefficients", {ns.a, ns.b, ns.c}}, {"eps", ns.eps}, {"u", u}, {"o", o}});
  }
  // Batched: three matrices of one shape lying apart in one array, in batches of two and one.
  for (const auto& [rows, cols, bf16] :
       std::vector<std::tuple<int, int, bool>>{{40, 24, false}, {16, 48, true}}) {
    const int B = 3, stride = rows * cols + 5;
    std::vector<float> u = random_normal(rng, std::size_t(B * stride), 0.3f), o(u.size());
    std::vector<Tensor> us, os;
    for (int b = 0; b < B; ++b) {
      us.push_back(Tensor(u.data() + b * stride, DType::f32, Device::cpu, {rows, cols}));
      os.push_back(Tensor(o.data() + b * stride, DType::f32, Device::cpu, {rows, cols}));
    }
    optim::NewtonSchulz ns;
    ns.bf16 = bf16;
    ns.batch_bytes =
        std::size_t(2 * (3 * rows * cols + 3 * std::min(rows, cols) * std::min(rows, cols))) * (bf16 ? 2 : 4);
    optim::newton_schulz(us, os, ns, work);
    for (int b = 0; b < B; ++b) {
      const auto matrix = [&](const std::vector<float>& v) {
        return std::vector<float>(v.begin() + b * stride, v.begin() + b * stride + rows * cols);
      };
      out["newton_schulz"].push_back({{"rows", rows},
                                      {"cols", cols},
                                      {"bf16", bf16},
                                      {"steps", ns.steps},
                                      {"coefficients", {ns.a, ns.b, ns.c}},
                                      {"eps", ns.eps},
                                      {"u", matrix(u)},
                                      {"o", matrix(o)},
                                      {"batched", std::to_string(b + 1) + " of " + std::to_string(B)}});
    }
  }
  const std::vector<std::pair<std::string, std::string>> runs{
      {R"({"arch": "gpt2", "vocab_size": 32, "context_length": 8, "n_layer": 1, "n_head": 2, "d_model": 16})",
       R"({"name": "muon", "lr": 0.01, "weight_decay": 0.1, "muon": {"lr": 0.05, "weight_decay": 0.2}})"},
      {R"({"arch": "llama", "vocab_size": 32, "context_length": 8, "n_layer": 1, "n_head": 4, "n_kv_head": 2, "d_model": 16,
           "ffn_hidden": 24})",
       R"({"name": "muon", "lr": 0.02, "muon": {"nesterov": false, "adjust_lr": "original", "ns_steps": 4, "momentum": 0.9}})"},
      // A MoE layer after a dense one: each expert's matrices and the shared expert's by Muon, the
      // router (and its expert bias) by AdamW.
      {R"({"arch": "llama", "vocab_size": 32, "context_length": 8, "n_layer": 2, "n_head": 4, "n_kv_head": 2, "d_model": 16,
           "ffn_hidden": 24, "moe": {"experts": 3, "top_k": 2, "ffn_hidden": 8, "shared_experts": 1, "first_dense_layers": 1,
           "router": "sigmoid"}})",
       R"({"name": "muon", "lr": 0.02, "weight_decay": 0.1})"}};
  for (const auto& [model_json, optim_json] : runs) {
    const config::Config c = config::parse_config(R"({"model": )" + model_json + R"(, "optim": )" + optim_json + "}", "c.json", {});
    const auto model = model::make_model(c.model, Device::cpu);
    const std::int64_t P = model->num_params();
    auto optimizer = optim::make_optimizer(c.optim, model->param_infos(), {optim::Piece{{0, P}, 0}});
    std::vector<float> w = random_normal(rng, std::size_t(P), 0.05f);
    nlohmann::json run = {{"optim", config::to_json(c)["optim"]}, {"initial", w}};
    for (const model::ParamInfo& info : model->param_infos()) {
      run["params"].push_back({{"name", info.name}, {"offset", info.offset}, {"shape", info.shape}, {"decay", info.decay}});
    }
    for (const optim::MuonMatrix& m : optim::muon_matrices(model->param_infos())) {
      run["matrices"].push_back({{"name", m.name}, {"offset", m.offset}, {"rows", m.rows}, {"cols", m.cols}});
    }
    // Four updates: warming up, clipped (norm over the clip) and not, the learning rate changing.
    const double lrs[] = {0.5, 1.0, 0.8, 0.3}, clips[] = {0.0, 1.0, 1.0, 100.0};
    for (int step = 1; step <= 4; ++step) {
      std::vector<float> g = random_normal(rng, std::size_t(P), 0.4f);
      double squares = 0.0;
      for (const float x : g) squares += double(x) * x;
      const double lr = lrs[step - 1] * c.optim.lr;
      optimizer->update({model->param_infos(), Tensor(w.data(), DType::f32, Device::cpu, {P}),
                         Tensor(g.data(), DType::f32, Device::cpu, {P}), std::sqrt(squares), clips[step - 1], lr, step});
      run["steps"].push_back({{"grad", g}, {"grad_norm", std::sqrt(squares)}, {"grad_clip", clips[step - 1]},
                              {"lr", lr}, {"weights", w}});
    }
    const auto* muon = dynamic_cast<const optim::Muon*>(optimizer.get());
    REQUIRE(muon);
    // Laid out like the weights for the reference: zero outside the matrices, where Muon keeps none.
    const float* kept = muon->momentum().as<float>();
    std::vector<float> momentum(std::size_t(P), 0.0f);
    std::int64_t at = 0;
    for (const model::FlatRange& r : muon->muon_runs()) {
      std::copy(kept + at, kept + at + r.size(), momentum.begin() + r.begin);
      at += r.size();
    }
    CHECK(at == muon->momentum().numel());
    run["momentum"] = momentum;
    out["runs"].push_back(std::move(run));
  }
  std::ofstream(path) << out.dump();
}
