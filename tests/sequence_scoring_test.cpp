// eval/sequence_scoring.h: how choice sequences are batched, and their log-likelihoods through the
// validation's forward passes against PyTorch's logits of the same GPT-2 (the golden file).
#include <cmath>
#include <span>

#include "catch_compat.h"
#include "checkpoint/safetensors.h"
#include "dist/communicator.h"
#include "eval/sequence_scoring.h"
#include "golden_reference.h"
#include "model/model.h"

using namespace llmtrain;

namespace {

eval::ChoiceSequence sequence_of(int tokens, std::int64_t ending) {
  return {std::vector<std::uint32_t>(std::size_t(tokens), 1u), ending};
}

}  // namespace

TEST_CASE("scoring batches: longest first, each padded only to its longest, rounded up to the granule") {
  // Positions (tokens - 1): 10, 3, 70, 65, 3.
  const std::vector<eval::ChoiceSequence> sequences = {sequence_of(11, 1), sequence_of(4, 1), sequence_of(71, 2),
                                                      sequence_of(66, 1), sequence_of(4, 2)};
  const auto batches = eval::scoring_batches(sequences, 2, 100, 64);
  REQUIRE(batches.size() == 3);
  CHECK(batches[0].sequences == std::vector<std::int64_t>{2, 3});
  CHECK(batches[0].T == 100);  // 128 is past the context: the context
  CHECK(batches[1].sequences == std::vector<std::int64_t>{0, 1});
  CHECK(batches[1].T == 64);
  CHECK(batches[2].sequences == std::vector<std::int64_t>{4});
  CHECK(batches[2].T == 64);
  const eval::ScoringCost cost = eval::scoring_cost(sequences, 2, 100, 64);
  CHECK(cost.micro_batches == 3);
  CHECK(cost.positions == 2 * (100 + 64 + 64));
  CHECK(cost.positions_padded_to_context == 3 * 2 * 100);
  CHECK(eval::scoring_granule(1, 1) == 64);
  CHECK(eval::scoring_granule(3, 1) == 192);  // each of 3 ranks two equal chunks
  CHECK(eval::scoring_granule(2, 3) == 192);
}

TEST_CASE("sequence log-likelihoods in length-padded micro-batches equal PyTorch's log-softmax of the same model") {
  const checkpoint::SafetensorsReader file(LLMTRAIN_SOURCE_DIR "/tests/data/gpt2_reference.safetensors");
  const auto& meta = file.metadata();
  config::Config config;
  config.model.arch = config::Arch::gpt2;
  config.model.vocab_size = std::stoi(meta.at("V"));
  config.model.context_length = std::stoi(meta.at("maxT"));
  config.model.n_layer = std::stoi(meta.at("L"));
  config.model.n_head = config.model.n_kv_head = std::stoi(meta.at("NH"));
  config.model.d_model = std::stoi(meta.at("C"));
  config.model.ffn_hidden = std::stoi(meta.at("F"));
  config.model.tie_embeddings = true;
  config.train.micro_batch_size = 2;
  const int rows = std::stoi(meta.at("B")), T = std::stoi(meta.at("T"));
  const int V = int(config.model.vocab_size);
  auto model = model::make_model(config.model, Device::cpu);
  for (const auto& info : model->param_infos()) {
    file.read_f32("param/" + info.name, std::span<float>(model->param(info).as<float>(), std::size_t(info.numel)));
  }
  const auto inputs = test::golden::read_i32(file, "inputs");
  const auto targets = test::golden::read_i32(file, "targets");
  const auto logits = test::golden::read(file, "logits");  // PyTorch's, (rows, T, V)

  // Every prefix of 3..T positions of each row, scoring its last 1..3 tokens: the prefix's
  // tokens, then the target after its last position.
  std::vector<eval::ChoiceSequence> sequences;
  std::vector<double> expected;
  for (int b = 0; b < rows; ++b) {
    for (int L = 3; L <= T; ++L) {
      eval::ChoiceSequence s;
      for (int t = 0; t < L; ++t) s.tokens.push_back(std::uint32_t(inputs[std::size_t(b * T + t)]));
      s.tokens.push_back(std::uint32_t(targets[std::size_t(b * T + L - 1)]));
      s.ending = 1 + (L + b) % 3;
      double loglik = 0.0;
      for (std::int64_t t = L - s.ending; t < L; ++t) {
        const float* row = logits.data() + (std::size_t(b) * T + std::size_t(t)) * std::size_t(V);
        double max = row[0], sum = 0.0;
        for (int v = 1; v < V; ++v) max = std::max(max, double(row[v]));
        for (int v = 0; v < V; ++v) sum += std::exp(double(row[v]) - max);
        loglik += double(row[s.tokens[std::size_t(t + 1)]]) - max - std::log(sum);
      }
      sequences.push_back(std::move(s));
      expected.push_back(loglik);
    }
  }
  const auto world = dist::make_single_communicator();
  parallel::PipelineExecutor pipeline(*model, config, *world, *world, 1);
  eval::ScoringRank rank;
  rank.granule = 4;  // micro-batches of 4 and 8 positions (and a context of 16 never reached)
  const auto batches = eval::scoring_batches(sequences, 2, config.model.context_length, rank.granule);
  CHECK(batches.front().T == 8);
  CHECK(batches.back().T == 4);
  const std::vector<double> logliks =
      eval::sequence_logliks(pipeline, *model, sequences, 2, config.model.context_length, rank, *world);
  REQUIRE(logliks.size() == expected.size());
  double worst = 0.0;
  for (std::size_t i = 0; i < expected.size(); ++i) worst = std::max(worst, std::abs(logliks[i] - expected[i]));
  INFO("largest difference " << worst);
  CHECK(worst < 1e-4);
}
