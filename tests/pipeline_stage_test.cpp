// Pipeline stages of one model, run in one process: the stages' forward and backward, handing the
// boundary activations and their gradients from one to the next by hand (as the pipeline's
// transfers do), give the whole model's losses and gradients; micro-batches in flight keep their
// activations apart in slots; a stage of several model chunks (the interleaved schedule's) runs
// each as a stage of its own.
#include "pipeline_stages_check.h"

using llmtrain::Device;
using llmtrain::parallel::StageRange;
using llmtrain::test::check_pipeline_stages;

// Stages of one chunk each: the layers of each stage.
std::vector<std::vector<StageRange>> one_chunk_each(const std::vector<int>& layers_per_stage) {
  std::vector<std::vector<StageRange>> stages;
  int first = 0;
  for (const int n : layers_per_stage) {
    stages.push_back({{first, n}});
    first += n;
  }
  return stages;
}

TEST_CASE("GPT-2 split into pipeline stages gives the whole model's losses and gradients", "[model][pipeline]") {
  check_pipeline_stages("gpt2", true, one_chunk_each({2, 3}), Device::cpu, 1e-6);
  check_pipeline_stages("gpt2", true, one_chunk_each({1, 2, 1, 1}), Device::cpu, 1e-6);
  // Two stages of two chunks: virtual stages 0 (layers 0-1), 1 (2), 2 (3), 3 (4).
  check_pipeline_stages("gpt2", true, {{{0, 2}, {3, 1}}, {{2, 1}, {4, 1}}}, Device::cpu, 1e-6);
}

TEST_CASE("Llama split into pipeline stages gives the whole model's losses and gradients", "[model][pipeline][llama]") {
  check_pipeline_stages("llama", false, one_chunk_each({3, 2}), Device::cpu, 1e-6);
  check_pipeline_stages("llama", true, one_chunk_each({1, 1, 3}), Device::cpu, 1e-6);
  check_pipeline_stages("llama", false, {{{0, 1}, {2, 2}}, {{1, 1}, {4, 1}}}, Device::cpu, 1e-6);
}
