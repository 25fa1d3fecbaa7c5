// Hugging Face export and import: names and shapes as GPT2LMHeadModel and LlamaForCausalLM have
// them, bit-exact round trips, sharded checkpoints, and clear errors for files that do not fit.
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>

#include <nlohmann/json.hpp>

#include "catch_compat.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/safetensors.h"
#include "model/gpt2.h"
#include "model/llama.h"
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

// A Llama with grouped-query attention (4 query heads, 2 key/value heads of size 4).
config::ModelConfig small_llama(bool tied = false) {
  config::ModelConfig c;
  c.arch = config::Arch::llama;
  c.vocab_size = 50;
  c.context_length = 12;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_kv_head = 2;
  c.d_model = 16;
  c.ffn_hidden = 40;
  c.rope_theta = 500000.0;
  c.norm_eps = 1e-6;
  c.tie_embeddings = tied;
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

TEST_CASE("export writes LlamaForCausalLM's names, shapes and config", "[checkpoint][export][llama]") {
  for (const bool tied : {false, true}) {
    CAPTURE(tied);
    test::TempDir dir;
    model::Llama m(small_llama(tied), Device::cpu);
    m.init_weights(3);
    checkpoint::export_hf(m, dir.path());

    // LlamaForCausalLM's state dict for hidden_size 16, intermediate_size 40, 4 attention heads,
    // 2 key/value heads (head_dim 4), vocab 50, written from its documentation: nn.Linear
    // weights are (out_features, in_features), no biases; lm_head only when untied.
    std::map<std::string, std::vector<std::int64_t>> expected = {{"model.embed_tokens.weight", {50, 16}},
                                                                 {"model.norm.weight", {16}}};
    if (!tied) expected["lm_head.weight"] = {50, 16};
    for (int l = 0; l < 2; ++l) {
      const std::string h = "model.layers." + std::to_string(l) + ".";
      expected[h + "input_layernorm.weight"] = {16};
      expected[h + "self_attn.q_proj.weight"] = {16, 16};
      expected[h + "self_attn.k_proj.weight"] = {8, 16};
      expected[h + "self_attn.v_proj.weight"] = {8, 16};
      expected[h + "self_attn.o_proj.weight"] = {16, 16};
      expected[h + "post_attention_layernorm.weight"] = {16};
      expected[h + "mlp.gate_proj.weight"] = {40, 16};
      expected[h + "mlp.up_proj.weight"] = {40, 16};
      expected[h + "mlp.down_proj.weight"] = {16, 40};
    }
    const checkpoint::SafetensorsReader file(dir.path() + "/model.safetensors");
    CHECK(file.tensors().size() == expected.size());
    for (const auto& [name, shape] : expected) {
      CAPTURE(name);
      const auto* t = file.find(name);
      REQUIRE(t != nullptr);
      CHECK(t->shape == shape);
    }
    const auto config = nlohmann::json::parse(std::ifstream(dir.path() + "/config.json"));
    CHECK(config["architectures"][0] == "LlamaForCausalLM");
    CHECK(config["model_type"] == "llama");
    CHECK(config["hidden_size"] == 16);
    CHECK(config["intermediate_size"] == 40);
    CHECK(config["num_hidden_layers"] == 2);
    CHECK(config["num_attention_heads"] == 4);
    CHECK(config["num_key_value_heads"] == 2);
    CHECK(config["max_position_embeddings"] == 12);
    CHECK(config["vocab_size"] == 50);
    CHECK(config["rope_theta"] == 500000.0);
    CHECK(config["rms_norm_eps"] == 1e-6);
    CHECK(config["hidden_act"] == "silu");
    CHECK(config["tie_word_embeddings"] == tied);
  }
}

TEST_CASE("Llama export then init_from round-trips the weights bit for bit", "[checkpoint][export][llama]") {
  test::TempDir dir;
  model::Llama a(small_llama(), Device::cpu), b(small_llama(), Device::cpu);
  a.init_weights(11);
  b.init_weights(12);
  REQUIRE(std::memcmp(a.params().data, b.params().data, a.params().bytes()) != 0);
  checkpoint::export_hf(a, dir.path());
  checkpoint::import_hf(dir.path(), b);
  CHECK(std::memcmp(a.params().data, b.params().data, a.params().bytes()) == 0);
}

namespace {

// Reads scattered ranges of the whole model (odd starts and lengths, across tensors and through
// the rows of GPT-2's transposed Conv1D weights) from `dir` and checks them against `m`'s weights,
// bit for bit, and that exactly their bytes were read.
void check_ranges_read(const model::Model& m, const std::string& dir) {
  const std::int64_t n = m.params().numel();
  std::vector<model::FlatRange> ranges;
  std::uint64_t x = 12345;
  for (std::int64_t at = 3; at < n;) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    const std::int64_t length = 1 + std::int64_t((x >> 33) % 97);
    ranges.push_back({at, std::min(n, at + length)});
    at += length + std::int64_t((x >> 20) % 53);
  }
  std::reverse(ranges.begin(), ranges.end());  // any order: each lands where the list puts it
  std::int64_t wanted = 0;
  for (const auto& r : ranges) wanted += r.size();
  std::vector<float> out(std::size_t(wanted), -1.0f);
  const std::size_t bytes = checkpoint::import_hf_ranges(dir, m, ranges, out.data());
  CHECK(bytes == std::size_t(wanted) * sizeof(float));
  const float* w = m.params().as<float>();
  std::int64_t at = 0, differ = 0;
  for (const auto& r : ranges) {
    for (std::int64_t i = r.begin; i < r.end; ++i) differ += std::memcmp(&out[std::size_t(at++)], &w[i], 4) != 0;
  }
  CHECK(differ == 0);
}

}  // namespace

TEST_CASE("init_from of scattered ranges reads only their bytes and gives the weights bit for bit",
          "[checkpoint][export]") {
  test::TempDir gpt2_dir, llama_dir;
  model::Gpt2 g(small_config(), Device::cpu);
  g.init_weights(5);
  checkpoint::export_hf(g, gpt2_dir.path());
  check_ranges_read(g, gpt2_dir.path());
  model::Llama l(small_llama(), Device::cpu);
  l.init_weights(6);
  checkpoint::export_hf(l, llama_dir.path());
  check_ranges_read(l, llama_dir.path());
}

TEST_CASE("init_from reads sharded checkpoints and checks a Llama folder's config.json", "[checkpoint][export][llama]") {
  test::TempDir dir;
  model::Llama a(small_llama(), Device::cpu);
  a.init_weights(5);
  checkpoint::export_hf(a, dir.path() + "/one");
  // Split the export into two shards with an index, as large Hugging Face checkpoints come.
  const checkpoint::SafetensorsReader whole(dir.path() + "/one/model.safetensors");
  std::vector<checkpoint::TensorToWrite> first, second;
  nlohmann::json weight_map = nlohmann::json::object();
  for (const auto& t : whole.tensors()) {
    const bool in_first = t.name.find("layers.1.") == std::string::npos;
    (in_first ? first : second).push_back({t.name, t.dtype, t.shape, whole.data(t).data()});
    weight_map[t.name] = in_first ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
  }
  const std::string sharded = dir.path() + "/sharded";
  std::filesystem::create_directories(sharded);
  checkpoint::write_safetensors(sharded + "/model-00001-of-00002.safetensors", first, {});
  checkpoint::write_safetensors(sharded + "/model-00002-of-00002.safetensors", second, {});
  std::ofstream(sharded + "/model.safetensors.index.json") << nlohmann::json{{"weight_map", weight_map}}.dump();
  std::filesystem::copy_file(dir.path() + "/one/config.json", sharded + "/config.json");

  model::Llama b(small_llama(), Device::cpu);
  checkpoint::import_hf(sharded, b);
  CHECK(std::memcmp(a.params().data, b.params().data, a.params().bytes()) == 0);

  // The folder's config.json says rope_theta 500000; a run configured otherwise is refused.
  auto other = small_llama();
  other.rope_theta = 10000.0;
  model::Llama c(other, Device::cpu);
  try {
    checkpoint::import_hf(sharded, c);
    FAIL("no error");
  } catch (const InputError& e) {
    CHECK(std::string(e.what()).find("model.rope_theta: the config has 10000, but " + sharded + "/config.json") == 0);
  }
  // An untied config against a tied export: lm_head.weight is missing.
  test::TempDir tied_dir;
  model::Llama tied(small_llama(true), Device::cpu);
  tied.init_weights(2);
  checkpoint::export_hf(tied, tied_dir.path());
  std::filesystem::remove(tied_dir.path() + "/config.json");
  try {
    checkpoint::import_hf(tied_dir.path(), c);
    FAIL("no error");
  } catch (const InputError& e) {
    CHECK(std::string(e.what()) == tied_dir.path() + "/model.safetensors: tensor lm_head.weight is missing");
  }
}

TEST_CASE("model.qk_norm exports Qwen3ForCausalLM (q_norm, k_norm, config) and reads it back bit for bit",
          "[checkpoint][export][llama]") {
  test::TempDir dir;
  auto qwen = small_llama();
  qwen.qk_norm = true;
  model::Llama a(qwen, Device::cpu), b(qwen, Device::cpu);
  a.init_weights(21);
  // Norm weights start at 1: make them differ so that the round trip shows.
  for (const auto& info : a.param_infos()) {
    if (info.shape.size() == 1) {
      for (std::int64_t i = 0; i < info.numel; ++i) a.param(info).as<float>()[i] = 1.0f + 0.01f * float(i);
    }
  }
  b.init_weights(22);
  checkpoint::export_hf(a, dir.path());
  // Qwen3Attention's norms: one (head_dim,) weight each for the query and key heads.
  const checkpoint::SafetensorsReader file(dir.path() + "/model.safetensors");
  for (int l = 0; l < 2; ++l) {
    for (const char* norm : {"q_norm", "k_norm"}) {
      const auto* t = file.find("model.layers." + std::to_string(l) + ".self_attn." + norm + ".weight");
      REQUIRE(t != nullptr);
      CHECK(t->shape == std::vector<std::int64_t>{4});
    }
  }
  CHECK(file.tensors().size() == 9 * 2 + 2 * 2 + 3);  // the Llama layer's 9, two norms, the 3 ends
  const auto config = nlohmann::json::parse(std::ifstream(dir.path() + "/config.json"));
  CHECK(config["architectures"][0] == "Qwen3ForCausalLM");
  CHECK(config["model_type"] == "qwen3");
  CHECK(config["head_dim"] == 4);
  CHECK(config["rope_parameters"]["rope_theta"] == 500000.0);
  CHECK(config["tie_word_embeddings"] == false);
  checkpoint::import_hf(dir.path(), b);
  CHECK(std::memcmp(a.params().data, b.params().data, a.params().bytes()) == 0);
  check_ranges_read(a, dir.path());  // the ranged reads each rank makes, through the norms too

  // A Llama config without qk_norm refuses the norms, naming the key to set.
  model::Llama plain(small_llama(), Device::cpu);
  try {
    checkpoint::import_hf(dir.path(), plain);
    FAIL("no error");
  } catch (const InputError& e) {
    CHECK(std::string(e.what()).find("unexpected tensor model.layers.") != std::string::npos);
    CHECK(std::string(e.what()).find("set model.qk_norm true") != std::string::npos);
  }
  // transformers 5 writes the rotary base only inside rope_parameters: it is still checked.
  auto file_config = config;
  file_config.erase("rope_theta");
  std::ofstream(dir.path() + "/config.json") << file_config.dump();
  auto other = qwen;
  other.rope_theta = 10000.0;
  model::Llama c(other, Device::cpu);
  CHECK_THROWS_AS(checkpoint::import_hf(dir.path(), c), InputError);
  // A head size other than d_model / n_head (as Qwen3-0.6B's) is named before any shape.
  file_config["head_dim"] = 8;
  std::ofstream(dir.path() + "/config.json") << file_config.dump();
  try {
    checkpoint::import_hf(dir.path(), b);
    FAIL("no error");
  } catch (const InputError& e) {
    CHECK(std::string(e.what()).find("model.d_model / model.n_head: the config has 4, but ") == 0);
    CHECK(std::string(e.what()).find("has head_dim = 8") != std::string::npos);
  }
}
