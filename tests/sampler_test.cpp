// The distributed sampler: every world size splits the same global batches, without overlap.
#include <algorithm>
#include <cmath>
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

// Weighted mixtures (DistributedSampler with two or more MixtureSources).
namespace {

// The sources of a mixture over sample ranges [0, 5000), [5000, 5037), [5037, 5040): very
// different sizes (one source of 3 samples goes through thousands of epochs).
std::vector<MixtureSource> three_sources() {
  return {{0, 5000, 0.7}, {5000, 37, 0.2}, {5037, 3, 0.1}};
}

int source_of(std::int64_t sample) { return sample < 5000 ? 0 : sample < 5037 ? 1 : 2; }

// The first `updates` x G samples of a mixture, in position order, gathered from every rank.
std::vector<std::int64_t> mixture_order(const SamplerOptions& base, const std::vector<MixtureSource>& sources,
                                        int updates, SamplerState start = {}) {
  std::vector<DistributedSampler> ranks;
  for (int r = 0; r < base.world_size; ++r) {
    SamplerOptions o = base;
    o.rank = r;
    ranks.emplace_back(o, start, sources);
  }
  std::vector<std::int64_t> out(std::size_t(updates * base.global_batch));
  std::vector<std::int64_t> micro(static_cast<std::size_t>(base.micro_batch));
  for (int k = 0; k < updates; ++k) {
    for (int r = 0; r < base.world_size; ++r) {
      for (std::int64_t m = 0; m < ranks[std::size_t(r)].micro_steps(); ++m) {
        ranks[std::size_t(r)].micro_batch(m, micro);
        // positions (m W + r) B .. + B of update k (the documented split)
        const std::int64_t first = k * base.global_batch + (m * base.world_size + r) * base.micro_batch;
        std::copy(micro.begin(), micro.end(), out.begin() + first);
      }
    }
    for (auto& sampler : ranks) sampler.advance();
  }
  return out;
}

}  // namespace

TEST_CASE("a mixture keeps every prefix within one sample of each source's share", "[data][sampler][mixture]") {
  const std::int64_t G = 16;
  const int updates = 6250;  // 10^5 samples
  const std::vector<std::int64_t> order = mixture_order({5040, G, G, 1, 0, true, 11}, three_sources(), updates);
  const double weights[3] = {0.7, 0.2, 0.1};
  std::int64_t counts[3] = {0, 0, 0};
  double worst = 0.0;
  for (std::size_t n = 1; n <= order.size(); ++n) {
    ++counts[source_of(order[n - 1])];
    for (int s = 0; s < 3; ++s) worst = std::max(worst, std::abs(double(counts[s]) - weights[s] * double(n)));
  }
  CHECK(worst <= 1.0);
  CHECK(counts[0] == 70000);
  CHECK(counts[1] == 20000);
  CHECK(counts[2] == 10000);
  // Each source goes through its samples once per epoch of its own, reshuffled every epoch.
  std::vector<std::vector<std::int64_t>> taken(3);
  for (const std::int64_t sample : order) taken[std::size_t(source_of(sample))].push_back(sample);
  const std::int64_t first[3] = {0, 5000, 5037}, size[3] = {5000, 37, 3};
  for (int s = 0; s < 3; ++s) {
    CAPTURE(s);
    std::set<std::vector<std::int64_t>> epochs;
    for (std::size_t e = 0; (e + 1) * std::size_t(size[s]) <= taken[std::size_t(s)].size(); ++e) {
      std::vector<std::int64_t> epoch(taken[std::size_t(s)].begin() + std::ptrdiff_t(e * std::size_t(size[s])),
                                      taken[std::size_t(s)].begin() + std::ptrdiff_t((e + 1) * std::size_t(size[s])));
      // position k % N of the source's order of epoch k / N (stream s)
      std::vector<std::int64_t> expected = DistributedSampler::epoch_order(size[s], true, 11, std::int64_t(e), std::uint64_t(s));
      for (auto& i : expected) i += first[s];
      REQUIRE(epoch == expected);
      epochs.insert(epoch);
    }
    if (s < 2) CHECK(epochs.size() > 1);  // reshuffled (3 samples have only 6 orders, seen too)
  }
}

TEST_CASE("a mixture follows the rule: the source furthest below its share, the lowest on a tie", "[data][sampler][mixture]") {
  // An independent reference in exact integers: weights 7, 2, 1 (of 10), so position n goes to
  // the s with the largest 7 (n+1) - 10 c_s (resp. 2, 1); ties go to the lowest s.
  const std::vector<std::int64_t> weights = {7, 2, 1};
  std::vector<std::int64_t> c(3, 0);
  const std::vector<std::int64_t> order =
      mixture_order({5040, 8, 8, 1, 0, false, 0}, {{0, 5000, 7.0}, {5000, 37, 2.0}, {5037, 3, 1.0}}, 500);
  int ties = 0;
  for (std::size_t n = 0; n < order.size(); ++n) {
    std::size_t best = 0;
    for (std::size_t s = 1; s < 3; ++s) {
      const std::int64_t d = weights[s] * std::int64_t(n + 1) - 10 * c[s];
      const std::int64_t d_best = weights[best] * std::int64_t(n + 1) - 10 * c[best];
      if (d == d_best) ++ties;
      if (d > d_best) best = s;
    }
    REQUIRE(source_of(order[n]) == int(best));
    ++c[best];
  }
  CHECK(ties > 0);  // the tie rule was exercised
  // Without shuffling, each source's samples come in order, and wrap.
  // Position 0: (7, 2, 1) -> 0; 1: (14 - 10, 4, 2), a tie -> 0; 2: (21 - 20, 6, 3) -> 1.
  CHECK(order[0] == 0);
  CHECK(order[1] == 1);
  CHECK(order[2] == 5000);
}

TEST_CASE("a mixture's order is the same at every world size and across a resume", "[data][sampler][mixture]") {
  const std::int64_t G = 16;
  const std::vector<std::int64_t> reference = mixture_order({5040, G, G, 1, 0, true, 3}, three_sources(), 300);
  for (const int W : {1, 2, 4}) {
    for (const std::int64_t B : {1, 2, 4}) {
      if (G % (B * W) != 0) continue;
      CAPTURE(W, B);
      CHECK(mixture_order({5040, G, B, W, 0, true, 3}, three_sources(), 300) == reference);
    }
  }
  // Resumed after 123 updates (mid-epoch of every source; the state is the position alone).
  DistributedSampler a({5040, G, 4, 2, 0, true, 3}, {}, three_sources());
  for (int k = 0; k < 123; ++k) a.advance();
  CHECK(a.state() == SamplerState{0, 123 * G});
  const std::vector<std::int64_t> resumed = mixture_order({5040, G, 4, 2, 0, true, 3}, three_sources(), 177, a.state());
  CHECK(std::equal(resumed.begin(), resumed.end(), reference.begin() + 123 * G));
  CHECK_THROWS_AS(DistributedSampler({5040, G, G, 1, 0, true, 3}, {1, 0}, three_sources()), llmtrain::InputError);
  CHECK_THROWS_AS(DistributedSampler({5040, G, G, 1, 0, true, 3}, {0, 5}, three_sources()), llmtrain::InputError);
  CHECK_THROWS_AS(DistributedSampler({5040, G, G, 1, 0, true, 3}, {}, {{0, 5040, 1.0}, {5040, 0, 1.0}}),
                  llmtrain::InputError);  // a source without samples
}

TEST_CASE("one source is today's epoch order, whatever its weight", "[data][sampler][mixture]") {
  const SamplerOptions o{97, 12, 3, 2, 1, true, 5};
  DistributedSampler plain(o), one(o, {}, {{0, 97, 0.3}});
  std::vector<std::int64_t> x(3), y(3);
  for (int k = 0; k < 30; ++k) {  // across epoch ends (8 updates each, 1 sample dropped)
    for (std::int64_t m = 0; m < plain.micro_steps(); ++m) {
      plain.micro_batch(m, x);
      one.micro_batch(m, y);
      REQUIRE(x == y);
    }
    plain.advance();
    one.advance();
    REQUIRE(plain.state() == one.state());
  }
  CHECK(plain.state() == SamplerState{3, 72});
}

TEST_CASE("the Blender replays to any position and counts what each source gave", "[data][sampler][mixture]") {
  Blender a({0.5, 0.25, 0.25});
  std::vector<int> sources;
  for (int i = 0; i < 8; ++i) sources.push_back(a.next());
  // 1/2 (n+1) - c: position 0 -> 0; 1: (0, .5, .5) -> 1; 2: (.5, -.25, .75) -> 2; 3: (1, 0, 0) -> 0, ...
  CHECK(sources == std::vector<int>{0, 1, 2, 0, 0, 1, 2, 0});
  CHECK(a.counts() == std::vector<std::int64_t>{4, 2, 2});
  Blender b({2.0, 1.0, 1.0}, 5);  // the same shares, jumped to position 5
  CHECK(b.position() == 5);
  CHECK(b.counts() == std::vector<std::int64_t>{3, 1, 1});
  CHECK(b.next() == 1);
}
