// Packed sequences (data.document_mask, data.reset_positions) in GPT-2 and Llama against the
// golden files of scripts/gen_document_reference.py: PyTorch's scaled_dot_product_attention with
// the boolean block-causal mask (and position ids reset per document), float64, over two
// sequences of 3 and 4 documents. Loss, logits and every parameter gradient within 1e-5.
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "catch_compat.h"
#include "checkpoint/safetensors.h"
#include "model/model.h"

using namespace llmtrain;

namespace {

std::vector<float> read(const checkpoint::SafetensorsReader& r, const std::string& name) {
  const auto* info = r.find(name);
  REQUIRE(info != nullptr);
  std::vector<float> out(std::size_t(info->numel()));
  r.read_f32(name, out);
  return out;
}

std::vector<std::int32_t> read_i32(const checkpoint::SafetensorsReader& r, const std::string& name) {
  const auto* info = r.find(name);
  REQUIRE(info != nullptr);
  const auto bytes = r.data(*info);
  std::vector<std::int32_t> out(bytes.size() / 4);
  std::memcpy(out.data(), bytes.data(), bytes.size());
  return out;
}

double relative_error(const float* a, const std::vector<float>& b) {
  double diff = 0.0, ref = 0.0;
  for (std::size_t i = 0; i < b.size(); ++i) {
    diff += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    ref += double(b[i]) * b[i];
  }
  return std::sqrt(diff / ref);
}

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
