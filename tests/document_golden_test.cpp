// Packed sequences (data.document_mask, data.reset_positions) in GPT-2 and Llama against the
// golden files of scripts/gen_document_reference.py: PyTorch's scaled_dot_product_attention with
// the boolean block-causal mask (and position ids reset per document), float64, over two
// sequences of 3 and 4 documents. Loss, logits and every parameter gradient within 1e-5. And the
// keys' resolution at start-up: the end-of-text id from tokenizer.json, one-line refusals.
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "catch_compat.h"
#include "checkpoint/safetensors.h"
#include "golden_reference.h"
#include "model/documents.h"
#include "model/model.h"

using namespace llmtrain;
using namespace llmtrain::test::golden;  // read, read_i32, relative_error

namespace {

void check_documents(const std::string& arch, const std::string& variant, model::Recompute recompute) {
  const checkpoint::SafetensorsReader file(LLMTRAIN_SOURCE_DIR "/tests/data/" + arch + "_documents_reference.safetensors");
  const auto& meta = file.metadata();
  config::ModelConfig c;
  c.arch = *config::parse_choice<config::Arch>(arch);
  const int B = std::stoi(meta.at("B")), T = std::stoi(meta.at("T"));
  c.vocab_size = std::stoi(meta.at("V"));
  c.context_length = std::stoi(meta.at("maxT"));
  c.n_layer = std::stoi(meta.at("L"));
  c.n_head = std::stoi(meta.at("NH"));
  c.n_kv_head = meta.contains("NKV") ? std::stoi(meta.at("NKV")) : c.n_head;
  c.tie_embeddings = arch == "gpt2";
  if (arch == "llama") {
    c.rope_theta = std::stod(meta.at("rope_theta"));
    c.norm_eps = std::stod(meta.at("norm_eps"));
  }
  c.d_model = std::stoi(meta.at("C"));
  c.ffn_hidden = std::stoi(meta.at("F"));
  const std::vector<std::int32_t> inputs = read_i32(file, "inputs"), targets = read_i32(file, "targets");
  auto owner = model::make_model(c, Device::cpu, recompute);
  model::Model& m = *owner;
  for (const auto& info : m.param_infos()) {
    file.read_f32("param/" + info.name, std::span<float>(m.param(info).as<float>(), std::size_t(info.numel)));
  }
  m.set_documents({std::stoi(meta.at("eot")), true, variant == "reset"});
  const double n = double(B) * T;
  const double loss = m.forward(inputs.data(), targets.data(), B, T, 0.0f) / n;
  const float reference = read(file, variant + "/loss")[0];
  CAPTURE(arch, variant, loss, reference);
  CHECK(std::abs(loss - reference) / reference < 1e-5);
  CHECK(relative_error(m.logits().as<float>(), read(file, variant + "/logits")) < 1e-5);
  m.zero_grads();
  m.forward(inputs.data(), targets.data(), B, T, float(1.0 / n));
  m.backward();
  for (const auto& info : m.param_infos()) {
    const double error = relative_error(m.grad(info).as<float>(), read(file, variant + "/grad/" + info.name));
    CAPTURE(info.name, error);
    CHECK(error < 1e-5);
  }
}

}  // namespace

TEST_CASE("GPT-2 over packed documents matches PyTorch's block-causal attention", "[model][golden][documents]") {
  check_documents("gpt2", "mask", model::Recompute::none);
  check_documents("gpt2", "reset", model::Recompute::none);
  check_documents("gpt2", "reset", model::Recompute::full);
}

TEST_CASE("Llama over packed documents matches PyTorch's block-causal attention", "[model][golden][documents][llama]") {
  check_documents("llama", "mask", model::Recompute::none);
  check_documents("llama", "reset", model::Recompute::none);
  check_documents("llama", "reset", model::Recompute::full);
}

namespace {

// The message of what f throws ("" if nothing).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("document keys take the end-of-text id beside the shards and refuse what cannot mask", "[model][documents]") {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "llmtrain_documents_test";
  std::filesystem::create_directories(dir / "bpe");
  std::filesystem::create_directories(dir / "byte");
  std::ofstream(dir / "bpe" / "tokenizer.json") << R"({"kind": "gpt2", "vocab_size": 50257, "eot_token": 50256})";
  std::ofstream(dir / "byte" / "tokenizer.json") << R"({"kind": "byte", "vocab_size": 256, "eot_token": null})";
  config::DataConfig data;
  config::ModelConfig model;
  model.vocab_size = 50257;
  const auto resolve = [&](const std::string& sub, Device device, config::Attention attention) {
    model.attention = attention;
    return model::documents_for(data, model, (dir / sub).string(), device);
  };
  CHECK_FALSE(resolve("byte", Device::cpu, config::Attention::automatic).active());  // neither key: nothing read
  data.document_mask = true;
  const model::Model::Documents d = resolve("bpe", Device::cpu, config::Attention::automatic);
  CHECK(d.eot == 50256);
  CHECK(d.mask);
  CHECK_FALSE(d.reset_positions);
  const std::string no_eot = error_of([&] { resolve("byte", Device::cpu, config::Attention::automatic); });
  CAPTURE(no_eot);
  CHECK(no_eot.find("data.document_mask: the tokenizer recorded in") == 0);
  CHECK(no_eot.find("byte/tokenizer.json has no end-of-text token") != std::string::npos);
  const std::string cudnn = error_of([&] { resolve("bpe", Device::cuda, config::Attention::cudnn); });
  CAPTURE(cudnn);
  CHECK(cudnn.find("data.document_mask: cuDNN's attention (model.attention \"cudnn\") has no document mask") == 0);
  CHECK(resolve("bpe", Device::cuda, config::Attention::flash).mask);  // the CUDA flash path has the mask
  data.document_mask = false;
  data.reset_positions = true;  // positions alone: on either device
  CHECK(resolve("bpe", Device::cpu, config::Attention::flash).reset_positions);
  CHECK(resolve("bpe", Device::cuda, config::Attention::flash).reset_positions);
  CHECK(error_of([&] { resolve("byte", Device::cpu, config::Attention::flash); }).find("data.reset_positions:") == 0);

  // The id must be a token of the tokenizer and a row of the model: never cut to 32 bits, never
  // past either vocabulary, never a string.
  const auto eot_error = [&](const std::string& record, std::int64_t model_vocab) {
    std::ofstream(dir / "bpe" / "tokenizer.json") << record;
    model.vocab_size = model_vocab;
    return error_of([&] { resolve("bpe", Device::cpu, config::Attention::automatic); });
  };
  const std::string file = (dir / "bpe" / "tokenizer.json").string();
  CHECK(eot_error(R"({"kind": "gpt2", "vocab_size": 50257, "eot_token": 4294967494})", 50257) ==
        file + ": eot_token (below model.vocab_size 50257): expected an integer from 0 to 50256, got 4294967494");
  CHECK(eot_error(R"({"kind": "byte", "vocab_size": 256, "eot_token": 70000})", 300) ==
        file + ": eot_token (below its vocab_size 256): expected an integer from 0 to 255, got 70000");
  CHECK(eot_error(R"({"kind": "gpt2", "eot_token": 50256})", 300) ==
        file + ": eot_token (below model.vocab_size 300): expected an integer from 0 to 299, got 50256");
  CHECK(eot_error(R"({"kind": "gpt2", "vocab_size": 50257, "eot_token": "50256"})", 50257) ==
        file + ": eot_token (below model.vocab_size 50257): expected an integer from 0 to 50256, got \"50256\"");
  CHECK(eot_error(R"({"kind": "gpt2", "vocab_size": 50257, "eot_token": -1})", 50257).find("got -1") != std::string::npos);
  CHECK(eot_error(R"({"kind": "gpt2", "vocab_size": "big", "eot_token": 10})", 50257) ==
        file + ": vocab_size: expected an integer from 1 to 2147483647, got \"big\"");
  CHECK(eot_error(R"({"kind": "byte", "vocab_size": 256, "eot_token": 10})", 300).empty());  // in range: taken
  std::filesystem::remove_all(dir);
}
