// llmtrain plan's meshes: the layouts --suggest weighs, pipeline stages, Muon's gathers and the
// expert group's traffic, against the trainer's own measurements.
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
