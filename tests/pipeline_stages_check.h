// Pipeline stages of one model run in one process: the stages' forwards and backwards, with the
// boundary activations and their gradients handed from one virtual stage to the next by hand (as
// the pipeline's transfers do), give the whole model's losses and gradients. Micro-batches and
// model chunks in flight keep their activations apart in slots. Shared by the CPU test
// (pipeline_stage_test.cpp) and the CUDA one (cuda_model_test.cpp: stages on the device, the whole
// model on the CPU as the reference).
#pragma once

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "catch_compat.h"
#include "cuda_compare.h"
#include "model/model.h"
#include "ops/buffer.h"
#include "parallel/pipeline_stages.h"

namespace llmtrain::test {

inline config::ModelConfig tiny_pipeline_model(const std::string& arch, bool tied) {
  config::ModelConfig c;
  c.arch = *config::parse_choice<config::Arch>(arch);
  c.vocab_size = 61;
  c.context_length = 12;
  c.n_layer = 5;
  c.n_head = 2;
  c.n_kv_head = arch == "llama" ? 1 : 2;
  c.d_model = 32;  // head size 16, the smallest the CUDA flash attention takes
  c.ffn_hidden = arch == "llama" ? 48 : 128;
  c.tie_embeddings = tied;
  return c;
}

/// Splits a tiny model into stages, stage s holding the model chunks chunks_per_stage[s] (virtual
/// stage v is chunk v / P of stage v % P, as the interleaved schedule places them; one chunk each
/// for 1F1B), built on `device`, and checks two micro-batches through them against the whole
/// model on the CPU: losses within `tolerance` relative, every gradient (summed over the stages
/// holding it) within `tolerance` in relative norm.
inline void check_pipeline_stages(const std::string& arch, bool tied,
                                  const std::vector<std::vector<parallel::StageRange>>& chunks_per_stage, Device device,
                                  double tolerance) {
  const int P = int(chunks_per_stage.size()), V = int(chunks_per_stage.front().size());
  CAPTURE(arch, tied, P, V);
  const auto c = tiny_pipeline_model(arch, tied);
  const auto whole = model::make_model(c, Device::cpu);
  whole->init_weights(3);
  const int B = 2, T = 11, M = 2;  // two micro-batches, both forwarded before either goes back
  std::vector<std::unique_ptr<model::Model>> stages;
  for (const auto& chunks : chunks_per_stage) {
    REQUIRE(int(chunks.size()) == V);
    model::Layout layout;
    for (const parallel::StageRange& chunk : chunks) layout.layer_ranges.push_back(parallel::layer_range(chunk));
    stages.push_back(model::make_model(c, device, model::Recompute::none, DType::f32, ops::AttentionKernels::flash, layout));
    model::Model& stage = *stages.back();
    // The stage's weights from the whole model's, through its place in the whole flat buffer.
    for (const model::Segment& s : stage.segments(false)) {
      ops::copy(Tensor(stage.params().as<float>() + s.local, DType::f32, device, {s.length}),
                Tensor(whole->params().as<float>() + s.logical, DType::f32, Device::cpu, {s.length}));
    }
    stage.set_activation_slots(M * V);
    stage.prepare_activations(B, T);
  }
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
  // Virtual stage v of micro-batch m: its stage, with its chunk and that pair's slot selected.
  const auto select = [&](int v, int m) -> model::Model& {
    model::Model& stage = *stages[std::size_t(v % P)];
    stage.use_layer_range(v / P);
    stage.use_activation_slot(m * V + v / P);
    return stage;
  };
  for (auto& s : stages) s->zero_grads();
  std::vector<double> got(M, 0.0);
  for (int m = 0; m < M; ++m) {  // forward of both micro-batches through every virtual stage
    for (int v = 0; v < P * V; ++v) {
      if (v > 0) {
        const Tensor out = select(v - 1, m).stream_ends().output;
        ops::copy(select(v, m).stream_ends().input, out);
      }
      model::Model& stage = select(v, m);
      CHECK(stage.begins_model() == (v == 0));
      CHECK(stage.ends_model() == (v == P * V - 1));
      got[std::size_t(m)] = stage.forward(inputs[std::size_t(m)].data(), targets[std::size_t(m)].data(), B, T, float(1.0 / n));
    }
  }
  for (int m = M; m-- > 0;) {  // backward, the later micro-batch first
    for (int v = P * V; v-- > 0;) {
      if (v + 1 < P * V) {
        const Tensor grad = select(v + 1, m).stream_ends().input_grad;
        ops::copy(select(v, m).stream_ends().output_grad, grad);
      }
      select(v, m).backward();
    }
  }
  for (int m = 0; m < M; ++m) {
    CAPTURE(m, got[std::size_t(m)], expected[std::size_t(m)]);
    CHECK(std::abs(got[std::size_t(m)] - expected[std::size_t(m)]) <= tolerance * std::abs(expected[std::size_t(m)]));
  }
  // Every gradient, summed over the stages that hold it (a tied embedding: the first and the last).
  std::vector<double> summed(std::size_t(whole->num_params()), 0.0);
  std::vector<int> holders(summed.size(), 0);
  for (const auto& s : stages) {
    const std::vector<float> grads = to_host(s->grads());
    for (const model::Segment& seg : s->segments(false)) {
      for (std::int64_t i = 0; i < seg.length; ++i) {
        summed[std::size_t(seg.logical + i)] += grads[std::size_t(seg.local + i)];
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
  CHECK(std::sqrt(diff / norm) < tolerance);
  std::int64_t held = 0;
  for (const auto& s : stages) held += s->num_params();
  const std::int64_t embedding = c.vocab_size * c.d_model;
  CHECK(held == whole->num_params() + (tied && P > 1 ? embedding : 0));
}

}  // namespace llmtrain::test
