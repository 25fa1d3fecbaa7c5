// The distributed sampler: every world size splits the same global batches, without overlap.
#include <algorithm>
#include <numeric>
#include <set>

#include "catch_compat.h"
#include "core/error.h"
#include "data/sampler.h"

using namespace llmtrain::data;

namespace {

// All samples of the next `updates` updates, per update, gathered over every rank and micro-step;
// fails the test on any sample used twice within an update.
std::vector<std::vector<std::int64_t>> gather_updates(const SamplerOptions& base, int updates) {
  std::vector<DistributedSampler> ranks;
  for (int r = 0; r < base.world_size; ++r) {
    SamplerOptions o = base;
    o.rank = r;
    ranks.emplace_back(o);
  }
  std::vector<std::vector<std::int64_t>> out;
  std::vector<std::int64_t> micro(static_cast<std::size_t>(base.micro_batch));
  for (int k = 0; k < updates; ++k) {
    std::vector<std::int64_t> all;
    for (auto& sampler : ranks) {
      for (std::int64_t m = 0; m < sampler.micro_steps(); ++m) {
        sampler.micro_batch(m, micro);
        all.insert(all.end(), micro.begin(), micro.end());
      }
      sampler.advance();
    }
    REQUIRE(std::int64_t(all.size()) == base.global_batch);
    std::sort(all.begin(), all.end());
    REQUIRE(std::adjacent_find(all.begin(), all.end()) == all.end());  // no overlap
    out.push_back(all);
  }
  return out;
}

}  // namespace

TEST_CASE("every world size and micro-batch split uses the same samples per update", "[data][sampler]") {
  const std::int64_t G = 24;
  for (const bool shuffle : {false, true}) {
    const SamplerOptions one{100, G, G, 1, 0, shuffle, 42};
    const auto reference = gather_updates(one, 12);  // 4 updates per epoch: three epochs
    int splits = 0;
    for (int W = 1; W <= 8; ++W) {
      for (std::int64_t B = 1; B <= G; ++B) {
        if (G % (B * W) != 0) continue;
        CAPTURE(shuffle, W, B);
        CHECK(gather_updates({100, G, B, W, 0, shuffle, 42}, 12) == reference);
        ++splits;
      }
    }
    CHECK(splits == 27);  // (W, B) pairs with B W dividing 24: 8 + 6 + 4 + 4 + 3 + 2
  }
}

TEST_CASE("update k uses positions kG to (k+1)G - 1 of the epoch order and the remainder is dropped", "[data][sampler]") {
  const auto order0 = DistributedSampler::epoch_order(50, true, 3, 0);
  const auto order1 = DistributedSampler::epoch_order(50, true, 3, 1);
  std::vector<std::int64_t> sorted = order0;
  std::sort(sorted.begin(), sorted.end());
  std::vector<std::int64_t> iota(50);
  std::iota(iota.begin(), iota.end(), 0);
  CHECK(sorted == iota);                 // a permutation
  CHECK(order0 != order1);               // reshuffled every epoch
  CHECK(order0 != iota);
  CHECK(DistributedSampler::epoch_order(50, true, 4, 0) != order0);  // depends on the seed
  CHECK(DistributedSampler::epoch_order(50, false, 3, 5) == iota);

  DistributedSampler s({50, 8, 8, 1, 0, true, 3});
  CHECK(s.updates_per_epoch() == 6);  // 50 = 6 x 8 + 2 dropped
  std::vector<std::int64_t> batch(8);
  for (int k = 0; k < 6; ++k) {
    s.micro_batch(0, batch);
    CHECK(std::equal(batch.begin(), batch.end(), order0.begin() + 8 * k));
    s.advance();
  }
  CHECK(s.state() == SamplerState{1, 0});
  s.micro_batch(0, batch);
  CHECK(std::equal(batch.begin(), batch.end(), order1.begin()));
}

TEST_CASE("rank r, micro-step m holds positions (m W + r) B .. + B of the update", "[data][sampler]") {
  const auto order = DistributedSampler::epoch_order(64, true, 9, 0);
  DistributedSampler s({64, 16, 2, 4, 1, true, 9});  // W = 4, B = 2: 2 micro-steps; rank 1
  std::vector<std::int64_t> batch(2);
  s.micro_batch(0, batch);
  CHECK(batch == std::vector<std::int64_t>{order[2], order[3]});    // (0 W + 1) B
  s.micro_batch(1, batch);
  CHECK(batch == std::vector<std::int64_t>{order[10], order[11]});  // (1 W + 1) B
}

TEST_CASE("a sampler restored mid-epoch continues with exactly the same samples", "[data][sampler]") {
  const SamplerOptions o{97, 12, 3, 2, 1, true, 5};
  DistributedSampler a(o);
  for (int k = 0; k < 5; ++k) a.advance();
  DistributedSampler b(o, a.state());
  std::vector<std::int64_t> x(3), y(3);
  for (int k = 0; k < 30; ++k) {  // across epoch ends
    for (std::int64_t m = 0; m < a.micro_steps(); ++m) {
      a.micro_batch(m, x);
      b.micro_batch(m, y);
      REQUIRE(x == y);
    }
    a.advance();
    b.advance();
    REQUIRE(a.state() == b.state());
  }
}

TEST_CASE("bad sampler settings are input errors", "[data][sampler]") {
  CHECK_THROWS_AS(DistributedSampler({100, 10, 4, 1, 0, true, 0}), llmtrain::InputError);  // 10 % 4
  CHECK_THROWS_AS(DistributedSampler({5, 8, 8, 1, 0, true, 0}), llmtrain::InputError);     // < one batch
  CHECK_THROWS_AS(DistributedSampler({100, 8, 8, 1, 0, true, 0}, {0, 4}), llmtrain::InputError);
}
