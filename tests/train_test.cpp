// Learning-rate schedule, token sampling and the replica check against hand computations; the keys
// a resume may change.
#include <cmath>
#include <numbers>

#include "catch_compat.h"
#include "core/crc32.h"
#include "config/config.h"
#include "model/sampling.h"
#include "optim/lr_schedule.h"
#include "parallel/grad_sync.h"

using namespace llmtrain;

TEST_CASE("the learning rate warms up linearly, then decays to min_lr", "[train]") {
  config::OptimConfig o;
  o.lr = 1.0;
  o.min_lr = 0.1;
  o.warmup_steps = 10;
  const std::int64_t max_steps = 110;
  CHECK(optim::learning_rate(o, max_steps, 1) == 0.1);
  CHECK(optim::learning_rate(o, max_steps, 5) == 0.5);
  CHECK(optim::learning_rate(o, max_steps, 10) == 1.0);
  o.schedule = "cosine";
  CHECK(std::abs(optim::learning_rate(o, max_steps, 60) - 0.55) < 1e-12);  // halfway: mean of lr and min_lr
  CHECK(std::abs(optim::learning_rate(o, max_steps, 35) - (0.1 + 0.45 * (1 + std::cos(std::numbers::pi / 4)))) < 1e-12);
  CHECK(std::abs(optim::learning_rate(o, max_steps, 110) - 0.1) < 1e-12);
  o.schedule = "linear";
  CHECK(std::abs(optim::learning_rate(o, max_steps, 60) - 0.55) < 1e-12);
  CHECK(std::abs(optim::learning_rate(o, max_steps, 85) - 0.325) < 1e-12);
  o.schedule = "constant";
  CHECK(optim::learning_rate(o, max_steps, 100) == 1.0);
  o.warmup_steps = 0;
  o.schedule = "cosine";
  CHECK(optim::learning_rate(o, max_steps, 1) < 1.0);  // no warmup: decay from the first step
}

TEST_CASE("sampling: greedy, top-k, top-p and the softmax frequencies", "[generate]") {
  const float logits[4] = {1.0f, 3.0f, 2.0f, std::log(0.5f)};
  std::uint64_t rng = 7;
  CHECK(model::sample_token(logits, 4, {0.0f, 0, 1.0f}, rng) == 1);  // temperature 0: argmax
  for (int i = 0; i < 50; ++i) {
    REQUIRE(model::sample_token(logits, 4, {1.0f, 1, 1.0f}, rng) == 1);    // top-k 1
    REQUIRE(model::sample_token(logits, 4, {1.0f, 0, 0.01f}, rng) == 1);   // tiny nucleus
    const auto two = model::sample_token(logits, 4, {1.0f, 2, 1.0f}, rng);  // top-k 2: tokens 1 and 2
    REQUIRE((two == 1 || two == 2));
  }
  // Two tokens with probabilities 1/(1+e) and e/(1+e): frequencies over 20,000 draws.
  const float pair[2] = {0.0f, 1.0f};
  int ones = 0;
  for (int i = 0; i < 20000; ++i) ones += model::sample_token(pair, 2, {1.0f, 0, 1.0f}, rng);
  const double expected = std::exp(1.0) / (1.0 + std::exp(1.0));
  CHECK(std::abs(ones / 20000.0 - expected) < 0.015);  // about 4.5 standard deviations
  // The same seed gives the same draws.
  std::uint64_t a = 99, b = 99;
  for (int i = 0; i < 100; ++i) {
    REQUIRE(model::sample_token(logits, 4, {0.9f, 3, 0.9f}, a) == model::sample_token(logits, 4, {0.9f, 3, 0.9f}, b));
  }
}

TEST_CASE("the replica check names the ranks whose checksum differs from rank 0's", "[train][dist]") {
  CHECK(parallel::ranks_differing_from_first({7, 7, 7, 7}).empty());
  CHECK(parallel::ranks_differing_from_first({7, 7, 9, 7, 8}) == std::vector<int>{2, 4});
  CHECK(parallel::ranks_differing_from_first({7}).empty());
}

TEST_CASE("the replica check's checksum, taken in chunks, is the CRC-32 of the whole buffer", "[train][dist]") {
  std::vector<float> w(1000003);
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = float(i % 977) * 0.37f - 11.0f;
  const std::uint32_t whole = crc32(w.data(), w.size() * sizeof(float));
  const Tensor t(w.data(), DType::f32, Device::cpu, {std::int64_t(w.size())});
  for (const std::int64_t chunk : {std::int64_t(1) << 20, std::int64_t(4096), std::int64_t(7), std::int64_t(2000000)}) {
    CAPTURE(chunk);
    CHECK(parallel::weights_crc32(t, chunk) == whole);
  }
  w[999999] += 1.0f;
  CHECK(parallel::weights_crc32(t, 4096) != whole);
}

TEST_CASE("a resume keeps the model's shape and the data order, and may change the other keys", "[train][config]") {
  for (const char* key : {"model.arch", "model.n_layer", "model.d_model", "model.vocab_size", "model.tie_embeddings",
                          "train.global_batch_size"}) {
    CAPTURE(key);
    CHECK_FALSE(config::may_change_on_resume(key));
  }
  for (const char* key : {"model.init_from", "model.attention", "train.max_steps", "train.micro_batch_size",
                          "optim.lr", "dist.zero_stage", "checkpoint.every", "no.such_key"}) {
    CAPTURE(key);
    CHECK(config::may_change_on_resume(key));
  }
}
