// Hugging Face GPT-2 export and import: names and shapes as GPT2LMHeadModel has them, and a
// bit-exact round trip.
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>

#include <nlohmann/json.hpp>

#include "catch_compat.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/safetensors.h"
#include "core/error.h"
#include "process.h"

using namespace llmtrain;

namespace {

config::ModelConfig small_config() {
  config::ModelConfig c;
  c.vocab_size = 50;
  c.context_length = 12;
  c.n_layer = 2;
  c.n_head = 2;
  c.n_kv_head = 2;
  c.d_model = 8;
  c.ffn_hidden = 32;
  return c;
}

}  // namespace

TEST_CASE("export writes GPT2LMHeadModel's names, shapes and config", "[checkpoint][export]") {
  test::TempDir dir;
  model::Gpt2 m(small_config(), Device::cpu);
  m.init_weights(3);
  checkpoint::export_hf(m, dir.path());

  // transformers' GPT-2 state dict (Conv1D weights are (in, out)), for n_embd 8, n_inner 32,
  // n_positions 12, vocab 50, written from its documentation.
  std::map<std::string, std::vector<std::int64_t>> expected = {
      {"transformer.wte.weight", {50, 8}}, {"transformer.wpe.weight", {12, 8}},
      {"transformer.ln_f.weight", {8}},    {"transformer.ln_f.bias", {8}}};
  for (int l = 0; l < 2; ++l) {
    const std::string h = "transformer.h." + std::to_string(l) + ".";
    expected[h + "ln_1.weight"] = {8};
    expected[h + "ln_1.bias"] = {8};
    expected[h + "attn.c_attn.weight"] = {8, 24};
    expected[h + "attn.c_attn.bias"] = {24};
    expected[h + "attn.c_proj.weight"] = {8, 8};
    expected[h + "attn.c_proj.bias"] = {8};
    expected[h + "ln_2.weight"] = {8};
    expected[h + "ln_2.bias"] = {8};
    expected[h + "mlp.c_fc.weight"] = {8, 32};
    expected[h + "mlp.c_fc.bias"] = {32};
    expected[h + "mlp.c_proj.weight"] = {32, 8};
    expected[h + "mlp.c_proj.bias"] = {8};
  }
  const checkpoint::SafetensorsReader file(dir.path() + "/model.safetensors");
  CHECK(file.tensors().size() == expected.size());
  for (const auto& [name, shape] : expected) {
    CAPTURE(name);
    const auto* t = file.find(name);
    REQUIRE(t != nullptr);
    CHECK(t->shape == shape);
    CHECK(t->dtype == checkpoint::StDtype::f32);
  }
  // Conv1D layout: HF's c_attn.weight[i][o] is our qkv weight[o][i].
  const auto& info = m.param_info("transformer.h.1.attn.c_attn.weight");
  std::vector<float> hf(24 * 8);
  file.read_f32("transformer.h.1.attn.c_attn.weight", hf);
  CHECK(hf[3 * 24 + 17] == m.param(info).as<float>()[17 * 8 + 3]);

  std::ifstream config_file(dir.path() + "/config.json");
  const auto config = nlohmann::json::parse(config_file);
  CHECK(config["architectures"][0] == "GPT2LMHeadModel");
  CHECK(config["model_type"] == "gpt2");
  CHECK(config["n_embd"] == 8);
  CHECK(config["n_layer"] == 2);
  CHECK(config["n_head"] == 2);
  CHECK(config["n_positions"] == 12);
  CHECK(config["n_inner"] == 32);
  CHECK(config["vocab_size"] == 50);
  CHECK(config["activation_function"] == "gelu_new");
}

TEST_CASE("export then init_from round-trips the weights bit for bit", "[checkpoint][export]") {
  test::TempDir dir;
  model::Gpt2 a(small_config(), Device::cpu), b(small_config(), Device::cpu);
  a.init_weights(11);
  b.init_weights(12);
  REQUIRE(std::memcmp(a.params().data, b.params().data, a.params().bytes()) != 0);
  checkpoint::export_hf(a, dir.path());
  checkpoint::import_hf(dir.path(), b);
  CHECK(std::memcmp(a.params().data, b.params().data, a.params().bytes()) == 0);
}

TEST_CASE("init_from rejects files that do not fit the model, naming file and tensor", "[checkpoint][export]") {
  test::TempDir dir;
  model::Gpt2 a(small_config(), Device::cpu);
  a.init_weights(1);
  checkpoint::export_hf(a, dir.path());
  auto bigger = small_config();
  bigger.d_model = 16;
  bigger.ffn_hidden = 64;
  model::Gpt2 b(bigger, Device::cpu);
  try {
    checkpoint::import_hf(dir.path(), b);
    FAIL("no error");
  } catch (const InputError& e) {
    CHECK(std::string(e.what()).find(dir.path() + "/model.safetensors: tensor transformer.ln_f.weight has shape [8 ]") == 0);
  }
  CHECK_THROWS_AS(checkpoint::import_hf(dir.path() + "/nothing-here", b), InputError);
}
