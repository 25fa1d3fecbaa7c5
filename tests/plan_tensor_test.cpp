// llmtrain plan's tensor- and context-parallel arithmetic: memory per rank and each group's
// traffic per update, by hand and against the trainer's own measurements.
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
