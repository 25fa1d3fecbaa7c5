// llmtrain plan's arithmetic: ZeRO 3's units, memory per rank and bytes sent per update, each
// against a hand calculation for a tiny model, and the meshes --suggest weighs.
#include <string>
#include <vector>

#include "catch_compat.h"
#include "config/config.h"
#include "train/plan.h"

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
  const auto units = train::shard_units(llama.model);
  REQUIRE(units.size() == 5);
  const std::vector<std::int64_t> sizes = {48, 128, 128, 128, 44};
  const std::vector<bool> layers = {false, true, true, true, false};
  for (std::size_t i = 0; i < units.size(); ++i) {
    CAPTURE(i);
    CHECK(units[i].params == sizes[i]);
    CHECK(units[i].layer == layers[i]);
  }
  CHECK(train::parameter_count(llama.model) == 476);

  // GPT-2, vocab 10, context 8, d_model 4, ffn 16, 2 layers. Root before: ln_f 2 x 4 = 8. Each
  // layer: ln_1 8, c_attn 12 x 4 + 12 = 60, attn.c_proj 16 + 4 = 20, ln_2 8, c_fc 16 x 4 + 16 = 80,
  // mlp.c_proj 4 x 16 + 4 = 68 -> 244. Root after: wpe 8 x 4 = 32, wte 10 x 4 = 40 -> 72.
  const config::ModelConfig gpt2 = shape(config::Arch::gpt2, 10, 8, 2, 2, 2, 4, 16, true);
  const auto g = train::shard_units(gpt2);
  REQUIRE(g.size() == 4);
  CHECK(g[0].params == 8);
  CHECK(g[1].params == 244);
  CHECK(g[2].params == 244);
  CHECK(g[3].params == 72);
  CHECK(train::parameter_count(gpt2) == 568);
}

TEST_CASE("plan: the units add up to the models' own parameter lists for every shipped config", "[plan]") {
  for (const std::string name :
       {"gpt2-124m", "gpt2-350m", "tiny", "tiny-llama", "llama-1b", "llama2-13b", "llama2-70b"}) {
    CAPTURE(name);
    const config::Config c = config::load_config(LLMTRAIN_SOURCE_DIR "/configs/" + name + ".json");
    const std::int64_t P = train::parameter_count(c.model);  // the model's own list (ArchSpec)
    config::ModelConfig no_layers = c.model;
    no_layers.n_layer = 0;
    const std::int64_t root = train::parameter_count(no_layers);
    REQUIRE((P - root) % c.model.n_layer == 0);
    std::int64_t sum = 0, root_units = 0;
    for (const auto& u : train::shard_units(c.model)) {
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
  CHECK(train::parameter_count(config::load_config(LLMTRAIN_SOURCE_DIR "/configs/gpt2-124m.json").model) == 124439808);
  CHECK(train::parameter_count(config::load_config(LLMTRAIN_SOURCE_DIR "/configs/llama2-13b.json").model) ==
        13015864320);
  CHECK(train::parameter_count(config::load_config(LLMTRAIN_SOURCE_DIR "/configs/llama2-70b.json").model) ==
        68976648192);
}

TEST_CASE("plan: memory per rank at ZeRO 0 to 3 over 3 ranks, where padding matters", "[plan]") {
  config::Config c = tiny_llama();
  // ZeRO 0 to 2 (unchanged): P = 476, shard ceil(476 / 3) = 159.
  auto p = train::plan_memory(c, 3, 0, false, 2);
  CHECK(p.weights == 4 * 476);
  CHECK(p.gradients == 4 * 476);
  CHECK(p.optimizer == 8 * 476);
  CHECK(p.gathered == 0);
  const std::int64_t activations = p.activations;
  CHECK(activations == 2 * train::activation_bytes_per_sequence(c.model, false));
  p = train::plan_memory(c, 3, 2, true, 2);
  CHECK(p.weights == 6 * 476);
  CHECK(p.gradients == 4 * 159);
  CHECK(p.optimizer == 8 * 159);

  // ZeRO 3: shards ceil(48/3) + 3 ceil(128/3) + ceil(44/3) = 16 + 3 x 43 + 15 = 160 parameters.
  // Gathered: the roots padded, 3 x 16 + 3 x 15 = 93; layer slots of 3 x 43 = 129 in the compute
  // dtype; f32 gradients for the roots (93) and 2 slots of 129 + 43; f32 scratch of 43.
  p = train::plan_memory(c, 3, 3, false, 2);
  CHECK(p.weights == 4 * 160);
  CHECK(p.gradients == 4 * 160);
  CHECK(p.optimizer == 8 * 160);
  CHECK(p.gathered == 4 * (93 + 2 * 129) + 4 * (93 + 2 * (129 + 43) + 43));  // fp32: 3324
  CHECK(p.activations == activations);
  CHECK(p.total() == 640 + 640 + 1280 + 3324 + activations);
  p = train::plan_memory(c, 3, 3, true, 2);
  CHECK(p.weights == 640);
  CHECK(p.gathered == 2 * (93 + 2 * 129) + 4 * (93 + 2 * (129 + 43) + 43));  // bf16 weights: 2622
  c.dist.reshard_after_forward = false;  // every layer stays gathered from forward to backward
  p = train::plan_memory(c, 3, 3, true, 2);
  CHECK(p.gathered == 2 * (93 + 3 * 129) + 4 * (93 + 2 * (129 + 43) + 43));  // 2880
}

TEST_CASE("plan: ZeRO 3's weights, gradients, optimizer and gathered bytes equal what the trainer holds", "[plan]") {
  // state_bytes of rank 0 (metrics.jsonl) in 1-step mpirun runs of configs/tiny-llama.json with
  // model.n_layer 3 and dist.zero_stage 3: the buffers the trainer allocates, counted by itself.
  struct Measured {
    int ranks;
    bool bf16, reshard;
    std::int64_t state_bytes;
  };
  const Measured measured[] = {{2, false, true, 2650880}, {2, false, false, 2835712}, {2, true, true, 2400384},
                               {2, true, false, 2492800}, {3, false, true, 2101324}, {3, false, false, 2286160},
                               {3, true, true, 1850818},  {3, true, false, 1943236}};
  config::Config c = config::load_config(LLMTRAIN_SOURCE_DIR "/configs/tiny-llama.json");
  c.model.n_layer = 3;
  for (const auto& m : measured) {
    CAPTURE(m.ranks, m.bf16, m.reshard);
    c.dist.reshard_after_forward = m.reshard;
    const auto p = train::plan_memory(c, m.ranks, 3, m.bf16, 1);
    CHECK(p.weights + p.gradients + p.optimizer + p.gathered == m.state_bytes);
  }
}

TEST_CASE("plan: bytes each rank sends per update, against the ring formulas", "[plan]") {
  config::Config c = tiny_llama();
  // ZeRO 0: one all-reduce of 4 x 476 bytes: 2 x 2/3 x 1904.
  auto t = train::update_traffic(c, 3, 0, true, 2);
  CHECK(t.all_reduces == 1);
  CHECK(t.reduce_scatters + t.all_gathers == 0);
  CHECK(t.bytes == Approx(2.0 * 2.0 / 3.0 * 1904.0));
  // ZeRO 1 and 2: reduce-scatter and all-gather of 3 x 159 x 4 bytes, (3-1)/3 of each: 2 x 1272.
  for (const int zero : {1, 2}) {
    t = train::update_traffic(c, 3, zero, true, 2);
    CHECK(t.reduce_scatters == 1);
    CHECK(t.all_gathers == 1);
    CHECK(t.bytes == 2544.0);
  }
  // ZeRO 3, bf16, 2 micro-steps. Per micro-step, each layer: 2 all-gathers of 3 x 43 bf16
  // (2 x 2 x 43 x 2 = 344 sent) and a reduce-scatter of 3 x 43 f32 (2 x 43 x 4 = 344): 3 x 688;
  // the roots' gradients: 2 x (16 + 15) x 4 = 248. Once per update the roots gathered:
  // 2 x (16 + 15) x 2 = 124. Total 2 x (2064 + 248) + 124 = 4748.
  t = train::update_traffic(c, 3, 3, true, 2);
  CHECK(t.all_gathers == 2 * 3 * 2 + 2);
  CHECK(t.reduce_scatters == 5 * 2);
  CHECK(t.all_reduces == 0);
  CHECK(t.bytes == 4748.0);
  // fp32: gathers of 4-byte weights: 2 x (3 x (688 + 344) + 248) + 248 = 6936.
  CHECK(train::update_traffic(c, 3, 3, false, 2).bytes == 6936.0);
  // Without resharding, one gather per layer and micro-step: 2 x (3 x (172 + 344) + 248) + 124.
  c.dist.reshard_after_forward = false;
  t = train::update_traffic(c, 3, 3, true, 2);
  CHECK(t.all_gathers == 3 * 2 + 2);
  CHECK(t.bytes == 3716.0);
  // One rank sends nothing.
  CHECK(train::update_traffic(c, 1, 3, true, 2).bytes == 0.0);
  CHECK(train::update_traffic(c, 1, 0, true, 2).bytes == 0.0);
}

TEST_CASE("plan: the meshes --suggest weighs and their estimates", "[plan]") {
  config::Config c = tiny_llama();
  c.model.n_kv_head = 2;  // so that 2 tensor-parallel ranks divide the heads; layers of 144, P = 524
  c.train.global_batch_size = 8;
  int skipped = -1;
  auto options = train::mesh_options(c, 4, &skipped);
  CHECK(skipped == 0);
  // t x d x p: 1x4x1, 1x2x2, 2x2x1, 2x1x2 (p = 4 > 3 layers and t = 4 > 2 heads left out); at
  // d = 1 only ZeRO 0 and 3.
  CHECK(options.size() == 4 + 4 + 4 + 2);
  const auto find = [&](int t, int d, int p, int zero) {
    for (const auto& o : options) {
      if (o.mesh.tensor == t && o.mesh.data == d && o.mesh.pipeline == p && o.zero_stage == zero) return o;
    }
    FAIL("no option " << t << " x " << d << " x " << p << " ZeRO " << zero);
    return train::MeshOption{};
  };
  // Pure data parallelism: exactly plan_memory and update_traffic; 8 / (2 x 4) = 1 micro-step.
  const auto dp = find(1, 4, 1, 1);
  CHECK(!dp.estimate);
  CHECK(dp.micro_steps == 1);
  CHECK(dp.memory == train::plan_memory(c, 4, 1, false, 2).total());
  CHECK(dp.sent == 2.0 * 3 * 131 * 4);  // reduce-scatter and all-gather of 4 x 131 x 4 bytes
  // 2 x 2 x 1, ZeRO 1, fp32, 2 micro-steps: memory (4 x 524 + 4 x 524 + 8 x 262) / 2 + activations
  // / 2; sent: the data group's 2 x 262 x 4 / 2 = 1048, plus 4 all-reduces (2 x 1/2 of B T C 4 =
  // 2 x 8 x 4 x 4 = 256 bytes) per layer (3) per micro-step (2): 6144.
  const std::int64_t acts = 2 * train::activation_bytes_per_sequence(c.model, false);
  const auto tp = find(2, 2, 1, 1);
  CHECK(tp.estimate);
  CHECK(tp.micro_steps == 2);
  CHECK(tp.memory == 6288 / 2 + acts / 2);
  CHECK(tp.sent == 1048.0 + 6144.0);
  // 1 x 2 x 2, ZeRO 0: a stage of ceil(3 / 2) = 2 layers keeps min(2, 2) micro-batches: acts x 2/3 x 2;
  // sent: the all-reduce 2 x 1/2 x 4 x 524 / 2 = 1048 plus activations out, once per micro-step: 2 x 256.
  const auto pp = find(1, 2, 2, 0);
  CHECK(pp.memory == (4 + 4 + 8) * 524 / 2 + std::int64_t(double(acts) * 2.0 / 3.0 * 2.0));
  CHECK(pp.sent == Approx(1048.0 + 512.0));
  // A global batch of 12 is no multiple of 2 x 4: the 1 x 4 x 1 mesh is left out.
  c.train.global_batch_size = 12;
  options = train::mesh_options(c, 4, &skipped);
  CHECK(skipped == 1);
  CHECK(options.size() == 4 + 4 + 2);
}
