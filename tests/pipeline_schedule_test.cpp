// Pipeline parallelism's pure logic: the order of forwards and backwards on each stage (1F1B and
// Megatron's interleaved schedule) against orders written out by hand, their timelines in the
// simulator against hand-worked timelines and the bubble formulas, the activations each stage
// keeps alive, and the split of the layers over the stages.
#include <algorithm>
#include <functional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "catch_compat.h"
#include "config/config.h"
#include "core/error.h"
#include "parallel/pipeline_schedule.h"
#include "parallel/pipeline_stages.h"

using namespace llmtrain;
using parallel::PipelineOp;

namespace {

// "F0 F1 B0.1" -> the ops: F or B, the micro-batch, and ".c" for a chunk other than 0.
std::vector<PipelineOp> ops(const std::string& text) {
  std::vector<PipelineOp> out;
  std::istringstream words(text);
  std::string w;
  while (words >> w) {
    const auto dot = w.find('.');
    const int micro_batch = std::stoi(w.substr(1, dot == std::string::npos ? std::string::npos : dot - 1));
    const int chunk = dot == std::string::npos ? 0 : std::stoi(w.substr(dot + 1));
    out.push_back({w[0] == 'F' ? PipelineOp::forward : w[0] == 'B' ? PipelineOp::backward : PipelineOp::weight,
                   micro_batch, chunk});
  }
  return out;
}

std::string text(const std::vector<PipelineOp>& list) {
  std::string out;
  for (const auto& op : list) {
    if (!out.empty()) out.push_back(' ');
    out.append(parallel::to_string(op));
  }
  return out;
}

std::vector<std::vector<PipelineOp>> all_1f1b(int P, int m) {
  std::vector<std::vector<PipelineOp>> out;
  for (int s = 0; s < P; ++s) out.push_back(parallel::one_f_one_b(P, s, m));
  return out;
}

std::vector<std::vector<PipelineOp>> all_interleaved(int P, int m, int V) {
  std::vector<std::vector<PipelineOp>> out;
  for (int s = 0; s < P; ++s) out.push_back(parallel::interleaved(P, s, m, V));
  return out;
}

// The message of the InputError `f` throws; fails the test if none.
std::string input_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const InputError& e) {
    return e.what();
  }
  FAIL("no InputError");
  return {};
}

}  // namespace

TEST_CASE("1F1B: warm-up, one forward one backward, cool-down on each stage (P 4, m 8)", "[pipeline]") {
  // Stage 0 runs P - 1 = 3 forwards before its first backward; the last stage none.
  CHECK(text(parallel::one_f_one_b(4, 0, 8)) == "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7");
  CHECK(text(parallel::one_f_one_b(4, 1, 8)) == "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7");
  CHECK(text(parallel::one_f_one_b(4, 3, 8)) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7");
  // Fewer micro-batches than stages: all forwards, then all backwards.
  CHECK(text(parallel::one_f_one_b(4, 0, 2)) == "F0 F1 B0 B1");
  CHECK(parallel::one_f_one_b(4, 0, 8) == ops("F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7"));
  CHECK_THROWS_AS(parallel::one_f_one_b(4, 4, 8), std::invalid_argument);
  CHECK_THROWS_AS(parallel::one_f_one_b(4, 0, 0), std::invalid_argument);
}

TEST_CASE("one stage: each micro-step's forward, then its backward, with nothing to transfer", "[pipeline]") {
  // The trainer runs training without a pipeline as this schedule: the micro-steps of gradient
  // accumulation in order, one set of activations, no transfers.
  CHECK(text(parallel::one_f_one_b(1, 0, 4)) == "F0 B0 F1 B1 F2 B2 F3 B3");
  CHECK(text(parallel::one_f_one_b(1, 0, 1)) == "F0 B0");
  for (int m : {1, 2, 5, 8}) {
    CAPTURE(m);
    const auto list = parallel::one_f_one_b(1, 0, m);
    CHECK(parallel::peak_live_activations(list) == 1);
    const auto groups = parallel::transfer_groups(list, 1, 0, 1, 0);
    CHECK(groups.size() == list.size() + 1);
    for (const auto& group : groups) CHECK(group.empty());
    // Forwards only (validation): no transfers either.
    std::vector<PipelineOp> forwards;
    for (int k = 0; k < m; ++k) forwards.push_back({PipelineOp::forward, k, 0});
    for (const auto& group : parallel::transfer_groups(forwards, 1, 0, 1, m)) CHECK(group.empty());
  }
}

TEST_CASE("1F1B: each micro-batch forward once, then backward once, in order", "[pipeline]") {
  for (int P : {1, 2, 3, 4, 8}) {
    for (int m : {1, 2, 3, 4, 7, 8, 16}) {
      for (int s = 0; s < P; ++s) {
        CAPTURE(P, m, s);
        const auto list = parallel::one_f_one_b(P, s, m);
        REQUIRE(list.size() == std::size_t(2 * m));
        std::vector<int> forward_at(std::size_t(m), -1), backward_at(std::size_t(m), -1);
        int next_forward = 0, next_backward = 0;
        for (std::size_t i = 0; i < list.size(); ++i) {
          const PipelineOp& op = list[i];
          CHECK(op.chunk == 0);
          if (op.kind == PipelineOp::forward) {
            CHECK(op.micro_batch == next_forward++);
            forward_at[std::size_t(op.micro_batch)] = int(i);
          } else {
            CHECK(op.micro_batch == next_backward++);
            backward_at[std::size_t(op.micro_batch)] = int(i);
          }
        }
        for (int b = 0; b < m; ++b) {
          CHECK(forward_at[std::size_t(b)] >= 0);
          CHECK(forward_at[std::size_t(b)] < backward_at[std::size_t(b)]);
        }
      }
    }
  }
}

TEST_CASE("1F1B: the simulated bubble is (P - 1) / (m + P - 1) on every stage", "[pipeline]") {
  // A hand-worked timeline, P 4, m 2 (forward 1, backward 2): the last stage runs F0 3-4, B0 4-6,
  // F1 6-7, B1 7-9; stage 0 ends with B1 13-15.
  const auto small = parallel::simulate_pipeline(all_1f1b(4, 2), 2, 1);
  CHECK(small.makespan == 15);
  CHECK(small.start[3] == std::vector<double>{3, 4, 6, 7});
  CHECK(small.start[0] == std::vector<double>{0, 1, 10, 13});

  for (int P : {1, 2, 3, 4, 8}) {
    for (int m : {1, 2, 4, 5, 8, 16, 32}) {
      CAPTURE(P, m);
      const auto sim = parallel::simulate_pipeline(all_1f1b(P, m), m, 1);
      // Every stage computes 3 m and waits 3 (P - 1): the step is 3 (m + P - 1).
      CHECK(sim.makespan == 3.0 * (m + P - 1));
      for (int s = 0; s < P; ++s) {
        CAPTURE(s);
        CHECK(sim.busy[std::size_t(s)] == 3.0 * m);
        CHECK(sim.idle[std::size_t(s)] == 3.0 * (P - 1));
        CHECK(sim.bubble(s) == Approx(double(P - 1) / double(m + P - 1)).epsilon(1e-15));
        CHECK(sim.bubble(s) == Approx(parallel::bubble_fraction_1f1b(P, m)).epsilon(1e-15));
      }
    }
  }
  // Other costs: the same fraction (forward 1, backward 1).
  const auto equal = parallel::simulate_pipeline(all_1f1b(4, 8), 8, 1, {1, 1});
  CHECK(equal.bubble(0) == Approx(3.0 / 11.0));
}

TEST_CASE("1F1B: at most P - stage micro-batches alive on a stage, P on the first", "[pipeline]") {
  for (int P : {2, 4, 8}) {
    for (int m : {1, 3, 8, 16}) {
      const auto sim = parallel::simulate_pipeline(all_1f1b(P, m), m, 1);
      for (int s = 0; s < P; ++s) {
        CAPTURE(P, m, s);
        CHECK(sim.peak_live[std::size_t(s)] == std::min(P - s, m));
      }
      CHECK(sim.peak_live[0] <= P);
    }
  }
  // GPipe's order (all forwards, then all backwards) keeps every micro-batch alive: the count sees it.
  std::vector<std::vector<PipelineOp>> gpipe;
  for (int s = 0; s < 4; ++s) gpipe.push_back(ops("F0 F1 F2 F3 F4 F5 F6 F7 B0 B1 B2 B3 B4 B5 B6 B7"));
  CHECK(parallel::simulate_pipeline(gpipe, 8, 1).peak_live[0] == 8);
  // The trainer's slot count of each stage's own list agrees with the simulator's.
  for (int s = 0; s < 4; ++s) CHECK(parallel::peak_live_activations(parallel::one_f_one_b(4, s, 8)) == 4 - s);
  CHECK(parallel::peak_live_activations(gpipe[0]) == 8);
}

TEST_CASE("interleaved: a stage keeps its warm-up's (micro-batch, chunk) pairs and one more alive", "[pipeline]") {
  // Megatron's warm-up of 2 (P - s - 1) + (V - 1) P forwards, then one forward before each
  // backward: w + 1 pairs at most, while V m is more.
  for (int P : {2, 4}) {
    for (int V : {2, 3}) {
      for (int s = 0; s < P; ++s) {
        CAPTURE(P, V, s);
        const int m = 4 * P;
        const int w = std::min(2 * (P - s - 1) + (V - 1) * P, V * m);
        CHECK(parallel::peak_live_activations(parallel::interleaved(P, s, m, V)) == std::min(w + 1, V * m));
      }
    }
  }
}

TEST_CASE("interleaved: Megatron's order for P 2, V 2, m 4, and its timeline", "[pipeline]") {
  // By hand from Megatron's rules. Forward k takes micro-batch (k / 4) 2 + k % 2 through chunk
  // (k % 4) / 2: 0.0 1.0 0.1 1.1 2.0 3.0 2.1 3.1; backward k the same micro-batch with the chunk
  // reversed. Warm-up: 2 (P - s - 1) + (V - 1) P = 4 forwards on stage 0, 2 on stage 1.
  const auto stage0 = ops("F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3");
  const auto stage1 = ops("F0 F1 F0.1 B0.1 F1.1 B1.1 F2 B0 F3 B1 F2.1 B2.1 F3.1 B3.1 B2 B3");
  CHECK(text(parallel::interleaved(2, 0, 4, 2)) == text(stage0));
  CHECK(text(parallel::interleaved(2, 1, 4, 2)) == text(stage1));

  // The timeline worked by hand (forward 1, backward 2; stage 1 holds virtual stages 1 and 3):
  // both stages compute 24 and wait 3 of a 27-long step, 1/9, against 1F1B's 1/5 at m 4.
  const auto sim = parallel::simulate_pipeline({stage0, stage1}, 4, 2);
  CHECK(sim.start[0] == std::vector<double>{0, 1, 2, 3, 4, 6, 8, 9, 11, 12, 14, 15, 18, 21, 23, 25});
  CHECK(sim.start[1] == std::vector<double>{1, 2, 3, 4, 6, 7, 9, 10, 12, 13, 15, 16, 18, 19, 21, 23});
  CHECK(sim.makespan == 27);
  CHECK(sim.idle == std::vector<double>{3, 3});
  CHECK(sim.bubble(0) == Approx(1.0 / 9.0));
  CHECK(parallel::bubble_fraction_interleaved(2, 4, 2) == Approx(1.0 / 9.0));
  CHECK(sim.bubble(0) < parallel::bubble_fraction_1f1b(2, 4));
  // Activations alive: warm-up + 1 (micro-batch, chunk) pairs, each of half a stage's layers.
  CHECK(sim.peak_live == std::vector<int>{5, 3});
}

TEST_CASE("interleaved: complete, deadlock-free, its bubble Megatron's and below 1F1B's", "[pipeline]") {
  for (int P : {2, 3, 4, 8}) {
    for (int V : {2, 3, 4}) {
      for (int groups : {1, 2, 4}) {
        const int m = groups * P;
        CAPTURE(P, V, m);
        const auto sim = parallel::simulate_pipeline(all_interleaved(P, m, V), m, V);  // throws on a bad list
        // 1F1B over the same layers: each op does the work of V chunks.
        const auto one = parallel::simulate_pipeline(all_1f1b(P, m), m, 1, {double(V), 2.0 * V});
        // Every stage computes 3 V m chunk-ops and waits 3 (P - 1), a V-th of 1F1B's wait.
        CHECK(sim.makespan == 3.0 * (V * m + P - 1));
        for (int s = 0; s < P; ++s) {
          CAPTURE(s);
          CHECK(sim.busy[std::size_t(s)] == 3.0 * V * m);
          CHECK(sim.idle[std::size_t(s)] == 3.0 * (P - 1));
          CHECK(sim.bubble(s) == Approx(parallel::bubble_fraction_interleaved(P, m, V)).epsilon(1e-15));
          CHECK(sim.bubble(s) < one.bubble(s));
          // Activations: the warm-up's forwards and the one before the first backward, of one chunk each.
          const int warmup = std::min(2 * (P - s - 1) + (V - 1) * P, V * m);
          CHECK(sim.peak_live[std::size_t(s)] == std::min(warmup + 1, V * m));
        }
      }
    }
  }
  // m must be a multiple of P.
  CHECK_THROWS_AS(parallel::interleaved(4, 0, 6, 2), std::invalid_argument);
}

TEST_CASE("simulator: incomplete lists and deadlocks are errors naming the stage and op", "[pipeline]") {
  const auto message = [](const std::vector<std::vector<PipelineOp>>& lists, int m, int V) {
    try {
      parallel::simulate_pipeline(lists, m, V);
    } catch (const std::logic_error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  // A backward before its own forward.
  auto lists = all_1f1b(2, 2);
  lists[1] = ops("B0 F0 F1 B1");
  CHECK(message(lists, 2, 1).find("deadlocks: stage 0 at B0, stage 1 at B0") != std::string::npos);
  // Stage 0 waits for micro-batch 0's gradient before it forwards micro-batch 1, which the last
  // stage wants first.
  lists = all_1f1b(2, 2);
  lists[0] = ops("F0 B0 F1 B1");
  lists[1] = ops("F1 B1 F0 B0");
  CHECK(message(lists, 2, 1).find("deadlocks: stage 0 at B0, stage 1 at F1") != std::string::npos);
  lists = all_1f1b(2, 2);
  lists[0].pop_back();
  CHECK(message(lists, 2, 1) ==
        "pipeline schedule: stage 0 lists 3 ops, expected 4 (a forward and a backward of each micro-batch and chunk)");
  lists = all_1f1b(2, 2);
  lists[1][3] = lists[1][1];
  CHECK(message(lists, 2, 1) == "pipeline schedule: stage 1, B0: listed twice");
  lists = all_1f1b(2, 2);
  lists[0][0].chunk = 1;
  CHECK(message(lists, 2, 1) == "pipeline schedule: stage 0, F0.1: out of range");
}

TEST_CASE("pipeline micro-batches: at least the stages, a multiple of them for interleaved", "[pipeline]") {
  const auto parse = [](const std::string& json) { return config::parse_config(json, "t.json"); };
  const auto c = parse(R"({"train": {"micro_batch_size": 1, "global_batch_size": 8}, "dist": {"pipeline_parallel": 4}})");
  CHECK(parallel::pipeline_micro_batches(c, 1) == 8);
  CHECK(parallel::pipeline_micro_batches(c, 2) == 4);
  CHECK(input_error([&] { parallel::pipeline_micro_batches(c, 4); }) ==
        "train.global_batch_size / (train.micro_batch_size x data-parallel size) = 8 / (1 x 4) = 2 micro-batch(es) "
        "per update, fewer than the 4 stages of dist.pipeline_parallel: every stage needs one in flight (raise "
        "train.global_batch_size or lower train.micro_batch_size)");
  const auto i = parse(R"({"train": {"micro_batch_size": 1, "global_batch_size": 6},
                           "dist": {"pipeline_parallel": 4, "pipeline_schedule": "interleaved", "virtual_stages": 2}})");
  CHECK(input_error([&] { parallel::pipeline_micro_batches(i, 1); })
            .find("= 6 micro-batch(es) per update, not a multiple of dist.pipeline_parallel (4), as "
                  "dist.pipeline_schedule \"interleaved\" needs") != std::string::npos);
  CHECK(parallel::stage_schedule(i.dist, 3, 8) == parallel::interleaved(4, 3, 8, 2));
  CHECK(parallel::stage_schedule(c.dist, 3, 8) == parallel::one_f_one_b(4, 3, 8));
  CHECK(parallel::bubble_fraction(i.dist, 8) == Approx(3.0 / 19.0));
  CHECK(parallel::bubble_fraction(c.dist, 8) == Approx(3.0 / 11.0));
}

namespace {

// The least possible cost of the most expensive stage over every split of the model's layers
// into `stages` contiguous non-empty ranges, by trying them all.
double best_max_cost(const config::ModelConfig& model, int stages) {
  const auto costs = parallel::stage_cost_model(model);
  double best = 1e300;
  std::vector<std::int64_t> counts;
  std::function<void(std::int64_t)> place = [&](std::int64_t left) {
    if (int(counts.size()) == stages - 1) {
      if (left < 1) return;
      counts.push_back(left);
      std::vector<parallel::StageRange> split;
      std::int64_t first = 0;
      for (auto n : counts) {
        split.push_back({first, n});
        first += n;
      }
      const auto c = parallel::stage_costs(costs, split);
      best = std::min(best, *std::max_element(c.begin(), c.end()));
      counts.pop_back();
      return;
    }
    for (std::int64_t n = 1; n < left; ++n) {
      counts.push_back(n);
      place(left - n);
      counts.pop_back();
    }
  };
  place(model.n_layer);
  return best;
}

std::vector<std::int64_t> layer_counts(const std::vector<parallel::StageRange>& split) {
  std::vector<std::int64_t> out;
  std::int64_t next = 0;
  for (const auto& r : split) {
    CHECK(r.first_layer == next);  // contiguous, in order
    next += r.layers;
    out.push_back(r.layers);
  }
  return out;
}

}  // namespace

TEST_CASE("stage split: balanced by cost, the head on the last stage counted", "[pipeline]") {
  const config::Config gpt2 = config::load_config(LLMTRAIN_SOURCE_DIR "/configs/gpt2-124m.json");
  // By hand, per token: a layer 6 (12 C^2 + 13 C) + 12 C T = 42,527,232 + 9,437,184 = 51,964,416
  // FLOPs; the head 6 V C = 231,584,256 = 4.46 layers; the embedding 2 C x 2 tables = 3,072.
  const auto costs = parallel::stage_cost_model(gpt2.model);
  CHECK(costs.layer == 51964416.0);
  CHECK(costs.head == 231584256.0);
  CHECK(costs.embedding == 3072.0);
  // Four stages: the last takes 1 layer and the head (5.46); 11 layers over three stages, 4 at
  // most each, the earlier one the lighter: 3, 4, 4.
  const auto split = parallel::split_layers(gpt2.model, 4, {});
  CHECK(layer_counts(split) == std::vector<std::int64_t>{3, 4, 4, 1});
  const auto c = parallel::stage_costs(costs, split);
  CHECK(*std::max_element(c.begin(), c.end()) == best_max_cost(gpt2.model, 4));
  CHECK(parallel::describe_split(gpt2.model, split, 4) ==
        "stage 0: layers 0-2 + embedding (3.00); stage 1: layers 3-6 (4.00); stage 2: layers 7-10 (4.00); "
        "stage 3: layer 11 + head (5.46)");
  // Interleaved, 2 stages x 2 chunks: the same four ranges, stage 0 holding virtual stages 0 and 2.
  CHECK(parallel::describe_split(gpt2.model, split, 2) ==
        "stage 0: layers 0-2 + embedding, layers 7-10 (7.00); stage 1: layers 3-6, layer 11 + head (9.46)");
  // Every stage count, against trying every split.
  for (int stages = 1; stages <= 6; ++stages) {
    CAPTURE(stages);
    const auto s = parallel::split_layers(gpt2.model, stages, {});
    const auto counts = layer_counts(s);
    CHECK(counts.size() == std::size_t(stages));
    CHECK(std::all_of(counts.begin(), counts.end(), [](std::int64_t n) { return n >= 1; }));
    const auto sc = parallel::stage_costs(costs, s);
    CHECK(*std::max_element(sc.begin(), sc.end()) == best_max_cost(gpt2.model, stages));
  }
  CHECK(layer_counts(parallel::split_layers(gpt2.model, 12, {})) == std::vector<std::int64_t>(12, 1));
  // Where stages could take the same load, the later ones take the extra layers.
  config::ModelConfig eleven = gpt2.model;
  eleven.n_layer = 11;
  CHECK(layer_counts(parallel::split_layers(eleven, 4, {})) == std::vector<std::int64_t>{3, 3, 4, 1});
  config::ModelConfig bytes = gpt2.model;  // a 256-token vocabulary: the head is 0.02 of a layer
  bytes.vocab_size = 256;
  CHECK(layer_counts(parallel::split_layers(bytes, 5, {})) == std::vector<std::int64_t>{2, 2, 3, 3, 2});

  // Llama 3.2 1B's shape, 16 layers: the head (vocab 128,256) is 3.8 layers, so 5, 5, 5, 1.
  const config::Config llama = config::load_config(LLMTRAIN_SOURCE_DIR "/configs/llama-1b.json");
  const auto lc = parallel::stage_cost_model(llama.model);
  CHECK(lc.head / lc.layer == Approx(3.80).epsilon(0.01));
  const auto ls = parallel::split_layers(llama.model, 4, {});
  CHECK(layer_counts(ls) == std::vector<std::int64_t>{5, 5, 5, 1});
  const auto lcost = parallel::stage_costs(lc, ls);
  CHECK(*std::max_element(lcost.begin(), lcost.end()) == best_max_cost(llama.model, 4));
}

TEST_CASE("stage split: by hand, and errors naming the keys", "[pipeline]") {
  const config::Config gpt2 = config::load_config(LLMTRAIN_SOURCE_DIR "/configs/gpt2-124m.json");
  const auto split = parallel::split_layers(gpt2.model, 4, {2, 4, 4, 2});
  CHECK(split == std::vector<parallel::StageRange>{{0, 2}, {2, 4}, {6, 4}, {10, 2}});
  // From the config: dist.pipeline_layers over pipeline_parallel x virtual_stages.
  const config::Config c = config::parse_config(
      R"({"dist": {"pipeline_parallel": 2, "pipeline_schedule": "interleaved", "virtual_stages": 2,
                   "pipeline_layers": [1, 5, 5, 1]}})",
      "t.json");
  CHECK(parallel::split_layers(c) == std::vector<parallel::StageRange>{{0, 1}, {1, 5}, {6, 5}, {11, 1}});

  CHECK(input_error([&] { parallel::split_layers(gpt2.model, 13, {}); }) ==
        "dist.pipeline_parallel x dist.virtual_stages: 13 stage(s), but model.n_layer is 12 (every stage needs at "
        "least one layer)");
  CHECK(input_error([&] { parallel::split_layers(gpt2.model, 4, {4, 4, 4}); }) ==
        "dist.pipeline_layers: lists 3 stage(s), expected 4 (dist.pipeline_parallel x dist.virtual_stages)");
  CHECK(input_error([&] { parallel::split_layers(gpt2.model, 4, {4, 4, 4, 1}); }) ==
        "dist.pipeline_layers: adds up to 13 layers, expected model.n_layer (12)");
  CHECK(input_error([&] { parallel::split_layers(gpt2.model, 4, {6, 6, 0, 0}); }) ==
        "dist.pipeline_layers: entry 2 is 0; every stage needs at least one layer");
}

namespace {

using Groups = std::vector<std::vector<parallel::StageTransfer>>;

// Every stage's transfer groups for the schedule; unpaired: each op's transfers on their own
// (no steady-state iterations), as if every forward were warm-up.
// V = 0: zb1p (one chunk per stage).
std::vector<Groups> all_groups(int P, int V, int m, bool paired = true) {
  config::DistConfig dist;
  dist.pipeline_parallel = P;
  dist.virtual_stages = V;
  dist.pipeline_schedule = V > 1 ? config::PipelineSchedule::interleaved : config::PipelineSchedule::one_f_one_b;
  if (V == 0) {  // zb1p
    dist.virtual_stages = V = 1;
    dist.pipeline_schedule = config::PipelineSchedule::zb1p;
  }
  std::vector<Groups> groups;
  for (int s = 0; s < P; ++s) {
    const int warm_up = paired ? parallel::warm_up_forwards(dist, s, m) : V * m;
    groups.push_back(parallel::transfer_groups(parallel::stage_schedule(dist, s, m), P, s, V, warm_up));
  }
  return groups;
}

// The same transfers one by one, in the order of the groups (unpaired: each receive just before
// its op, each send just after it).
std::vector<Groups> one_by_one(const std::vector<Groups>& grouped) {
  std::vector<Groups> single(grouped.size());
  for (std::size_t s = 0; s < grouped.size(); ++s) {
    for (const auto& group : grouped[s]) {
      for (const auto& t : group) single[s].push_back({t});
    }
  }
  return single;
}

}  // namespace

TEST_CASE("transfer groups: an iteration's receives before it, its sends after it", "[pipeline]") {
  using T = parallel::StageTransfer;
  const PipelineOp F0{PipelineOp::forward, 0, 0}, F1{PipelineOp::forward, 1, 0};
  const PipelineOp B0{PipelineOp::backward, 0, 0}, B1{PipelineOp::backward, 1, 0};
  // 1F1B, 2 stages, 2 micro-batches, stage 0: warm-up F0, steady (F1 B0), cool-down B1.
  const Groups g = parallel::transfer_groups(parallel::one_f_one_b(2, 0, 2), 2, 0, 1, 1);
  REQUIRE(g.size() == 5);
  CHECK(g[0].empty());  // F0 on the first virtual stage needs nothing
  CHECK(g[1] == std::vector<T>{{T::send, 1, F0}, {T::recv, 1, B0}});
  CHECK(g[2].empty());  // inside the iteration
  CHECK(g[3] == std::vector<T>{{T::send, 1, F1}, {T::recv, 1, B1}});
  CHECK(g[4].empty());  // the first virtual stage sends no gradient back
  // Stage 1 (the last): no warm-up, (F0 B0) (F1 B1), receiving activations and sending gradients.
  const Groups last = parallel::transfer_groups(parallel::one_f_one_b(2, 1, 2), 2, 1, 1, 0);
  CHECK(last[0] == std::vector<T>{{T::recv, 0, F0}});
  CHECK(last[1].empty());
  CHECK(last[2] == std::vector<T>{{T::send, 0, B0}, {T::recv, 0, F1}});
  CHECK(last[4] == std::vector<T>{{T::send, 0, B1}});
  // All warm-up (interleaved, 3 stages, 3 micro-batches, stage 0: 6 forwards, then 6 backwards):
  // no steady iteration, each op alone.
  config::DistConfig dist;
  dist.pipeline_parallel = 3;
  dist.virtual_stages = 2;
  dist.pipeline_schedule = config::PipelineSchedule::interleaved;
  CHECK(parallel::warm_up_forwards(dist, 0, 3) == 6);
  CHECK(parallel::warm_up_forwards(dist, 2, 3) == 3);
  const Groups all = parallel::transfer_groups(parallel::stage_schedule(dist, 0, 3), 3, 0, 2, 6);
  for (std::size_t k = 1; k < all.size() - 1; ++k) CHECK(!all[k].empty());
}

TEST_CASE("transfer groups: no deadlock under NCCL's one-group-at-a-time order, each send meeting its own receive",
          "[pipeline]") {
  for (int P : {2, 3, 4}) {
    for (int V : {1, 2, 3}) {
      for (int k : {1, 2, 3}) {
        const int m = k * P;
        if (P * V > 12) continue;
        CAPTURE(P, V, m);
        CHECK(parallel::simulate_transfers(all_groups(P, V, m)) == "");
      }
    }
  }
  // The same transfers posted one by one (receive before each op, send after it) deadlock: under
  // 1F1B stage 0 sends its next activation while stage 1 sends a gradient back, and so on
  // interleaved.
  for (const int V : {1, 2}) {
    const std::string stuck = parallel::simulate_transfers(one_by_one(all_groups(2, V, 4, false)));
    CAPTURE(V, stuck);
    CHECK(stuck.find("stage 0 at group") != std::string::npos);
    CHECK(stuck.find("stage 1 at group") != std::string::npos);
  }
  // A send and a receive of different micro-batches (orders that differ) are an error.
  auto swapped = all_groups(2, 1, 2);
  std::swap(swapped[1][0], swapped[1][2]);  // stage 1 receives micro-batch 1's activation first
  CHECK_THROWS_AS(parallel::simulate_transfers(swapped), std::logic_error);
}

TEST_CASE("zb1p: ZB-H1's order for P 4, m 8, its bubble by simulation below 1F1B's", "[pipeline]") {
  // Written out from an independent simulation of the rule (each stage runs its next 1F1B op when
  // its input is there, a forward only while it holds fewer than 1F1B's P - s micro-batches, else
  // its oldest pending W), every pass one unit.
  const std::vector<std::string> expected{
      "F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7",
      "F0 F1 F2 B0 W0 F3 B1 W1 F4 B2 W2 F5 B3 W3 F6 B4 W4 F7 B5 W5 B6 W6 B7 W7",
      "F0 F1 B0 W0 F2 B1 W1 F3 B2 W2 F4 B3 W3 F5 B4 W4 F6 B5 W5 F7 B6 W6 B7 W7",
      "F0 B0 W0 F1 B1 W1 F2 B2 W2 F3 B3 W3 F4 B4 W4 F5 B5 W5 F6 B6 W6 F7 B7 W7"};
  const auto lists = parallel::zb1p(4, 8);
  REQUIRE(lists.size() == 4);
  for (int s = 0; s < 4; ++s) {
    CAPTURE(s);
    CHECK(text(lists[std::size_t(s)]) == expected[std::size_t(s)]);
    CHECK(lists[std::size_t(s)] == ops(expected[std::size_t(s)]));
  }
  // F = B = W = 1 (a whole backward 2): the last stage waits for the first forward's 3 units, and
  // the backward wave reaches stage 0 after 7; the step is 30 units against 1F1B's 33, whose
  // bubble is 3 / 11.
  const auto sim = parallel::simulate_pipeline(lists, 8, 1, {1, 2, 1});
  CHECK(sim.makespan == 30);
  CHECK(sim.idle[0] == 6);
  config::DistConfig dist;
  dist.pipeline_parallel = 4;
  dist.pipeline_schedule = config::PipelineSchedule::zb1p;
  CHECK(parallel::bubble_fraction(dist, 8) == Approx(0.2));
  CHECK(parallel::bubble_fraction_1f1b(4, 8) == Approx(3.0 / 11.0));
}

TEST_CASE("zb1p: 1F1B's forwards and backwards in order, one weight op after each backward, 1F1B's memory, "
          "a smaller bubble and no deadlock",
          "[pipeline]") {
  for (int P = 1; P <= 6; ++P) {
    for (int m = P; m <= 3 * P + 2; ++m) {
      CAPTURE(P, m);
      const auto lists = parallel::zb1p(P, m);
      for (int s = 0; s < P; ++s) {
        CAPTURE(s);
        const auto& list = lists[std::size_t(s)];
        std::vector<PipelineOp> moving;
        std::vector<int> weights;
        std::vector<char> backward_done(std::size_t(m), 0);
        for (const PipelineOp& op : list) {
          if (op.kind != PipelineOp::weight) {
            moving.push_back(op);
            if (op.kind == PipelineOp::backward) backward_done[std::size_t(op.micro_batch)] = 1;
            continue;
          }
          CHECK(backward_done[std::size_t(op.micro_batch)]);
          weights.push_back(op.micro_batch);
        }
        CHECK(moving == parallel::one_f_one_b(P, s, m));
        std::vector<int> in_order(static_cast<std::size_t>(m));
        for (int k = 0; k < m; ++k) in_order[std::size_t(k)] = k;
        CHECK(weights == in_order);  // the weight gradients sum in the backwards' order
        CHECK(parallel::splits_backward(list));
        CHECK(parallel::peak_live_activations(list) == parallel::peak_live_activations(parallel::one_f_one_b(P, s, m)));
      }
      const auto sim = parallel::simulate_pipeline(lists, m, 1, {1, 2, 1});
      const double bubble = *std::max_element(sim.idle.begin(), sim.idle.end()) / sim.makespan;
      if (P > 1) CHECK(bubble < parallel::bubble_fraction_1f1b(P, m) - 1e-9);
      for (int s = 0; s < P; ++s) CHECK(sim.peak_live[std::size_t(s)] == std::min(P - s, m));
      CHECK(parallel::simulate_transfers(all_groups(P, 0, m)) == "");
    }
  }
  // The simulator holds a weight op to its backward.
  CHECK_THROWS_AS(parallel::simulate_pipeline({ops("F0 W0 B0")}, 1, 1), std::logic_error);
}
