// llmtrain plan's arithmetic: ZeRO 3's units, memory per rank and bytes sent per update, each
// against a hand calculation for a tiny model (the tensor, context, pipeline and expert groups'
// plans: plan_tensor_test.cpp and plan_mesh_test.cpp).
#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "catch_compat.h"
#include "plan_check.h"
#include "config/config.h"
#include "core/error.h"
#include "plan/memory_plan.h"

using namespace llmtrain;

using namespace llmtrain;
using namespace llmtrain::test;

TEST_CASE("plan: ZeRO 3 units of a tiny Llama and GPT-2, counted by hand", "[plan]") {
  const config::Config llama = tiny_llama();
  const auto units = plan::shard_units(llama.model);
  REQUIRE(units.size() == 5);
  const std::vector<std::int64_t> sizes = {48, 128, 128, 128, 44};
  const std::vector<bool> layers = {false, true, true, true, false};
  for (std::size_t i = 0; i < units.size(); ++i) {
    CAPTURE(i);
    CHECK(units[i].params == sizes[i]);
    CHECK(units[i].layer == layers[i]);
  }
  // The untied head and the final norm are read by the head, the token table by the embedding.
  CHECK((units[0].head && !units[0].embedding));
  CHECK((units[4].embedding && !units[4].head));
  for (std::size_t i = 1; i < 4; ++i) CHECK((!units[i].head && !units[i].embedding));
  CHECK(plan::parameter_count(llama.model) == 476);

  // GPT-2, vocab 10, context 8, d_model 4, ffn 16, 2 layers. Root before: ln_f 2 x 4 = 8. Each
  // layer: ln_1 8, c_attn 12 x 4 + 12 = 60, attn.c_proj 16 + 4 = 20, ln_2 8, c_fc 16 x 4 + 16 = 80,
  // mlp.c_proj 4 x 16 + 4 = 68 -> 244. Root after: wpe 8 x 4 = 32, wte 10 x 4 = 40 -> 72.
  const config::ModelConfig gpt2 = shape(config::Arch::gpt2, 10, 8, 2, 2, 2, 4, 16, true);
  const auto g = plan::shard_units(gpt2);
  REQUIRE(g.size() == 4);
  CHECK(g[0].params == 8);
  CHECK(g[1].params == 244);
  CHECK(g[2].params == 244);
  CHECK(g[3].params == 72);
  CHECK((g[0].head && !g[0].embedding));  // ln_f
  CHECK((g[3].head && g[3].embedding));   // wpe and wte: the tied head reads wte
  CHECK(plan::parameter_count(gpt2) == 568);
}

TEST_CASE("plan: the units add up to the models' own parameter lists for every shipped config", "[plan]") {
  for (const std::string name :
       {"gpt2-124m", "gpt2-350m", "tiny", "tiny-llama", "llama-1b", "llama2-13b", "llama2-70b"}) {
    CAPTURE(name);
    const config::Config c = config::load_config(LLMTRAIN_SOURCE_DIR "/configs/" + name + ".json");
    const std::int64_t P = plan::parameter_count(c.model);  // the model's own list (ArchSpec)
    config::ModelConfig no_layers = c.model;
    no_layers.n_layer = 0;
    const std::int64_t root = plan::parameter_count(no_layers);
    REQUIRE((P - root) % c.model.n_layer == 0);
    std::int64_t sum = 0, root_units = 0;
    for (const auto& u : plan::shard_units(c.model)) {
      sum += u.params;
      if (u.layer) {
        CHECK(u.params == (P - root) / c.model.n_layer);
      } else {
        root_units += u.params;
      }
    }
    CHECK(sum == P);
    CHECK(root_units == root);
  }
  // Published sizes: GPT-2 small, Llama 2 13B and 70B.
  CHECK(plan::parameter_count(config::load_config(LLMTRAIN_SOURCE_DIR "/configs/gpt2-124m.json").model) == 124439808);
  CHECK(plan::parameter_count(config::load_config(LLMTRAIN_SOURCE_DIR "/configs/llama2-13b.json").model) ==
        13015864320);
  CHECK(plan::parameter_count(config::load_config(LLMTRAIN_SOURCE_DIR "/configs/llama2-70b.json").model) ==
        68976648192);
}

TEST_CASE("plan: memory per rank at ZeRO 0 to 3 over 3 ranks, where padding matters", "[plan]") {
  config::Config c = tiny_llama();
  // ZeRO 0: every buffer whole, P = 476.
  auto p = plan::plan_memory(c, 3, 0, false, 2);
  CHECK(p.weights == 4 * 476);
  CHECK(p.gradients == 4 * 476);
  CHECK(p.optimizer == 8 * 476);
  CHECK(p.gathered == 0);
  // Activations: the model's buffer at micro-batch 2, measured at once (each piece rounded to 64
  // bytes at B = 2, so no more than twice one sequence's).
  const std::int64_t activations = p.activations;
  CHECK(activations == plan::activation_bytes(c.model, false, config::Recompute::none, 2));
  CHECK(activations <= 2 * plan::activation_bytes_per_sequence(c.model, false));
  CHECK(activations > plan::activation_bytes_per_sequence(c.model, false));
  // ZeRO 1 and 2 (the same buffers in llmtrain): the whole gradient buffer stays; m and v of a
  // shard of ceil(476 / 3) = 159; the padded buffer of 3 x 159 and the summed shard of 159, f32.
  for (const int zero : {1, 2}) {
    CAPTURE(zero);
    p = plan::plan_memory(c, 3, zero, true, 2);
    CHECK(p.weights == 6 * 476);
    CHECK(p.gradients == 4 * 476);
    CHECK(p.optimizer == 8 * 159);
    CHECK(p.gathered == 4 * (3 * 159 + 159));
  }
  // On one data-parallel rank the trainer runs ZeRO 1 and 2 as 0: nothing sharded, no buffers.
  p = plan::plan_memory(c, 1, 1, false, 2);
  CHECK(p.optimizer == 8 * 476);
  CHECK(p.gathered == 0);

  // ZeRO 3: shards ceil(48/3) + 3 ceil(128/3) + ceil(44/3) = 16 + 3 x 43 + 15 = 160 parameters.
  // Gathered: the ends are units like the layers (the head reads one, norm and lm_head, 48), so
  // two weight slots of the largest padded unit, 3 x 43 = 129, in the compute dtype; two f32
  // gradient slots of 129 + 43.
  p = plan::plan_memory(c, 3, 3, false, 2);
  CHECK(p.weights == 4 * 160);
  CHECK(p.gradients == 4 * 160);
  CHECK(p.optimizer == 8 * 160);
  CHECK(p.gathered == 4 * (2 * 129) + 4 * (2 * (129 + 43)));  // fp32: 2408
  CHECK(p.activations == activations);
  CHECK(p.total() == 640 + 640 + 1280 + 2408 + activations);
  p = plan::plan_memory(c, 3, 3, true, 2);
  CHECK(p.weights == 640);
  CHECK(p.gathered == 2 * (2 * 129) + 4 * (2 * (129 + 43)));  // bf16 weights: 1892
  // Every layer stays gathered from forward to backward (3 slots of 129), and the head's unit
  // beside them (a slot of the largest root unit, 3 x 16).
  c.dist.reshard_after_forward = false;
  p = plan::plan_memory(c, 3, 3, true, 2);
  CHECK(p.gathered == 2 * (3 * 129 + 48) + 4 * (2 * (129 + 43)));  // 2246
}

TEST_CASE("plan: weights, gradients, optimizer and gathered bytes equal what the trainer holds", "[plan]") {
  // state_bytes of rank 0 (metrics.jsonl) in 1-step mpirun runs of configs/tiny-llama.json with
  // model.n_layer 3 (171,456 parameters): the buffers the trainer allocates, counted by itself.
  // ZeRO 0 at 2 ranks: 16 (fp32) or 18 (bf16) bytes a parameter; ZeRO 1 and 2 alike: m and v of
  // a shard of 85,728, and the padded buffer and shard (3 x 85,728 f32).
  struct Measured {
    int ranks, zero;
    bool bf16, reshard;
    std::int64_t state_bytes;
  };
  const Measured measured[] = {{2, 0, false, true, 2743296}, {2, 0, true, true, 3086208},
                               {2, 1, false, true, 3086208}, {2, 1, true, true, 3429120},
                               {2, 2, false, true, 3086208}, {2, 2, true, true, 3429120},
                               {2, 3, false, true, 2295808}, {2, 3, false, false, 2546432},
                               {2, 3, true, true, 2110976},  {2, 3, true, false, 2236288},
                               {3, 3, false, true, 1777032}, {3, 3, false, false, 2027664},
                               {3, 3, true, true, 1592196},  {3, 3, true, false, 1717512}};
  config::Config c = config::load_config(LLMTRAIN_SOURCE_DIR "/configs/tiny-llama.json");
  c.model.n_layer = 3;
  CHECK(plan::parameter_count(c.model) == 171456);
  CHECK(plan::plan_memory(c, 2, 1, false, 1).state() == 16 * 171456 + 20 * 85728 - 8 * 171456);
  for (const auto& m : measured) {
    CAPTURE(m.ranks, m.zero, m.bf16, m.reshard);
    c.dist.reshard_after_forward = m.reshard;
    const auto p = plan::plan_memory(c, m.ranks, m.zero, m.bf16, 1);
    CHECK(p.weights + p.gradients + p.optimizer + p.gathered == m.state_bytes);
  }
  // optim.name "muon", measured alike: a momentum (4 bytes) for each element of the 3 layers'
  // 138,240 matrix elements, AdamW's m and v (8 bytes) for the other 33,216. One rank: 8 P of
  // weights and gradients + 4 x 138,240 + 8 x 33,216 = 2,190,336 (AdamW: 2,743,296).
  const Measured muon[] = {{1, 0, false, true, 2190336}, {2, 0, false, true, 2190336},
                           {2, 1, false, true, 2810112}, {2, 1, true, true, 3153024},
                           {3, 1, false, true, 2580992}, {2, 3, false, true, 2020096},
                           {2, 3, true, false, 1960576}, {3, 3, false, true, 1593732}};
  c.optim.name = "muon";
  CHECK(plan::plan_memory(c, 1, 0, false, 1).optimizer == 4 * 138240 + 8 * 33216);
  for (const auto& m : muon) {
    CAPTURE(m.ranks, m.zero, m.bf16, m.reshard);
    c.dist.reshard_after_forward = m.reshard;
    const auto p = plan::plan_memory(c, m.ranks, m.zero, m.bf16, 1);
    CHECK(p.weights + p.gradients + p.optimizer + p.gathered == m.state_bytes);
  }
  // Expert parallelism, measured alike: configs/tiny-moe.json at expert 2 x data 2 (4 ranks, fp32,
  // AdamW): an expert rank holds the dense parameters and 2 of each MoE layer's 4 experts, ZeRO
  // sharding them over its 2 expert-data ranks.
  config::Config moe = config::load_config(LLMTRAIN_SOURCE_DIR "/configs/tiny-moe.json");
  const plan::RankShare expert_rank = plan::rank_share(moe.model, 1, -1, 2);
  CHECK(expert_rank.params == plan::parameter_count(moe.model) - 2 * 2 * 3 * 64 * 64);  // 2 MoE layers, (64, 64) experts
  const Measured experts[] = {{2, 0, false, true, 2849792}, {2, 1, false, true, 3206016}, {2, 3, false, true, 2415616}};
  for (const auto& m : experts) {
    CAPTURE(m.zero);
    const auto p = plan::plan_memory(moe, expert_rank, m.ranks, m.zero, m.bf16, 1);
    CHECK(p.weights + p.gradients + p.optimizer + p.gathered == m.state_bytes);
  }
}

TEST_CASE("plan: a tensor-parallel rank's parameters and units, counted by hand", "[plan][tensor]") {
  // GPT-2, vocab 11, context 8, d_model 4, 2 heads, ffn 16, 2 layers, over 2 tensor ranks. Each
  // layer keeps whole ln_1 and ln_2 (8 each) and the two c_proj biases (4 each): 24; and halves
  // c_attn (48 + 12), attn.c_proj's weight (16), c_fc (64 + 16) and mlp.c_proj's weight (64):
  // 220 / 2 = 110; 134 in all. Root: ln_f 8 before the layers; after them wpe 8 x 4 = 32 and the
  // wte rows [11 r / 2, 11 (r + 1) / 2): 5 rows on rank 0, 6 on rank 1.
  const config::ModelConfig gpt2 = shape(config::Arch::gpt2, 11, 8, 2, 2, 2, 4, 16, true);
  const std::vector<std::vector<std::int64_t>> gpt2_units = {{8, 134, 134, 32 + 20}, {8, 134, 134, 32 + 24}};
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    const auto share = plan::rank_share(gpt2, 2, r);
    CHECK(share.tensor_rank == r);
    REQUIRE(share.units.size() == 4);
    std::int64_t sum = 0;
    for (std::size_t i = 0; i < 4; ++i) {
      CHECK(share.units[i].params == gpt2_units[std::size_t(r)][i]);
      CHECK(share.units[i].layer == (i == 1 || i == 2));
      sum += share.units[i].params;
    }
    CHECK(share.params == sum);
  }
  // The rank plan prints holds most: rank 1 (6 vocabulary rows), 332 parameters. Both ranks
  // together hold the model (572) and the replicated parameters once more (8 + 2 x 24 + 32).
  CHECK(plan::rank_share(gpt2, 2).tensor_rank == 1);
  CHECK(plan::rank_share(gpt2, 2).params == 332);
  CHECK(plan::rank_share(gpt2, 2, 0).params + 332 == plan::parameter_count(gpt2) + 8 + 2 * 24 + 32);
  CHECK(plan::rank_share(gpt2, 1).params == plan::parameter_count(gpt2));

  // Llama, vocab 11, d_model 4, 2 heads of 2 and 2 key/value heads, SwiGLU 6, 3 layers, untied,
  // over 2 ranks: each layer's norms whole (8), q, k, v and o (16 each) and gate, up and down (24
  // each) halved: 8 + 32 + 36 = 76. lm_head and embed_tokens by vocabulary rows (5 or 6 x 4), the
  // final norm (4) whole.
  config::ModelConfig llama = tiny_llama().model;
  llama.n_kv_head = 2;
  const auto r0 = plan::rank_share(llama, 2, 0), r1 = plan::rank_share(llama, 2, 1);
  const std::vector<std::int64_t> units0 = {20 + 4, 76, 76, 76, 20}, units1 = {24 + 4, 76, 76, 76, 24};
  REQUIRE(r0.units.size() == 5);
  REQUIRE(r1.units.size() == 5);
  for (std::size_t i = 0; i < 5; ++i) {
    CAPTURE(i);
    CHECK(r0.units[i].params == units0[i]);
    CHECK(r1.units[i].params == units1[i]);
  }
  CHECK(r0.params == 272);
  CHECK(r1.params == 280);
  CHECK(plan::rank_share(llama, 2).tensor_rank == 1);
  // What the models cannot split: 4 ranks over 2 heads (GPT-2); 4 ranks over 6 key/value heads
  // (neither divides the other). 2 ranks over 1 key/value head replicate it: each holds its 2
  // k and 2 v rows whole (8 + 8), so a layer has 8 + 8 + 16 + 8 + 36 = 76 parameters.
  CHECK_THROWS_AS(plan::rank_share(gpt2, 4), InputError);
  CHECK_THROWS_AS(plan::rank_share(shape(config::Arch::llama, 11, 8, 1, 12, 6, 24, 8, false), 4), InputError);
  CHECK(plan::rank_share(tiny_llama().model, 2, 0).units[1].params == 76);
}

TEST_CASE("plan: the largest micro-batch that fits", "[plan]") {
  config::Config c = tp_model(config::Arch::llama);
  for (const int tensor : {1, 2}) {
    CAPTURE(tensor);
    const std::int64_t state = 1000, memory = 5000000;
    const std::int64_t B = plan::max_micro_batch(c, false, tensor, state, memory);
    REQUIRE(B > 1);
    CHECK(state + plan::activation_bytes(c.model, false, config::Recompute::none, B, tensor) <= memory);
    CHECK(state + plan::activation_bytes(c.model, false, config::Recompute::none, B + 1, tensor) > memory);
  }
  CHECK(plan::max_micro_batch(c, false, 1, 1000, 1000) == 0);
}

TEST_CASE("plan: bytes each rank sends per update, against the ring formulas", "[plan]") {
  config::Config c = tiny_llama();
  // ZeRO 0: one all-reduce of 4 x 476 bytes: 2 x 2/3 x 1904.
  auto t = plan::update_traffic(c, 3, 0, true, 2);
  CHECK(t.all_reduces == 1);
  CHECK(t.reduce_scatters + t.all_gathers == 0);
  CHECK(t.bytes == Approx(2.0 * 2.0 / 3.0 * 1904.0));
  // ZeRO 1 and 2: reduce-scatter and all-gather of 3 x 159 x 4 bytes, (3-1)/3 of each: 2 x 1272.
  for (const int zero : {1, 2}) {
    t = plan::update_traffic(c, 3, zero, true, 2);
    CHECK(t.reduce_scatters == 1);
    CHECK(t.all_gathers == 1);
    CHECK(t.bytes == 2544.0);
  }
  // ZeRO 3, bf16, 2 micro-steps. Per micro-step, each layer: 2 all-gathers of 3 x 43 bf16
  // (2 x 2 x 43 x 2 = 344 sent) and a reduce-scatter of 3 x 43 f32 (2 x 43 x 4 = 344): 3 x 688;
  // the ends (the head's norm and lm_head, 16 a rank, and the embedding's table, 15) gathered,
  // 2 x (16 + 15) x 2 = 124, and reduced, 2 x (16 + 15) x 4 = 248. Less the first layer's
  // gather in the second micro-step's forward (172): 2 x (2064 + 124 + 248) - 172 = 4700.
  t = plan::update_traffic(c, 3, 3, true, 2);
  CHECK(t.all_gathers == 2 * (3 * 2 + 2) - 1);
  CHECK(t.reduce_scatters == 5 * 2);
  CHECK(t.all_reduces == 0);
  CHECK(t.bytes == 4700.0);
  // fp32: gathers of 4-byte weights: 2 x (3 x (688 + 344) + 248 + 248) - 344 = 6840.
  CHECK(plan::update_traffic(c, 3, 3, false, 2).bytes == 6840.0);
  // Without resharding, one gather per layer and micro-step: 2 x (3 x (172 + 344) + 124 + 248) - 172.
  c.dist.reshard_after_forward = false;
  t = plan::update_traffic(c, 3, 3, true, 2);
  CHECK(t.all_gathers == 2 * (3 + 2) - 1);
  CHECK(t.bytes == 3668.0);
  // One rank sends nothing.
  CHECK(plan::update_traffic(c, 1, 3, true, 2).bytes == 0.0);
  CHECK(plan::update_traffic(c, 1, 0, true, 2).bytes == 0.0);
}

TEST_CASE("plan: host memory per rank at start-up, training, a save and a resume, by hand", "[plan][host]") {
  config::Config c = tiny_llama();  // P = 476
  constexpr std::int64_t gpu = std::int64_t(2) << 30, cpu = std::int64_t(512) << 20, chunk = std::int64_t(32) << 20;
  CHECK(plan::gpu_process_bytes == gpu);
  CHECK(plan::cpu_process_bytes == cpu);
  CHECK(plan::host_chunk_bytes() == chunk);
  const plan::RankShare whole = plan::rank_share(c.model);

  // ZeRO 1, bf16, 3 data ranks: a rank owns ceil(476 / 3) = 159 parameters and writes their f32
  // weights, m and v: 12 x 159 = 1,908 bytes of staging.
  CHECK(plan::owned_params(whole, 3, 1) == 159);
  const plan::MemoryPlan z1 = plan::plan_memory(c, 3, 1, true, 2);
  plan::HostPlan h = plan::plan_host(z1, whole, 3, 1, true);
  // A GPU rank: no model on the host, only one range in flight, and the staging from training on.
  CHECK(h.startup() == gpu + chunk);
  CHECK(h.training() == gpu + 1908);
  CHECK(h.save() == gpu + 1908 + chunk);
  CHECK(h.resume() == gpu + chunk);
  CHECK(h.peak() == gpu + 1908 + chunk);
  // A CPU rank: its state is host memory. bf16 weights 6 x 476, gradients 4 x 476, m and v 8 x
  // 159, the padded buffer and summed shard 4 x (3 x 159 + 159): 2,856 + 1,904 + 1,272 + 2,544.
  const std::int64_t state = 2856 + 1904 + 1272 + 2544;
  CHECK(z1.state() == state);
  h = plan::plan_host(z1, whole, 3, 1, false);
  CHECK(h.startup() == cpu + state + chunk);
  CHECK(h.training() == cpu + state + z1.activations + 1908);
  CHECK(h.save() == cpu + state + z1.activations + 1908 + chunk);
  CHECK(h.resume() == cpu + state + chunk);

  // ZeRO 3: the padded shards 16 + 3 x 43 + 15 = 160 parameters, 1,920 bytes written. ZeRO 0 at
  // one data rank: all 476, 5,712 bytes.
  CHECK(plan::owned_params(whole, 3, 3) == 160);
  CHECK(plan::plan_host(plan::plan_memory(c, 3, 3, false, 2), whole, 3, 3, true).save() == gpu + 1920 + chunk);
  CHECK(plan::owned_params(whole, 1, 0) == 476);
  CHECK(plan::plan_host(plan::plan_memory(c, 1, 0, false, 2), whole, 1, 0, true).training() == gpu + 5712);

  // --suggest's host figure per GPU rank is the peak. With 2 key/value heads (P = 524): on 1 x 4 x 1
  // ZeRO 1 a rank owns ceil(524 / 4) = 131 parameters; on 2 x 2 x 1 tensor rank 1 holds 280 and owns 140.
  c.model.n_kv_head = 2;
  c.train.global_batch_size = 8;
  const auto options = plan::mesh_options(c, 4);
  int checked = 0;
  for (const auto& o : options) {
    if (o.mesh.size(dist::Axis::pipeline) != 1 || o.zero_stage != 1 || o.sequence_parallel) continue;
    if (o.mesh.size(dist::Axis::tensor) == 1 && o.mesh.size(dist::Axis::data) == 4) {
      CHECK(o.host == gpu + chunk + 12 * 131);
      ++checked;
    }
    if (o.mesh.size(dist::Axis::tensor) == 2 && o.mesh.size(dist::Axis::data) == 2) {
      CHECK(o.host == gpu + chunk + 12 * 140);
      ++checked;
    }
  }
  CHECK(checked == 2);
}

TEST_CASE("plan: --suggest's max micro-batch, a divisor of the batch per data rank that fits", "[plan][host]") {
  config::Config c = tiny_llama();  // P = 476
  c.train.global_batch_size = 24;   // 12 sequences per rank on 2 data ranks: B in 12, 6, 4, 3, 2, 1
  c.train.micro_batch_size = 1;
  const plan::RankShare whole = plan::rank_share(c.model);
  const auto option = plan::mesh_option(c, whole, dist::Mesh::of(2, {}), 1, false);
  REQUIRE(option);
  // Exactly the memory of micro-batch 4 (ZeRO 1, fp32): 4 fits, 6 does not (its activations are larger).
  const std::int64_t at4 = plan::plan_memory(c, 2, 1, false, 4).total();
  CHECK(plan::plan_memory(c, 2, 1, false, 6).total() > at4);
  CHECK(plan::max_micro_batch(c, *option, at4) == 4);
  CHECK(plan::max_micro_batch(c, *option, at4 - 1) == 3);
  CHECK(plan::max_micro_batch(c, *option, std::int64_t(1) << 40) == 12);
  // The host: a GPU rank needs 2 GiB + 32 MiB + 12 x ceil(476 / 2) at every micro-batch; a byte less: none.
  const std::int64_t host = (std::int64_t(2) << 30) + (std::int64_t(32) << 20) + 12 * 238;
  CHECK(option->host == host);
  CHECK(plan::max_micro_batch(c, *option, at4, host) == 4);
  CHECK(plan::max_micro_batch(c, *option, at4, host - 1) == 0);
}
