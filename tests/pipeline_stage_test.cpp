// Pipeline stages of one model, run in one process: the stages' forward and backward, handing the
// boundary activations and their gradients from one to the next by hand (as the pipeline's
// transfers do), give the whole model's losses and gradients; micro-batches in flight keep their
// activations apart in slots.
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "catch_compat.h"
#include "model/model.h"
#include "ops/buffer.h"

using namespace llmtrain;

namespace {

config::ModelConfig tiny(const std::string& arch, bool tied) {
  config::ModelConfig c;
  c.arch = *config::parse_choice<config::Arch>(arch);
  c.vocab_size = 61;
  c.context_length = 12;
  c.n_layer = 5;
  c.n_head = 2;
  c.n_kv_head = arch == "llama" ? 1 : 2;
  c.d_model = 16;
  c.ffn_hidden = arch == "llama" ? 24 : 64;
  c.tie_embeddings = tied;
  return c;
}

// Each stage's weights from the whole model's, through its place in the whole flat buffer.
void take_weights(const model::Model& whole, model::Model& stage) {
  for (const model::Segment& s : stage.segments(false)) {
    ops::copy(Tensor(stage.params().as<float>() + s.local, DType::f32, Device::cpu, {s.length}),
              Tensor(whole.params().as<float>() + s.logical, DType::f32, Device::cpu, {s.length}));
  }
}

void check_stages(const std::string& arch, bool tied, const std::vector<int>& layers_per_stage) {
  CAPTURE(arch, tied, layers_per_stage.size());
  const auto c = tiny(arch, tied);
  const auto whole = model::make_model(c, Device::cpu);
  whole->init_weights(3);
  std::vector<std::unique_ptr<model::Model>> stages;
  int first = 0;
  for (const int n : layers_per_stage) {
    model::Layout layout;
    layout.first_layer = first;
    layout.layers = n;
    stages.push_back(model::make_model(c, Device::cpu, model::Recompute::none, DType::f32,
                                       ops::AttentionKernels::flash, layout));
    take_weights(*whole, *stages.back());
    stages.back()->set_activation_slots(2);
    first += n;
  }
  const int B = 2, T = 11, M = 2;  // two micro-batches, both forwarded before either goes back
  const double n = double(B) * T;
  std::vector<std::vector<std::int32_t>> inputs(M), targets(M);
  for (int m = 0; m < M; ++m) {
    for (int i = 0; i < B * T; ++i) {
      inputs[std::size_t(m)].push_back(std::int32_t((i * 7 + m * 13) % c.vocab_size));
      targets[std::size_t(m)].push_back(std::int32_t((i * 5 + m * 3 + 1) % c.vocab_size));
    }
  }
  whole->zero_grads();
  std::vector<double> expected;
  for (int m = 0; m < M; ++m) {
    expected.push_back(whole->forward(inputs[std::size_t(m)].data(), targets[std::size_t(m)].data(), B, T, float(1.0 / n)));
    whole->backward();
  }
  for (auto& s : stages) s->zero_grads();
  std::vector<double> got(M, 0.0);
  for (int m = 0; m < M; ++m) {  // forward of both micro-batches through every stage
    for (std::size_t s = 0; s < stages.size(); ++s) {
      stages[s]->prepare_activations(B, T);
      stages[s]->use_activation_slot(m);
      if (s > 0) ops::copy(stages[s]->stage_io().input, stages[s - 1]->stage_io().output);
      got[std::size_t(m)] = stages[s]->forward(inputs[std::size_t(m)].data(), targets[std::size_t(m)].data(), B, T,
                                               float(1.0 / n));
    }
  }
  for (int m = M; m-- > 0;) {  // backward, the later micro-batch first
    for (std::size_t s = stages.size(); s-- > 0;) {
      stages[s]->use_activation_slot(m);
      if (s + 1 < stages.size()) ops::copy(stages[s]->stage_io().output_grad, stages[s + 1]->stage_io().input_grad);
      stages[s]->backward();
    }
  }
  for (int m = 0; m < M; ++m) {
    CAPTURE(m, got[std::size_t(m)], expected[std::size_t(m)]);
    CHECK(std::abs(got[std::size_t(m)] - expected[std::size_t(m)]) <= 1e-6 * std::abs(expected[std::size_t(m)]));
  }
  // Every gradient, summed over the stages that hold it (a tied embedding: the first and the last).
  std::vector<double> summed(std::size_t(whole->num_params()), 0.0);
  std::vector<int> holders(summed.size(), 0);
  for (const auto& s : stages) {
    for (const model::Segment& seg : s->segments(false)) {
      for (std::int64_t i = 0; i < seg.length; ++i) {
        summed[std::size_t(seg.logical + i)] += s->grads().as<float>()[seg.local + i];
        holders[std::size_t(seg.logical + i)] += 1;
      }
    }
  }
  double diff = 0, norm = 0;
  std::int64_t unheld = 0;
  for (std::size_t i = 0; i < summed.size(); ++i) {
    unheld += holders[i] == 0;
    const double g = whole->grads().as<float>()[i];
    diff += (summed[i] - g) * (summed[i] - g);
    norm += g * g;
  }
  CAPTURE(diff, norm);
  CHECK(unheld == 0);
  CHECK(std::sqrt(diff / norm) < 1e-6);
  std::int64_t held = 0;
  for (const auto& s : stages) held += s->num_params();
  const std::int64_t embedding = c.vocab_size * c.d_model;
  CHECK(held == whole->num_params() + (tied && layers_per_stage.size() > 1 ? embedding : 0));
}

}  // namespace

TEST_CASE("GPT-2 split into pipeline stages gives the whole model's losses and gradients", "[model][pipeline]") {
  check_stages("gpt2", true, {2, 3});
  check_stages("gpt2", true, {1, 2, 1, 1});
}

TEST_CASE("Llama split into pipeline stages gives the whole model's losses and gradients", "[model][pipeline][llama]") {
  check_stages("llama", false, {3, 2});
  check_stages("llama", true, {1, 1, 3});
}
