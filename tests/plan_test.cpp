// llmtrain plan's arithmetic: ZeRO 3's units, memory per rank and bytes sent per update, each
// against a hand calculation for a tiny model, and the meshes --suggest weighs.
#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "catch_compat.h"
#include "config/config.h"
#include "core/error.h"
#include "plan/memory_plan.h"

using namespace llmtrain;

namespace {

// A Llama small enough to count by hand: vocab 11, d_model 4, 2 heads of size 2 sharing 1
// key/value head, SwiGLU 6, 3 layers, untied head.
//   root before the layers: lm_head 11 x 4 = 44, final norm 4            -> 48
//   each layer: 2 norms 8, q 4 x 4 = 16, k 2 x 4 = 8, v 8, o 16,
//               gate, up and down 6 x 4 = 24 each                         -> 128
//   root after the layers: embed_tokens 11 x 4                           -> 44
//   P = 48 + 3 x 128 + 44 = 476
config::ModelConfig shape(config::Arch arch, std::int64_t vocab, std::int64_t context, std::int64_t layers,
                          std::int64_t heads, std::int64_t kv_heads, std::int64_t d_model, std::int64_t ffn, bool tied) {
  config::ModelConfig m;
  m.arch = arch;
  m.vocab_size = vocab;
  m.context_length = context;
  m.n_layer = layers;
  m.n_head = heads;
  m.n_kv_head = kv_heads;
  m.d_model = d_model;
  m.ffn_hidden = ffn;
  m.tie_embeddings = tied;
  return m;
}

config::Config tiny_llama() {
  config::Config c;
  c.model = shape(config::Arch::llama, 11, 8, 3, 2, 1, 4, 6, false);
  c.train.micro_batch_size = 2;
  c.train.global_batch_size = 12;
  return c;
}

}  // namespace

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

namespace {

// The GPT-2 and Llama of the tensor-parallel test runs: vocab 251 (uneven over 2 and 4 ranks),
// context 32, 3 layers, 4 heads, d_model 32; GPT-2's ffn 128, Llama's 40 with `kv` key/value
// heads, untied.
config::Config tp_model(config::Arch arch, std::int64_t kv = 2) {
  config::Config c;
  c.model = arch == config::Arch::gpt2 ? shape(arch, 251, 32, 3, 4, 4, 32, 128, true)
                                       : shape(arch, 251, 32, 3, 4, kv, 32, 40, false);
  c.train.micro_batch_size = 2;
  c.train.global_batch_size = 8;
  return c;
}

}  // namespace

TEST_CASE("plan: tensor-parallel memory per rank, by hand and against the trainer's state_bytes", "[plan][tensor]") {
  // By hand, GPT-2 at tensor rank 0 of 2: ln_f 64; each layer 4 x 32 (norms) + 2 x 32 (the
  // c_proj biases) whole, (3 C C + 3 C + C C + 2 F C + F) / 2 = 6,256 split: 6,448; wpe 1,024
  // and 125 of 251 wte rows (4,000). P = 64 + 3 x 6,448 + 5,024 = 24,432.
  config::Config c = tp_model(config::Arch::gpt2);
  const auto share = plan::rank_share(c.model, 2, 0);
  CHECK(share.params == 24432);
  // ZeRO 0: 16 bytes a parameter.
  CHECK(plan::plan_memory(c, share, 1, 0, false, 2).state() == 16 * 24432);
  // ZeRO 1 over 2 data ranks: S = 12,216; 8 P + 8 S + the padded buffer and shard 4 (2 S + S).
  CHECK(plan::plan_memory(c, share, 2, 1, false, 2).state() == 8 * 24432 + 8 * 12216 + 12 * 12216);
  // ZeRO 3 over 2: shards 32 + 3 x 3,224 + 2,512 = 12,216 (16 bytes each); 2 weight slots of the
  // largest unit padded, 2 x 3,224 (a layer), in f32, and 2 gradient slots of 3 x 3,224.
  const auto z3 = plan::plan_memory(c, share, 2, 3, false, 2);
  CHECK(z3.weights + z3.gradients + z3.optimizer == 16 * 12216);
  CHECK(z3.gathered == 4 * (2 * 2 * 3224) + 4 * (2 * 3 * 3224));
  // Activations: the model's own measure at tensor size 2 (heads, MLP columns and vocabulary rows
  // halved; the residual stream whole): less than one rank's, more than half of it.
  const std::int64_t whole = plan::activation_bytes(c.model, false, config::Recompute::none, 2);
  CHECK(z3.activations == plan::activation_bytes(c.model, false, config::Recompute::none, 2, 2));
  CHECK(z3.activations < whole);
  CHECK(2 * z3.activations > whole);

  // state_bytes of rank 0 (tensor rank 0, data rank 0) in 2-step mpirun runs of these models
  // (`llmtrain train --set dist.tensor_parallel=T --set dist.zero_stage=Z`, metrics.jsonl): the
  // buffers the trainer allocates, counted by itself. Replicated key/value heads by hand: tensor
  // rank 0 of 4 holds per layer the norms (64), 8 q rows, its key/value head's 8 k and 8 v rows,
  // 8 o columns (256 each) and 10 gate, up and down rows or columns (320 each): 2,048; 62 of 251
  // rows of lm_head and embed_tokens (1,984 each) and the final norm (32): 10,144 parameters.
  struct Measured {
    config::Arch arch;
    std::int64_t kv;
    int ranks, tensor, zero;
    bool bf16, reshard;
    config::Recompute recompute;
    std::int64_t state_bytes;
  };
  const auto gpt2 = config::Arch::gpt2, llama = config::Arch::llama;
  const auto none = config::Recompute::none, full = config::Recompute::full, mlp = config::Recompute::mlp;
  const Measured measured[] = {
      {gpt2, 4, 2, 2, 0, false, true, none, 390912},   {gpt2, 4, 4, 2, 1, false, true, none, 439776},
      {gpt2, 4, 4, 2, 2, false, true, none, 439776},   {gpt2, 4, 4, 2, 3, false, true, none, 324416},
      {gpt2, 4, 4, 4, 0, true, true, none, 234576},    {gpt2, 4, 4, 4, 3, true, true, full, 248352},
      {gpt2, 4, 4, 2, 3, true, false, none, 321696},   {gpt2, 4, 4, 2, 1, false, true, mlp, 439776},
      {llama, 2, 2, 2, 0, false, true, none, 297472},  {llama, 2, 4, 2, 1, true, true, none, 371840},
      {llama, 2, 4, 2, 3, false, true, full, 229376},  {llama, 2, 4, 2, 3, true, true, none, 213248},
      {llama, 4, 4, 4, 3, false, true, none, 195072},  {llama, 4, 4, 4, 0, true, true, full, 182592},
      // Key/value heads replicated (2 over 4 ranks), and runs with sequence parallelism (which
      // changes no parameter buffer).
      {llama, 2, 4, 4, 0, false, true, none, 162304},  {llama, 2, 4, 4, 0, true, true, mlp, 182592},
      {llama, 2, 4, 4, 3, true, true, full, 186880},   {llama, 2, 4, 2, 1, false, true, mlp, 334656},
      {gpt2, 4, 4, 2, 3, true, true, mlp, 298624},     {gpt2, 4, 2, 2, 0, false, true, none, 390912},
  };
  for (const auto& m : measured) {
    CAPTURE(config::to_string(m.arch), m.ranks, m.tensor, m.zero, m.bf16, m.reshard);
    config::Config run = tp_model(m.arch, m.kv);
    run.dist.reshard_after_forward = m.reshard;
    run.train.recompute = m.recompute;
    const auto p = plan::plan_memory(run, plan::rank_share(run.model, m.tensor, 0), m.ranks / m.tensor, m.zero,
                                      m.bf16, 2);
    CHECK(p.state() == m.state_bytes);
  }
  CHECK(plan::rank_share(tp_model(llama).model, 4, 0).params == 10144);
}

TEST_CASE("plan: the tensor group's all-reduces per update, against Megatron's count", "[plan][tensor]") {
  // GPT-2 of tp_model over 2 tensor ranks, 4 micro-steps of N = 2 x 32 = 64 tokens, C = 32, 3
  // layers: per micro-step 1 + 4 x 3 + 1 all-reduces of N C f32 values and the cross-entropy's
  // maxima (N) and sums (2 N): 14 x 2,048 + 192 = 28,864 values, 115,456 bytes, all sent at 2
  // ranks (2 (t-1)/t = 1); 4 of them and the norm's 8 bytes: 461,832 bytes in 65 all-reduces,
  // by the count tests/mesh_equivalence_test.py's tensor_traffic checks against runs (metrics.jsonl's
  // tensor_collectives).
  config::Config c = tp_model(config::Arch::gpt2);
  auto t = plan::tensor_traffic(c, 2, false, 4);
  CHECK(t.all_reduces == 4 * 16 + 1);
  CHECK(t.reduce_scatters + t.all_gathers == 0);
  CHECK(t.bytes == 461832.0);
  // Measured on 4 ranks: tensor 2 x data 2 (2 micro-steps) and tensor 4 (4 micro-steps, 1.5 x
  // the bytes), and the same for Llama (the count does not depend on the architecture).
  CHECK(plan::tensor_traffic(c, 2, false, 2).bytes == 230920.0);
  CHECK(plan::tensor_traffic(c, 4, false, 4).bytes == 692748.0);
  CHECK(plan::tensor_traffic(tp_model(config::Arch::llama), 2, false, 2).bytes == 230920.0);
  // recompute "mlp" runs no collective again; "full" runs each layer's forward again in
  // backward: 2 more per layer. Tensor 4, 4 micro-steps: (1 + 6 x 3 + 1) x 2,048 + 192 values,
  // 1.5 x 4 bytes each, 4 times, and the norm's 12 bytes: 987,660 in 4 x 22 + 1 = 89 (measured).
  c.train.recompute = config::Recompute::mlp;
  CHECK(plan::tensor_traffic(c, 2, false, 2).bytes == 230920.0);
  c.train.recompute = config::Recompute::full;
  t = plan::tensor_traffic(c, 4, false, 4);
  CHECK(t.all_reduces == 89);
  CHECK(t.bytes == 987660.0);
  CHECK(plan::tensor_traffic(c, 1, false, 4).bytes == 0.0);
  CHECK(plan::tensor_traffic(c, 1, false, 4).all_reduces == 0);
  // The activations are summed in f32 under bf16 too: the same bytes.
  CHECK(plan::tensor_traffic(c, 4, true, 4).bytes == 987660.0);
  // The data group of tensor 2 x data 2 (ZeRO 1, GPT-2, rank 0's 24,432 parameters): a
  // reduce-scatter and an all-gather of 2 x 12,216 f32 each, half sent: 48,864 bytes each.
  c = tp_model(config::Arch::gpt2);
  CHECK(plan::update_traffic(c, plan::rank_share(c.model, 2, 0), 2, 1, false, 2).bytes == 2 * 48864.0);
  // ZeRO 3 over the data group of tensor 2 x data 2, 2 micro-steps, as measured (metrics.jsonl's
  // collectives without the loss's all-reduce): GPT-2 fp32 17 all-gathers of 182,304 bytes (per
  // micro-step 2 per layer, ln_f once, the tied wpe and wte twice, less the first layer kept
  // gathered) and 12 reduce-scatters of 117,824; Llama bf16 54,784 and 74,368.
  auto z3 = plan::update_traffic(c, plan::rank_share(c.model, 2, 0), 2, 3, false, 2);
  CHECK(z3.all_gathers == 17);
  CHECK(z3.reduce_scatters == 12);
  CHECK(z3.bytes == 182304.0 + 117824.0);
  const config::Config l = tp_model(config::Arch::llama);
  z3 = plan::update_traffic(l, plan::rank_share(l.model, 2, 0), 2, 3, true, 2);
  CHECK(z3.all_gathers == 15);
  CHECK(z3.bytes == 54784.0 + 74368.0);
}

TEST_CASE("plan: the tensor group's collectives of a MoE model under train.recompute", "[plan][tensor][moe]") {
  // Llama of tp_model (L = 3, first layer dense, Lm = 2 MoE layers) over 2 tensor ranks, 4
  // micro-steps. A MoE layer's experts run whole on every rank: its forward sums once (after o),
  // its backward once (the qkv input gradient); recompute "full" runs its forward again (1 more,
  // a dense layer's 2 more). With sequence parallelism the sums are reduce-scatters, and the
  // gathers per micro-step: 6 per dense layer, 5 per MoE layer (its input kept for backward), 2
  // more each with "full"; "mlp" gathers a dense layer's MLP input again, and a MoE layer's
  // recomputation reads its kept input. (tests/mesh_equivalence_test.py counts them in real runs.)
  config::Config c = tp_model(config::Arch::llama);
  c.model.moe = {true, 4, 2, 16, 1, 16, 1, "softmax", true, 1.0, 0.01, 0.0, 0.0, 0.0};
  c.train.recompute = config::Recompute::full;
  // Without sequence parallelism: the embedding, 2 + 2 x 4 + 2 x 2 layer sums, the
  // cross-entropy's 2 and the head's input gradient: 16 a micro-step, and the norm's.
  CHECK(plan::tensor_traffic(c, 2, false, 4).all_reduces == 4 * 16 + 1);
  c.dist.sequence_parallel = true;
  auto t = plan::tensor_traffic(c, 2, false, 4);
  CHECK(t.all_gathers == 4 * (8 + 2 * 7 + 2));      // the layers', the head's input, the embedding's gradient
  CHECK(t.reduce_scatters == 4 * (6 + 2 * 3 + 2));  // the layers', the head's and the embedding's
  c.train.recompute = config::Recompute::mlp;
  t = plan::tensor_traffic(c, 2, false, 4);
  CHECK(t.all_gathers == 4 * (7 + 2 * 5 + 2));
  CHECK(t.reduce_scatters == 4 * (4 + 2 * 2 + 2));
  c.train.recompute = config::Recompute::none;
  t = plan::tensor_traffic(c, 2, false, 4);
  CHECK(t.all_gathers == 4 * (6 + 2 * 5 + 2));
  CHECK(t.reduce_scatters == 4 * (4 + 2 * 2 + 2));
}

TEST_CASE("plan: the tensor group's collectives with sequence parallelism and replicated key/value heads", "[plan][tensor]") {
  // GPT-2 of tp_model over 2 tensor ranks with sequence parallelism, 4 micro-steps of N = 64
  // tokens, C = 32, L = 3. Per micro-step: 6 L + 2 = 20 all-gathers and 4 L + 2 = 14
  // reduce-scatters of N C values (half of each sent at 2 ranks: 4,096 bytes in f32), and 2 + 2 L
  // + 1 = 9 all-reduces: the cross-entropy's 3 N values and 7 norms' weight and bias gradients (2
  // C each), 4 x (192 + 448) bytes. With the norm's 8 bytes, as measured (metrics.jsonl):
  // all-gathers 80 calls 327,680 bytes, reduce-scatters 56 and 229,376, all-reduces 37 and 10,248.
  config::Config c = tp_model(config::Arch::gpt2);
  c.dist.sequence_parallel = true;
  auto t = plan::tensor_traffic(c, 2, false, 4);
  CHECK(t.all_gathers == 80);
  CHECK(t.reduce_scatters == 56);
  CHECK(t.all_reduces == 37);
  CHECK(t.bytes == 327680.0 + 229376.0 + 10248.0);
  // bf16, recompute full, 4 ranks: 2 more all-gathers and reduce-scatters per layer (26 and 20
  // per micro-step); the all-gathers move bf16 (3/4 of 2,048 x 2 bytes each), the rest f32.
  // Measured: 104 all-gathers of 319,488 bytes, 80 reduce-scatters of 491,520, 37 all-reduces of
  // 15,372.
  c.train.recompute = config::Recompute::full;
  t = plan::tensor_traffic(c, 4, true, 4);
  CHECK(t.all_gathers == 104);
  CHECK(t.reduce_scatters == 80);
  CHECK(t.bytes == 319488.0 + 491520.0 + 15372.0);
  // recompute mlp gathers the MLP's input once more per layer: 23 all-gathers per micro-step;
  // measured at tensor 2 x data 2 (2 micro-steps), bf16: 46 of 94,208 bytes.
  c.train.recompute = config::Recompute::mlp;
  t = plan::tensor_traffic(c, 2, true, 2);
  CHECK(t.all_gathers == 46);
  CHECK(t.bytes == 94208.0 + 114688.0 + 5128.0);

  // Llama (2 key/value heads) over 4 ranks: each head replicated on 2, and per layer one more
  // all-reduce of all the k and v gradients (2 heads x 2 x 8 x 32 f32). Without sequence
  // parallelism, 4 micro-steps: (16 + 3) x 4 + 1 = 77 all-reduces, 1.5 x 4 bytes x ((14 x 2,048 +
  // 192) + 3 x 1,024) per micro-step and the norm's 12: 766,476 bytes, as measured.
  config::Config l = tp_model(config::Arch::llama);
  t = plan::tensor_traffic(l, 4, false, 4);
  CHECK(t.all_reduces == 77);
  CHECK(t.bytes == 766476.0);
  CHECK(plan::tensor_traffic(l, 4, true, 4).bytes == 766476.0);
  // With sequence parallelism: 9 + 3 all-reduces per micro-step (a Llama norm has no bias: C
  // each), 1.5 x 4 x (192 + 7 x 32 + 3 x 1,024) bytes; measured 49 all-reduces of 83,724 bytes,
  // 80 all-gathers of 491,520 and 56 reduce-scatters of 344,064.
  l.dist.sequence_parallel = true;
  t = plan::tensor_traffic(l, 4, false, 4);
  CHECK(t.all_reduces == 49);
  CHECK(t.all_gathers == 80);
  CHECK(t.reduce_scatters == 56);
  CHECK(t.bytes == 83724.0 + 491520.0 + 344064.0);
  // Tensor 2 x data 2 (heads split, no extra all-reduce), recompute mlp, fp32: measured 46
  // all-gathers of 188,416 bytes, 28 reduce-scatters of 114,688, 19 all-reduces of 3,336.
  l.train.recompute = config::Recompute::mlp;
  CHECK(plan::tensor_traffic(l, 2, false, 2).bytes == 188416.0 + 114688.0 + 3336.0);
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

TEST_CASE("plan: the meshes --suggest weighs, pipelines as the trainer builds their stages", "[plan]") {
  config::Config c = tiny_llama();
  c.model.n_kv_head = 2;  // so that 2 tensor-parallel ranks divide the heads; layers of 144, P = 524
  c.train.global_batch_size = 8;
  int skipped = -1;
  auto options = plan::mesh_options(c, 4, &skipped);
  CHECK(skipped == 0);
  // t x d x p: 1x4x1, 1x2x2, 2x2x1, 2x1x2 (p = 4 > 3 layers and t = 4 > 2 heads left out), the
  // last two with and without sequence parallelism; at d = 1 only ZeRO 0 and 3; with a pipeline
  // not ZeRO 3 (train refuses it).
  CHECK(options.size() == 4 + 3 + 2 * 4 + 2 * 1);
  const auto find = [&](int t, int d, int p, int zero, bool sp = false) {
    for (const auto& o : options) {
      if (o.mesh.size(dist::Axis::tensor) == t && o.mesh.size(dist::Axis::data) == d && o.mesh.size(dist::Axis::pipeline) == p && o.zero_stage == zero &&
          o.sequence_parallel == sp) {
        return o;
      }
    }
    FAIL("no option " << t << " x " << d << " x " << p << " ZeRO " << zero);
    return plan::MeshOption{};
  };
  // Pure data parallelism: exactly plan_memory and update_traffic; 8 / (2 x 4) = 1 micro-step.
  const auto dp = find(1, 4, 1, 1);
  CHECK(dp.micro_steps == 1);
  CHECK(dp.memory == plan::plan_memory(c, 4, 1, false, 2).total());
  CHECK(dp.sent == 2.0 * 3 * 131 * 4);  // reduce-scatter and all-gather of 4 x 131 x 4 bytes
  CHECK(dp.tensor_sent == 0.0);
  // 2 x 2 x 1, ZeRO 1, fp32, 2 micro-steps: exact, for tensor rank 1 (6 of the 11 vocabulary
  // rows: 280 parameters, S = 140): 4 x 280 + 4 x 280 + 8 x 140 + 4 x (2 x 140 + 140), and the
  // activations at tensor size 2. Sent: the data group's reduce-scatter and all-gather, 140 x 4
  // bytes each; the tensor group's per micro-step (1 + 4 x 3 + 1) x 64 + 3 x 16 = 944 f32 values
  // (N = 2 x 8 tokens, d_model 4), twice, and the norm's 8 bytes: 2 x 3,776 + 8 = 7,560.
  const std::int64_t acts2 = plan::activation_bytes(c.model, false, config::Recompute::none, 2, 2);
  const auto tp = find(2, 2, 1, 1);
  CHECK(tp.micro_steps == 2);
  CHECK(tp.memory == 4 * 280 + 4 * 280 + 8 * 140 + 4 * 420 + acts2);
  CHECK(tp.tensor_sent == 7560.0);
  CHECK(tp.sent == 2 * 560.0 + 7560.0);
  // 1 x 2 x 2, ZeRO 0: a 1F1B pipeline, exact: the stages as the trainer builds them, the one
  // that needs most memory, and the one that sends most.
  config::Config pc = c;
  pc.dist.pipeline_parallel = 2;
  const auto stages = plan::pipeline_stages(pc, 1, false, 2);
  REQUIRE(stages.size() == 2);
  // The balanced split of 3 layers: the first stage also holds the embedding (44), the last the
  // head (44) and final norm (4); each layer 144.
  CHECK(stages[0].share.params == 144 * stages[0].layers + 44);
  CHECK(stages[1].share.params == 144 * stages[1].layers + 48);
  CHECK(stages[0].layers + stages[1].layers == 3);
  const auto pp = find(1, 2, 2, 0);
  CHECK(pp.memory == std::max(16 * stages[0].share.params + stages[0].activations,
                              16 * stages[1].share.params + stages[1].activations));
  // Sent: the data group's all-reduce of the stage's f32 gradients (2 x 1/2 x 4 P), 2 micro-batches'
  // activations (2 x 8 x 4 f32) forward or their gradients back, and the loss and norm doubles.
  double most = 0;
  for (const auto& st : stages) most = std::max(most, 4.0 * double(st.share.params) + 2 * 256.0 + 16.0);
  CHECK(pp.sent == most);
  bool zero3 = false;
  for (const auto& o : options) zero3 = zero3 || (o.mesh.size(dist::Axis::pipeline) > 1 && o.zero_stage == 3);
  CHECK_FALSE(zero3);  // train refuses ZeRO 3 with a pipeline
  // 2 x 1 x 2, ZeRO 0, 4 micro-steps: the tensor group's all-reduces of the first stage's layers
  // and the embedding, or the last stage's layers, the head's input gradient and the
  // cross-entropy's 3 N values; each 64 f32 values (N = 16 tokens, d_model 4), 4 micro-steps, and
  // the norm's 8 bytes.
  const auto tpp = find(2, 1, 2, 0);
  const auto tstages = plan::pipeline_stages(pc, 2, false, 4);
  double tensor_most = 0;
  for (const auto& st : tstages) {
    const double values = double(1 + 4 * st.layers) * 64 + (st.head ? 48 : 0);
    CHECK(st.sent_tensor == 4.0 * values * 4 + 8.0);
    tensor_most = std::max(tensor_most, st.sent_tensor + 4 * 256.0 + 16.0);
  }
  CHECK(tpp.sent == tensor_most);
  // The interleaved schedule on 1 x 1 x 2 (3 layers: 2 x 2 = 4 virtual stages exceed them) is
  // left out; with 4 layers and 2 micro-steps it is there, exact: the stages as the trainer
  // builds them (layers 0 and 2, 1 and 3), every micro-batch and chunk sending on.
  c.dist.pipeline_schedule = config::PipelineSchedule::interleaved;
  c.dist.virtual_stages = 2;
  options = plan::mesh_options(c, 2);
  for (const auto& o : options) CHECK(o.mesh.size(dist::Axis::pipeline) == 1);
  c.model.n_layer = 4;
  options = plan::mesh_options(c, 2);
  const auto ipp = find(1, 1, 2, 0);
  config::Config ic = c;
  ic.dist.pipeline_parallel = 2;
  const auto istages = plan::pipeline_stages(ic, 1, false, ipp.micro_steps);
  REQUIRE(istages.size() == 2);
  CHECK(istages[0].chunks.size() == 2);
  CHECK(istages[1].chunks[0].first_layer == 1);
  CHECK(ipp.memory == std::max(plan::stage_memory(ic, istages[0], 1, 0, false).total(),
                               plan::stage_memory(ic, istages[1], 1, 0, false).total()));
  c.model.n_layer = 3;
  c.dist.pipeline_schedule = config::PipelineSchedule::one_f_one_b;
  c.dist.virtual_stages = 1;
  options = plan::mesh_options(c, 4);
  // Sequence parallelism on 2 x 2 x 1: the activations at 1/2 of the tokens for the residual
  // stream, the same state; the tensor group's traffic as tensor_traffic says.
  const auto sp = find(2, 2, 1, 1, true);
  CHECK(sp.memory == tp.memory - acts2 + plan::activation_bytes(c.model, false, config::Recompute::none, 2, 2, true));
  CHECK(sp.memory < tp.memory);
  config::Config with_sp = c;
  with_sp.dist.sequence_parallel = true;
  CHECK(sp.tensor_sent == plan::tensor_traffic(with_sp, 2, false, 2).bytes);
  CHECK(sp.sent == 2 * 560.0 + sp.tensor_sent);
  // A global batch of 12 is no multiple of 2 x 4: the 1 x 4 x 1 mesh is left out.
  c.train.global_batch_size = 12;
  options = plan::mesh_options(c, 4, &skipped);
  CHECK(skipped == 1);
  CHECK(options.size() == 3 + 2 * 4 + 2 * 1);
  // One key/value head: tensor parallel 2 replicates it, so 2 x 2 x 1 stays an option.
  c.train.global_batch_size = 8;
  c.model.n_kv_head = 1;
  bool replicated = false;
  for (const auto& o : plan::mesh_options(c, 4)) replicated = replicated || (o.mesh.size(dist::Axis::tensor) == 2 && o.mesh.size(dist::Axis::data) == 2);
  CHECK(replicated);
  // Tensor parallelism that does not divide the MLP columns is no option either.
  c.model.ffn_hidden = 5;
  for (const auto& o : plan::mesh_options(c, 4)) CHECK(o.mesh.size(dist::Axis::tensor) == 1);
}

TEST_CASE("plan: pipeline stages against the trainer's state_bytes and transfers on 2 stages", "[plan][pipeline]") {
  // The figures rank 0 (stage 0) reported in metrics.jsonl (state_bytes, pipeline_collectives,
  // tensor_sent_bytes) training each of these configs under mpirun, step 2.
  config::Config gpt;
  gpt.model = shape(config::Arch::gpt2, 251, 32, 4, 4, 4, 32, 128, true);
  gpt.train.micro_batch_size = 2;
  gpt.train.global_batch_size = 8;
  gpt.dist.pipeline_parallel = 2;
  // 2 ranks, fp32, 4 micro-batches. Each layer 4 x 32 x 32 x 3 + ... = 12,704 parameters (the
  // ZeRO 3 units below); stage 0: layers 0-1, wte 251 x 32 and wpe 32 x 32 = 34,464; stage 1:
  // layers 2-3, ln_f 64 and the tied wte again = 33,504.
  auto stages = plan::pipeline_stages(gpt, 1, false, 4);
  REQUIRE(stages.size() == 2);
  CHECK(stages[0].first_layer == 0);
  CHECK(stages[0].layers == 2);
  CHECK(stages[0].embedding);
  CHECK_FALSE(stages[0].head);
  CHECK(stages[1].head);
  CHECK(stages[0].share.params == 2 * 12704 + 251 * 32 + 32 * 32);
  CHECK(stages[1].share.params == 2 * 12704 + 64 + 251 * 32);
  CHECK(plan::stage_memory(gpt, stages[0], 1, 0, false).state() == 551424);  // measured
  // 1F1B keeps min(P - stage, m) micro-batches' activations: 2 on stage 0, 1 on stage 1.
  CHECK(stages[0].slots == 2);
  CHECK(stages[1].slots == 1);
  CHECK(stages[0].activations % 2 == 0);
  CHECK(stages[0].activations / 2 < plan::activation_bytes(gpt.model, false, config::Recompute::none, 2));
  // Measured: 4 sends of 32,768 bytes in all (4 x (2 x 32, 32) f32), stage 1 the 4 gradients
  // back; the pipeline group's 3 all-reduces, 32,144 bytes: the tied 251 x 32 gradient and the
  // loss and norm doubles (ring factor 2 (2 - 1) / 2 = 1).
  for (const auto& st : stages) {
    CHECK(st.sends == 4);
    CHECK(st.sent_p2p == 32768.0);
    CHECK(st.tied);
    CHECK(st.sent_pipeline_collectives == 32144.0);
    CHECK(st.sent_tensor == 0.0);
  }
  CHECK_THROWS_AS(plan::stage_memory(gpt, stages[0], 1, 3, false), std::invalid_argument);

  // The interleaved schedule, 2 chunks of one layer per stage: stage 0 holds layers 0 and 2 (the
  // same parameters as above: state_bytes 551,424, measured), stage 1 layers 1 and 3. Measured:
  // stage 0 sends 12 transfers of (2 x 32, 32) f32, 98,304 bytes: both chunks' activations and
  // the second chunk's gradients. Slots: Megatron's warm-up 2 (P - s - 1) + (V - 1) P forwards
  // and one more (5 on stage 0, 3 on stage 1).
  config::Config inter = gpt;
  inter.dist.pipeline_schedule = config::PipelineSchedule::interleaved;
  inter.dist.virtual_stages = 2;
  const auto chunked = plan::pipeline_stages(inter, 1, false, 4);
  REQUIRE(chunked.size() == 2);
  REQUIRE(chunked[0].chunks.size() == 2);
  CHECK(chunked[0].chunks[0].first_layer == 0);
  CHECK(chunked[0].chunks[1].first_layer == 2);
  CHECK(chunked[1].chunks[1].first_layer == 3);
  CHECK(chunked[0].layers == 2);
  CHECK(chunked[0].embedding);
  CHECK(chunked[1].head);
  CHECK(plan::stage_memory(inter, chunked[0], 1, 0, false).state() == 551424);  // measured
  CHECK(chunked[0].slots == 5);
  CHECK(chunked[1].slots == 3);
  CHECK(chunked[0].sends == 12);
  CHECK(chunked[0].sent_p2p == 98304.0);  // measured
  CHECK(chunked[1].sends == 12);

  // 4 ranks: 2 stages x tensor 2 with sequence parallelism, fp32; rank 0 is tensor rank 0 (125 of
  // the 251 vocabulary rows). Measured: state_bytes 286,720 (17,920 parameters x 16 B); 4 sends of
  // (64 / 2 tokens, 32) f32, 16,384 bytes; the tied rows 125 x 32 x 4 + 16 = 16,016 bytes; the
  // tensor group 364,552 bytes: per micro-batch 13 all-gathers and 9 reduce-scatters of half of
  // 64 x 32 f32 (90,112 B) and 4 norms' weight and bias gradients (1,024 B), 4 micro-batches, and
  // the norm's 8 B.
  config::Config tsp = gpt;
  tsp.dist.tensor_parallel = 2;
  tsp.dist.sequence_parallel = true;
  stages = plan::pipeline_stages(tsp, 2, false, 4, 0);
  CHECK(stages[0].share.params == 17920);
  CHECK(plan::stage_memory(tsp, stages[0], 1, 0, false).state() == 286720);
  CHECK(stages[0].sent_p2p == 16384.0);
  CHECK(stages[0].sent_pipeline_collectives == 16016.0);
  CHECK(stages[0].sent_tensor == 364552.0);
  CHECK(stages[0].sent_tensor == 4 * (90112.0 + 1024.0) + 8.0);
  // plan prints the rank with the most rows: tensor rank 1, one more row of wte.
  const auto most = plan::pipeline_stages(tsp, 2, false, 4);
  CHECK(most[0].share.tensor_rank == 1);
  CHECK(most[0].share.params == 17920 + 32);

  // 4 ranks: a tiny Llama (untied, 2 kv heads), 2 stages x data 2, ZeRO 1, bf16, 4 micro-batches.
  // Measured: state_bytes 624,000 (31,200 parameters: 6 + 4 B each, m and v of 15,600, and the
  // padded buffer and shard 3 x 15,600 x 4 B); 4 sends of (64, 32) bf16, 16,384 bytes; the pipeline
  // group only the loss and norm doubles; the data group's reduce-scatter and all-gather 2 x
  // 15,600 x 4 bytes.
  config::Config llama;
  llama.model = shape(config::Arch::llama, 251, 32, 4, 4, 2, 32, 88, false);
  llama.train.micro_batch_size = 2;
  llama.train.global_batch_size = 16;
  llama.train.precision = config::Precision::bf16;
  llama.dist.pipeline_parallel = 2;
  llama.dist.zero_stage = 1;
  stages = plan::pipeline_stages(llama, 1, true, 4);
  CHECK(stages[0].share.params == 31200);
  CHECK(plan::stage_memory(llama, stages[0], 2, 1, true).state() == 624000);
  CHECK(stages[0].sent_p2p == 16384.0);
  CHECK_FALSE(stages[0].tied);
  CHECK(stages[0].sent_pipeline_collectives == 16.0);
  CHECK(plan::update_traffic(llama, stages[0].share, 2, 1, true, 4).bytes == 124800.0);

  // 4 stages: the middle ones send both ways; the ring all-reduce sends 2 x 3/4 of the buffer.
  gpt.dist.pipeline_parallel = 4;
  stages = plan::pipeline_stages(gpt, 1, false, 8);
  REQUIRE(stages.size() == 4);
  const std::vector<std::int64_t> sends = {8, 16, 16, 8}, slots = {4, 3, 2, 1};
  for (std::size_t s = 0; s < 4; ++s) {
    CAPTURE(s);
    CHECK(stages[s].layers == 1);
    CHECK(stages[s].sends == sends[s]);
    CHECK(stages[s].sent_p2p == double(sends[s]) * 2 * 32 * 32 * 4);
    CHECK(stages[s].slots == slots[s]);
    CHECK(stages[s].sent_pipeline_collectives == 1.5 * (251 * 32 * 4 + 16));
  }
  CHECK(stages[1].share.params == 12704);  // a middle stage: one layer, no embedding, no head
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

TEST_CASE("plan: context parallelism's activations, attention work buffer and ring bytes, by hand", "[plan][context]") {
  // tiny Llama: 2 heads of 2, 1 key/value head, 3 layers; sequences of 64 split over 4 ranks.
  config::Config c = tiny_llama();
  c.model.context_length = 64;
  c.dist.context_parallel = 4;
  // A rank's activations are a whole model's at 16-token sequences.
  config::ModelConfig short_sequences = c.model;
  short_sequences.context_length = 16;
  CHECK(plan::activation_bytes(c.model, false, config::Recompute::none, 2, 1, false, 4) ==
        plan::activation_bytes(short_sequences, false, config::Recompute::none, 2));
  // N = 2 x 16 = 32 tokens, K = 2 x 1 x 2 = 4, C = 4, qkv width 8, 2 heads, ffn 6. The layer's
  // backward scratch, fp32: ln1 (32 x 4 x 4 = 512), qkv and its rotated twin (1024 each), atty
  // (512), ln2 (512), gate, up, swi (768 each): 5888 bytes, 2816 of them past atty. Ring, fp32:
  // forward's 2 blocks in flight (2 x 32 x 4 x 4), a block's result (32 x 4 x 4) and log-sum-exps
  // (2 x 32 x 4): 1792 <= 5888; backward's 2 blocks and 2 f32 accumulators: 2048 <= 2816. Both
  // borrowed: no buffer of its own.
  CHECK(plan::context_scratch_bytes(c, 1, false, 2) == 0);
  // bf16: a scratch of 2944, 1408 past atty; backward's 2 bf16 blocks (512), 2 f32 accumulators
  // (1024) and the f32 query gradients (32 x 8 x 4 = 1024): 2560 of its own (forward's 1792, with
  // the f32 running result, is borrowed).
  CHECK(plan::context_scratch_bytes(c, 1, true, 2) == 2560);
  // All-gather: every rank's block and its own (5 x 512) forward, borrowed (3328); backward the
  // blocks and their 5 f32 gradient blocks: 5120 of its own.
  c.dist.context_parallel_mode = config::ContextParallelMode::allgather;
  CHECK(plan::context_scratch_bytes(c, 1, false, 2) == 5120);
  c.dist.context_parallel_mode = config::ContextParallelMode::ring;
  // Per layer and micro-batch: 3 blocks of 32 x 4 values forward (fp32 512 B each; bf16 256 B),
  // backward 3 again and 3 f32 gradient blocks.
  CHECK(plan::context_layer_bytes(c, 1, false, false) == 3 * 512.0);
  CHECK(plan::context_layer_bytes(c, 1, true, false) == 3 * 256.0);
  CHECK(plan::context_layer_bytes(c, 1, false, true) == 3 * 1024.0);
  CHECK(plan::context_layer_bytes(c, 1, true, true) == 3 * 768.0);
  // An update of 6 micro-steps (12 sequences / 2), 3 layers; recompute full runs forward twice.
  CHECK(plan::context_traffic(c, 1, false, 6) == 6 * 3 * (1536.0 + 3072.0));
  c.train.recompute = config::Recompute::full;
  CHECK(plan::context_traffic(c, 1, false, 6) == 6 * 3 * (2 * 1536.0 + 3072.0));
  c.dist.context_parallel = 1;
  CHECK(plan::context_traffic(c, 1, false, 6) == 0.0);
  CHECK(plan::context_scratch_bytes(c, 1, false, 2) == 0);
}

TEST_CASE("plan: --suggest weighs context parallelism for long sequences only", "[plan][context]") {
  config::Config c = tiny_llama();
  c.train.global_batch_size = 8;
  for (const auto& o : plan::mesh_options(c, 4)) CHECK(o.mesh.size(dist::Axis::context) == 1);  // 8 tokens: none
  c.model.context_length = 8192;
  bool found = false;
  for (const auto& o : plan::mesh_options(c, 4)) {
    if (o.mesh.size(dist::Axis::context) != 2 || o.mesh.size(dist::Axis::tensor) != 1 || o.mesh.size(dist::Axis::pipeline) != 1 || o.zero_stage != 1) continue;
    // 1 x 2 x 1 cp2, ZeRO 1: gradients summed and sharded over the 4 context x data ranks; 8 /
    // (2 x 2) = 2 micro-steps; memory and bytes as plan_memory, update_traffic and context_traffic.
    found = true;
    config::Config cp = c;
    cp.dist.context_parallel = 2;
    CHECK(o.mesh.size(dist::Axis::data) == 2);
    CHECK(o.micro_steps == 2);
    CHECK(o.memory == plan::plan_memory(cp, 4, 1, false, 2).total());
    CHECK(o.context_sent == plan::context_traffic(cp, 1, false, 2));
    CHECK(o.sent == plan::update_traffic(cp, 4, 1, false, 2).bytes + o.context_sent);
  }
  CHECK(found);
}

TEST_CASE("plan: Muon's owner gathers and scatters in the data group's traffic, as measured", "[plan][muon]") {
  // tests/mesh_equivalence_test.py's "muon" and "llama-muon" models (4 layers, d_model 32), rank
  // 0's point-to-point sends of an update as the runs count them (metrics.jsonl's collectives
  // "send"; the GPT-2 ZeRO 1 figures are also those of that test's muon_traffic formula).
  struct Measured {
    config::Arch arch;
    int ranks, zero;
    std::int64_t sends;
    double bytes;
  };
  const Measured measured[] = {
      {config::Arch::gpt2, 2, 1, 12, 97728.0},  {config::Arch::gpt2, 4, 1, 11, 65120.0},
      {config::Arch::gpt2, 2, 3, 12, 66304.0},  {config::Arch::gpt2, 4, 3, 12, 65536.0},
      {config::Arch::llama, 2, 1, 14, 55232.0}, {config::Arch::llama, 2, 3, 16, 55296.0},
  };
  for (const Measured& m : measured) {
    CAPTURE(config::to_string(m.arch), m.ranks, m.zero);
    config::Config c;
    c.model = m.arch == config::Arch::gpt2 ? shape(m.arch, 251, 32, 4, 4, 4, 32, 128, true)
                                           : shape(m.arch, 251, 32, 4, 4, 2, 32, 40, false);
    c.optim.name = "muon";
    const plan::RankShare share = plan::rank_share(c.model);
    const plan::UpdateTraffic t = plan::muon_traffic(c, share, m.ranks, m.zero, 0);
    CHECK(t.sends == m.sends);
    CHECK(t.bytes == m.bytes);
    // update_traffic adds the data rank that sends most, on top of ZeRO's collectives (AdamW's).
    double most = 0;
    for (int r = 0; r < m.ranks; ++r) most = std::max(most, plan::muon_traffic(c, share, m.ranks, m.zero, r).bytes);
    CHECK(most >= m.bytes);
    const double muon = plan::update_traffic(c, share, m.ranks, m.zero, false, 1).bytes;
    c.optim.name = "adamw";
    CHECK(muon == plan::update_traffic(c, share, m.ranks, m.zero, false, 1).bytes + most);
    CHECK(plan::muon_traffic(c, share, m.ranks, m.zero, 0).bytes == 0.0);  // AdamW sends nothing of the kind
    c.optim.name = "muon";
    CHECK(plan::muon_traffic(c, share, m.ranks, 0, 0).bytes == 0.0);  // ZeRO 0: every rank holds every matrix
  }
}

namespace {
// tests/mesh_equivalence_test.py's MoE model (4 layers, the first dense, d_model 32, 4 experts
// each token chooses top_k of, one shared expert), micro-batches of 2 sequences, 8 per update.
config::Config mesh_moe_config(std::int64_t top_k) {
  config::Config c;
  c.model = shape(config::Arch::llama, 251, 32, 4, 4, 2, 32, 40, false);
  c.model.moe.enabled = true;
  c.model.moe.experts = 4;
  c.model.moe.top_k = top_k;
  c.model.moe.ffn_hidden = 16;
  c.model.moe.shared_experts = 1;
  c.model.moe.shared_ffn_hidden = 16;
  c.model.moe.first_dense_layers = 1;
  c.train.micro_batch_size = 2;
  c.train.global_batch_size = 8;
  return c;
}
}  // namespace

TEST_CASE("plan: the expert group's all-to-alls and all-reduces per update, as measured", "[plan][moe]") {
  // tests/mesh_equivalence_test.py's "moe-every" model (4 layers, the first dense, d_model 32, 4
  // experts each token chooses all of, one shared expert): rank 0's expert_collectives of an
  // update as its runs count them (the all-to-alls and, at ZeRO 0, the all-reduces are also that
  // test's expert_traffic formula by hand).
  struct Measured {
    int ranks, ep, zero;
    std::int64_t all_to_alls, all_reduces;
    double bytes;
  };
  const Measured measured[] = {
      {2, 2, 0, 30, 9, 393264.0 + 150036.0},
      {4, 4, 0, 15, 9, 294948.0 + 225054.0},
      {4, 2, 1, 15, 8, 196632.0 + 68948.0},
      {2, 2, 3, 30, 14, 393264.0 + 150036.0},
  };
  for (const Measured& m : measured) {
    CAPTURE(m.ranks, m.ep, m.zero);
    const config::Config c = mesh_moe_config(4);
    const plan::RankShare share = plan::rank_share(c.model, 1, -1, m.ep);
    const int D = m.ranks / m.ep;
    const plan::UpdateTraffic t = plan::expert_traffic(c, share, D, m.zero, false, 8 / (2 * m.ranks));
    CHECK(t.all_to_alls == m.all_to_alls);
    CHECK(t.all_reduces == m.all_reduces);
    CHECK(t.bytes == m.bytes);
    // Each expert rank holds the dense parameters and 1 / EP of the experts (3 MoE layers of 4 x 3 x 16 x 32).
    CHECK(share.params == plan::parameter_count(c.model) - 3 * (4 - 4 / m.ep) * 3 * 16 * 32);
    CHECK(plan::expert_traffic(c, plan::rank_share(c.model), D, m.zero, false, 1).bytes == 0.0);  // EP 1: nothing
  }
}

TEST_CASE("plan: a MoE model's tensor and context groups' traffic per update, as measured", "[plan][moe]") {
  // tests/mesh_equivalence_test.py's "moe" model (4 layers, the first dense, d_model 32, 4 experts,
  // top 2, one shared expert) on 2 ranks, 4 micro-steps of 2 sequences: rank 0's collectives of an
  // update as its runs count them (moe-tp2, moe-tp2-sp, moe-cp2). The experts run whole on every
  // tensor rank: the MoE layers' MLPs sum nothing over the tensor group.
  config::Config c = mesh_moe_config(2);
  const plan::UpdateTraffic tp = plan::tensor_traffic(c, 2, false, 4);
  CHECK(tp.all_reduces == 57);
  CHECK(tp.bytes == 396296.0);
  c.dist.sequence_parallel = true;
  const plan::UpdateTraffic sp = plan::tensor_traffic(c, 2, false, 4);
  CHECK(sp.all_gathers == 92);
  CHECK(sp.reduce_scatters == 48);
  CHECK(sp.all_reduces == 45);
  CHECK(sp.bytes == 376832.0 + 196608.0 + 7688.0);
  c.dist.sequence_parallel = false;
  c.dist.context_parallel = 2;
  // The ring's key/value sends, and each MoE layer's router statistics (2 E + 2 doubles) summed.
  CHECK(plan::context_traffic(c, 1, false, 4) == 196608.0 + 960.0);
}
