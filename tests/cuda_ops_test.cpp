// Every CUDA op against its CPU reference, through the public ops API (which validates and
// dispatches by device), over grids of shapes with odd sizes and misaligned views (offset 1:
// the scalar paths; offset 0 with sizes divisible by 4: the 128-bit paths). Random inputs from
// fixed seeds; accumulating outputs pre-filled with nonzero values; sentinels around every
// device array; NaN/Inf checks; errors normalised by the reference's magnitude: ~1e-5 for
// elementwise ops, ~1e-4 for matmuls and reductions. Without a GPU every case skips visibly.
//
// The bf16 overloads ([cuda][bf16], at the end) are called directly (kernels/nn.h): inputs are
// rounded to bf16 on the host, the fp32 CPU reference (ops/cpu/nn.h) runs on those same rounded
// values, and the kernels' bf16 outputs, widened, must agree to a few bf16 ulps of the largest
// element; their fp32 outputs (weight gradients, statistics) more tightly.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "catch_compat.h"
#include "core/error.h"
#include "cuda_compare.h"
#include "grad_check.h"
#include "ops/cuda/kernels.h"
#include "ops/cuda/stream.h"
#include "ops/buffer.h"
#include "ops/cpu/reference.h"
#include "ops/ops.h"

using namespace llmtrain;
using namespace llmtrain::test;

namespace {

constexpr double elementwise_tolerance = 1e-5;
constexpr double reduction_tolerance = 1e-4;

std::vector<std::int32_t> random_tokens(std::mt19937& rng, std::size_t n, int V) {
  std::uniform_int_distribution<std::int32_t> dist(0, V - 1);
  std::vector<std::int32_t> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

// Row counts N = B * T of the grids.
const std::vector<std::pair<int, int>> batch_shapes = {{1, 1}, {1, 5}, {2, 32}, {1, 257}};
const std::vector<int> channel_sizes = {1, 3, 64, 127, 768};
const std::vector<std::int64_t> element_counts = {1, 3, 4, 5, 1000, 4099, 1 << 20};

}  // namespace

TEST_CASE("cuda encoder matches the cpu reference", "[cuda][ops]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);

  std::mt19937 rng(101);
  for (const auto& [B, T] : batch_shapes) {
    for (const int C : channel_sizes) {
      for (const int V : {7, 1001}) {  // 7: long runs of one token in the sorted backward
        for (const bool positions : {true, false}) {
          for (const std::size_t offset : {0, 1}) {
            CAPTURE(B, T, C, V, positions, offset);
            const int maxT = T + 3;
            std::vector<std::int32_t> inp = random_tokens(rng, std::size_t(B) * T, V);
            Vec wte = uniform_vec(rng, std::size_t(V) * C), wpe = uniform_vec(rng, std::size_t(maxT) * C);
            Vec out = uniform_vec(rng, std::size_t(B) * T * C), dout = uniform_vec(rng, out.size());
            Vec dwte = uniform_vec(rng, wte.size()), dwpe = uniform_vec(rng, wpe.size());

            Vec out_ref = out, dwte_ref = dwte, dwpe_ref = dwpe;
            ops::encoder_forward(t(out_ref, {B, T, C}), ti(inp, {B, T}), t(wte, {V, C}),
                                 positions ? t(wpe, {maxT, C}) : Tensor());
            ops::encoder_backward(t(dwte_ref, {V, C}), positions ? t(dwpe_ref, {maxT, C}) : Tensor(),
                                  t(dout, {B, T, C}), ti(inp, {B, T}));

            const DeviceArray<float> d_out(out, offset), d_wte(wte, offset), d_wpe(wpe, offset),
                d_dout(dout, offset), d_dwte(dwte, offset), d_dwpe(dwpe, offset);
            const DeviceArray<std::int32_t> d_inp(inp, offset);
            ops::encoder_forward(d_out.tensor({B, T, C}), d_inp.tensor({B, T}), d_wte.tensor({V, C}),
                                 positions ? d_wpe.tensor({maxT, C}) : Tensor());
            ops::encoder_backward(d_dwte.tensor({V, C}), positions ? d_dwpe.tensor({maxT, C}) : Tensor(),
                                  d_dout.tensor({B, T, C}), d_inp.tensor({B, T}));

            // Same additions in the same order as the CPU: expected bit-identical.
            require_close("out", d_out.to_host(), out_ref, elementwise_tolerance);
            require_close("dwte", d_dwte.to_host(), dwte_ref, elementwise_tolerance);
            require_changed("dwte", d_dwte.to_host(), dwte);
            if (positions) {
              require_close("dwpe", d_dwpe.to_host(), dwpe_ref, elementwise_tolerance);
              require_changed("dwpe", d_dwpe.to_host(), dwpe);
            } else {
              CHECK(d_dwpe.to_host() == dwpe);  // absent: untouched
            }
            require_guards("out", d_out);
            require_guards("dwte", d_dwte);
            require_guards("dwpe", d_dwpe);
          }
        }
      }
    }
  }
}

TEST_CASE("cuda encoder backward is deterministic", "[cuda][ops]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);

  std::mt19937 rng(102);
  const int B = 4, T = 256, C = 768, V = 50;  // many repeats of every token
  std::vector<std::int32_t> inp = random_tokens(rng, std::size_t(B) * T, V);
  const Vec dout = uniform_vec(rng, std::size_t(B) * T * C), zeros(std::size_t(V) * C, 0.0f);
  std::vector<Vec> results;
  for (int run = 0; run < 3; ++run) {
    const DeviceArray<float> d_dwte(zeros), d_dout(dout);
    const DeviceArray<std::int32_t> d_inp(inp);
    ops::encoder_backward(d_dwte.tensor({V, C}), Tensor(), d_dout.tensor({B, T, C}), d_inp.tensor({B, T}));
    results.push_back(d_dwte.to_host());
  }
  CHECK(results[0] == results[1]);
  CHECK(results[0] == results[2]);
}

TEST_CASE("cuda layernorm matches the cpu reference", "[cuda][ops]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);

  std::mt19937 rng(103);
  for (const auto& [B, T] : batch_shapes) {
    for (const int C : channel_sizes) {
      for (const std::size_t offset : {0, 1}) {
        const std::int64_t N = std::int64_t(B) * T;
        CAPTURE(N, C, offset);
        Vec inp = uniform_vec(rng, std::size_t(N) * C, -2.0f, 3.0f), weight = uniform_vec(rng, C, 0.5f, 1.5f);
        Vec bias = uniform_vec(rng, C), out = uniform_vec(rng, inp.size()), mean = uniform_vec(rng, N),
            rstd = uniform_vec(rng, N);
        Vec dout = uniform_vec(rng, inp.size()), dinp = uniform_vec(rng, inp.size()),
            dweight = uniform_vec(rng, C), dbias = uniform_vec(rng, C);

        Vec out_ref = out, mean_ref = mean, rstd_ref = rstd, dinp_ref = dinp, dweight_ref = dweight,
            dbias_ref = dbias;
        ops::layernorm_forward(t(out_ref, {N, C}), t(mean_ref, {N}), t(rstd_ref, {N}), t(inp, {N, C}),
                               t(weight, {C}), t(bias, {C}));
        ops::layernorm_backward(t(dinp_ref, {N, C}), t(dweight_ref, {C}), t(dbias_ref, {C}), t(dout, {N, C}),
                                t(inp, {N, C}), t(weight, {C}), t(mean_ref, {N}), t(rstd_ref, {N}));

        const DeviceArray<float> d_inp(inp, offset), d_weight(weight, offset), d_bias(bias, offset),
            d_out(out, offset), d_mean(mean, offset), d_rstd(rstd, offset), d_dout(dout, offset),
            d_dinp(dinp, offset), d_dweight(dweight, offset), d_dbias(dbias, offset);
        ops::layernorm_forward(d_out.tensor({N, C}), d_mean.tensor({N}), d_rstd.tensor({N}),
                               d_inp.tensor({N, C}), d_weight.tensor({C}), d_bias.tensor({C}));
        ops::layernorm_backward(d_dinp.tensor({N, C}), d_dweight.tensor({C}), d_dbias.tensor({C}),
                                d_dout.tensor({N, C}), d_inp.tensor({N, C}), d_weight.tensor({C}),
                                d_mean.tensor({N}), d_rstd.tensor({N}));

        require_close("out", d_out.to_host(), out_ref, elementwise_tolerance);
        require_close("mean", d_mean.to_host(), mean_ref, elementwise_tolerance);
        require_close("rstd", d_rstd.to_host(), rstd_ref, elementwise_tolerance);
        require_close("dinp", d_dinp.to_host(), dinp_ref, reduction_tolerance);
        require_close("dweight", d_dweight.to_host(), dweight_ref, reduction_tolerance);
        require_close("dbias", d_dbias.to_host(), dbias_ref, reduction_tolerance);
        if (C > 1) require_changed("dinp", d_dinp.to_host(), dinp);  // C = 1: the gradient is 0
        require_changed("dbias", d_dbias.to_host(), dbias);
        for (const auto* a : {&d_out, &d_mean, &d_rstd, &d_dinp, &d_dweight, &d_dbias})
          require_guards("output", *a);
      }
    }
  }
}

TEST_CASE("cuda matmul matches the cpu reference", "[cuda][ops]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);

  std::mt19937 rng(104);
  for (const auto& [B, T] : batch_shapes) {
    for (const int C : channel_sizes) {
      for (const int OC : {1, 3, 64, 127, 768}) {
        for (const bool with_bias : {true, false}) {
          for (const std::size_t offset : {0, 1}) {
            const std::int64_t N = std::int64_t(B) * T;
            CAPTURE(N, C, OC, with_bias, offset);
            Vec inp = uniform_vec(rng, std::size_t(N) * C), weight = uniform_vec(rng, std::size_t(OC) * C);
            Vec bias = uniform_vec(rng, OC), out = uniform_vec(rng, std::size_t(N) * OC);
            Vec dout = uniform_vec(rng, out.size()), dinp = uniform_vec(rng, inp.size()),
                dweight = uniform_vec(rng, weight.size()), dbias = uniform_vec(rng, OC);

            Vec out_ref = out, dinp_ref = dinp, dweight_ref = dweight, dbias_ref = dbias;
            ops::matmul_forward(t(out_ref, {N, OC}), t(inp, {N, C}), t(weight, {OC, C}),
                                with_bias ? t(bias, {OC}) : Tensor());
            ops::matmul_backward(t(dinp_ref, {N, C}), t(dweight_ref, {OC, C}),
                                 with_bias ? t(dbias_ref, {OC}) : Tensor(), t(dout, {N, OC}), t(inp, {N, C}),
                                 t(weight, {OC, C}));

            const DeviceArray<float> d_inp(inp, offset), d_weight(weight, offset), d_bias(bias, offset),
                d_out(out, offset), d_dout(dout, offset), d_dinp(dinp, offset), d_dweight(dweight, offset),
                d_dbias(dbias, offset);
            ops::matmul_forward(d_out.tensor({N, OC}), d_inp.tensor({N, C}), d_weight.tensor({OC, C}),
                                with_bias ? d_bias.tensor({OC}) : Tensor());
            ops::matmul_backward(d_dinp.tensor({N, C}), d_dweight.tensor({OC, C}),
                                 with_bias ? d_dbias.tensor({OC}) : Tensor(), d_dout.tensor({N, OC}),
                                 d_inp.tensor({N, C}), d_weight.tensor({OC, C}));

            require_close("out", d_out.to_host(), out_ref, reduction_tolerance);
            require_close("dinp", d_dinp.to_host(), dinp_ref, reduction_tolerance);
            require_close("dweight", d_dweight.to_host(), dweight_ref, reduction_tolerance);
            require_changed("dinp", d_dinp.to_host(), dinp);
            require_changed("dweight", d_dweight.to_host(), dweight);
            if (with_bias) {
              require_close("dbias", d_dbias.to_host(), dbias_ref, reduction_tolerance);
              require_changed("dbias", d_dbias.to_host(), dbias);
            } else {
              CHECK(d_dbias.to_host() == dbias);
            }
            for (const auto* a : {&d_out, &d_dinp, &d_dweight, &d_dbias}) require_guards("output", *a);
          }
        }
      }
    }
  }
}

TEST_CASE("cuda attention_decode matches the cpu reference", "[cuda][ops]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);

  std::mt19937 rng(105);
  struct Heads {
    int NH, NKV, HS;
  };
  for (const Heads& h : {Heads{1, 1, 1}, Heads{1, 1, 64}, Heads{4, 4, 16}, Heads{12, 12, 64}, Heads{8, 2, 80},
                         Heads{6, 1, 33}, Heads{2, 1, 1024}}) {
    const int maxT = 130;
    for (const int pos : {0, 1, 7, 100, maxT - 1}) {
      for (const std::size_t offset : {0, 1}) {
        const int C = h.NH * h.HS, KVC = h.NKV * h.HS;
        CAPTURE(h.NH, h.NKV, h.HS, pos, offset);
        Vec q = uniform_vec(rng, C, -2.0f, 2.0f),
            k_cache = uniform_vec(rng, std::size_t(maxT) * KVC, -2.0f, 2.0f);
        Vec v_cache = uniform_vec(rng, k_cache.size()), out = uniform_vec(rng, C);

        Vec out_ref = out;
        ops::attention_decode(t(out_ref, {C}), t(q, {C}), t(k_cache, {maxT, KVC}), t(v_cache, {maxT, KVC}),
                              pos, h.NH, h.NKV);
        const DeviceArray<float> d_q(q, offset), d_k(k_cache, offset), d_v(v_cache, offset),
            d_out(out, offset);
        ops::attention_decode(d_out.tensor({C}), d_q.tensor({C}), d_k.tensor({maxT, KVC}),
                              d_v.tensor({maxT, KVC}), pos, h.NH, h.NKV);
        require_close("out", d_out.to_host(), out_ref, reduction_tolerance);
        require_guards("out", d_out);
      }
    }
  }
}

TEST_CASE("cuda elementwise ops match the cpu reference", "[cuda][ops]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);

  std::mt19937 rng(106);
  for (const std::int64_t N : element_counts) {
    for (const std::size_t offset : {0, 1}) {
      CAPTURE(N, offset);
      const std::size_t n = std::size_t(N);
      Vec x = uniform_vec(rng, n, -5.0f, 5.0f), y = uniform_vec(rng, n, -3.0f, 3.0f),
          dout = uniform_vec(rng, n);
      Vec out = uniform_vec(rng, n), g1 = uniform_vec(rng, n), g2 = uniform_vec(rng, n);
      const DeviceArray<float> d_x(x, offset), d_y(y, offset), d_dout(dout, offset);

      {  // gelu
        Vec out_ref = out, dinp_ref = g1;
        ops::gelu_forward(t(out_ref, {N}), t(x, {N}));
        ops::gelu_backward(t(dinp_ref, {N}), t(x, {N}), t(dout, {N}));
        const DeviceArray<float> d_out(out, offset), d_dinp(g1, offset);
        ops::gelu_forward(d_out.tensor({N}), d_x.tensor({N}));
        ops::gelu_backward(d_dinp.tensor({N}), d_x.tensor({N}), d_dout.tensor({N}));
        require_close("gelu out", d_out.to_host(), out_ref, elementwise_tolerance);
        require_close("gelu dinp", d_dinp.to_host(), dinp_ref, elementwise_tolerance);
        require_changed("gelu dinp", d_dinp.to_host(), g1);
        require_guards("gelu out", d_out);
        require_guards("gelu dinp", d_dinp);
      }
      {  // residual
        Vec out_ref = out, da_ref = g1, db_ref = g2;
        ops::residual_forward(t(out_ref, {N}), t(x, {N}), t(y, {N}));
        ops::residual_backward(t(da_ref, {N}), t(db_ref, {N}), t(dout, {N}));
        const DeviceArray<float> d_out(out, offset), d_da(g1, offset), d_db(g2, offset);
        ops::residual_forward(d_out.tensor({N}), d_x.tensor({N}), d_y.tensor({N}));
        ops::residual_backward(d_da.tensor({N}), d_db.tensor({N}), d_dout.tensor({N}));
        require_close("residual out", d_out.to_host(), out_ref, elementwise_tolerance);
        require_close("residual da", d_da.to_host(), da_ref, elementwise_tolerance);
        require_close("residual db", d_db.to_host(), db_ref, elementwise_tolerance);
        require_changed("residual da", d_da.to_host(), g1);
        for (const auto* a : {&d_out, &d_da, &d_db}) require_guards("residual output", *a);
      }
      {  // swiglu
        Vec out_ref = out, dgate_ref = g1, dup_ref = g2;
        ops::swiglu_forward(t(out_ref, {N}), t(x, {N}), t(y, {N}));
        ops::swiglu_backward(t(dgate_ref, {N}), t(dup_ref, {N}), t(dout, {N}), t(x, {N}), t(y, {N}));
        const DeviceArray<float> d_out(out, offset), d_dgate(g1, offset), d_dup(g2, offset);
        ops::swiglu_forward(d_out.tensor({N}), d_x.tensor({N}), d_y.tensor({N}));
        ops::swiglu_backward(d_dgate.tensor({N}), d_dup.tensor({N}), d_dout.tensor({N}), d_x.tensor({N}),
                             d_y.tensor({N}));
        require_close("swiglu out", d_out.to_host(), out_ref, elementwise_tolerance);
        require_close("swiglu dgate", d_dgate.to_host(), dgate_ref, elementwise_tolerance);
        require_close("swiglu dup", d_dup.to_host(), dup_ref, elementwise_tolerance);
        require_changed("swiglu dgate", d_dgate.to_host(), g1);
        require_changed("swiglu dup", d_dup.to_host(), g2);
        for (const auto* a : {&d_out, &d_dgate, &d_dup}) require_guards("swiglu output", *a);
      }
      require_guards("x", d_x);  // inputs are not written either
    }
  }
}

TEST_CASE("cuda rmsnorm matches the cpu reference", "[cuda][ops]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);

  std::mt19937 rng(107);
  for (const auto& [B, T] : batch_shapes) {
    for (const int C : channel_sizes) {
      for (const std::size_t offset : {0, 1}) {
        const std::int64_t N = std::int64_t(B) * T;
        CAPTURE(N, C, offset);
        Vec inp = uniform_vec(rng, std::size_t(N) * C, -2.0f, 3.0f), weight = uniform_vec(rng, C, 0.5f, 1.5f);
        Vec out = uniform_vec(rng, inp.size()), rstd = uniform_vec(rng, N),
            dout = uniform_vec(rng, inp.size());
        Vec dinp = uniform_vec(rng, inp.size()), dweight = uniform_vec(rng, C);

        Vec out_ref = out, rstd_ref = rstd, dinp_ref = dinp, dweight_ref = dweight;
        ops::rmsnorm_forward(t(out_ref, {N, C}), t(rstd_ref, {N}), t(inp, {N, C}), t(weight, {C}), 1e-5f);
        ops::rmsnorm_backward(t(dinp_ref, {N, C}), t(dweight_ref, {C}), t(dout, {N, C}), t(inp, {N, C}),
                              t(weight, {C}), t(rstd_ref, {N}));

        const DeviceArray<float> d_inp(inp, offset), d_weight(weight, offset), d_out(out, offset),
            d_rstd(rstd, offset), d_dout(dout, offset), d_dinp(dinp, offset), d_dweight(dweight, offset);
        ops::rmsnorm_forward(d_out.tensor({N, C}), d_rstd.tensor({N}), d_inp.tensor({N, C}),
                             d_weight.tensor({C}), 1e-5f);
        ops::rmsnorm_backward(d_dinp.tensor({N, C}), d_dweight.tensor({C}), d_dout.tensor({N, C}),
                              d_inp.tensor({N, C}), d_weight.tensor({C}), d_rstd.tensor({N}));

        require_close("out", d_out.to_host(), out_ref, elementwise_tolerance);
        require_close("rstd", d_rstd.to_host(), rstd_ref, elementwise_tolerance);
        require_close("dinp", d_dinp.to_host(), dinp_ref, reduction_tolerance);
        require_close("dweight", d_dweight.to_host(), dweight_ref, reduction_tolerance);
        require_changed("dinp", d_dinp.to_host(), dinp);
        require_changed("dweight", d_dweight.to_host(), dweight);
        for (const auto* a : {&d_out, &d_rstd, &d_dinp, &d_dweight}) require_guards("output", *a);
      }
    }
  }
}

TEST_CASE("cuda rope matches the cpu reference", "[cuda][ops]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);

  std::mt19937 rng(108);
  for (const auto& [B, T] : std::vector<std::pair<int, int>>{{1, 1}, {1, 5}, {2, 64}, {1, 257}}) {
    for (const int HS : {2, 6, 8, 64, 128}) {
      for (const int H : {1, 3, 12}) {
        for (const int n_rot : {H, H - 1}) {  // H - 1: the last head passes through (qkv's value heads)
          for (const int pos0 : {0, 4000}) {
            for (const std::size_t offset : {0, 1}) {
              CAPTURE(B, T, H, HS, n_rot, pos0, offset);
              const float theta = pos0 ? 500000.0f : 10000.0f;
              const std::size_t n = std::size_t(B) * T * H * HS;
              Vec inp = uniform_vec(rng, n), out = uniform_vec(rng, n), dout = uniform_vec(rng, n),
                  dinp = uniform_vec(rng, n);
              Vec out_ref = out, dinp_ref = dinp;
              ops::rope_forward(t(out_ref, {B, T, H, HS}), t(inp, {B, T, H, HS}), theta, n_rot, pos0);
              ops::rope_backward(t(dinp_ref, {B, T, H, HS}), t(dout, {B, T, H, HS}), theta, n_rot, pos0);
              const DeviceArray<float> d_inp(inp, offset), d_out(out, offset), d_dout(dout, offset),
                  d_dinp(dinp, offset);
              ops::rope_forward(d_out.tensor({B, T, H, HS}), d_inp.tensor({B, T, H, HS}), theta, n_rot, pos0);
              ops::rope_backward(d_dinp.tensor({B, T, H, HS}), d_dout.tensor({B, T, H, HS}), theta, n_rot,
                                 pos0);
              require_close("out", d_out.to_host(), out_ref, elementwise_tolerance);
              require_close("dinp", d_dinp.to_host(), dinp_ref, elementwise_tolerance);
              require_changed("dinp", d_dinp.to_host(), dinp);
              require_guards("out", d_out);
              require_guards("dinp", d_dinp);
            }
          }
        }
      }
    }
  }
}

TEST_CASE("cuda fused_classifier matches the cpu reference", "[cuda][ops]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);

  std::mt19937 rng(109);
  for (const std::int64_t N : {1, 5, 64, 257}) {
    for (const int V : {3, 8, 1001, 50257}) {
      for (const float scale : {0.0f, 0.125f}) {
        for (const std::size_t offset : {0, 1}) {
          CAPTURE(N, V, scale, offset);
          Vec logits = uniform_vec(rng, std::size_t(N) * V, -8.0f, 8.0f), losses = uniform_vec(rng, N);
          std::vector<std::int32_t> targets = random_tokens(rng, N, V);

          Vec logits_ref = logits, losses_ref = losses;
          const double sum_ref =
              ops::fused_classifier(t(logits_ref, {N, V}), t(losses_ref, {N}), ti(targets, {N}), scale);
          const DeviceArray<float> d_logits(logits, offset), d_losses(losses, offset);
          const DeviceArray<std::int32_t> d_targets(targets, offset);
          const double sum = ops::fused_classifier(d_logits.tensor({N, V}), d_losses.tensor({N}),
                                                   d_targets.tensor({N}), scale);

          require_close("losses", d_losses.to_host(), losses_ref, elementwise_tolerance);
          CHECK(std::abs(sum - sum_ref) <= 1e-5 * std::abs(sum_ref));
          if (scale > 0.0f) {
            require_close("dlogits", d_logits.to_host(), logits_ref, elementwise_tolerance);
          } else {
            CHECK(d_logits.to_host() == logits);  // left alone
          }
          require_guards("logits", d_logits);
          require_guards("losses", d_losses);
        }
      }
    }
  }
}

TEST_CASE("cuda fused_classifier propagates a NaN logit to the loss", "[cuda][ops]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);

  std::mt19937 rng(110);
  const std::int64_t N = 3;
  const int V = 1001;
  Vec logits = uniform_vec(rng, std::size_t(N) * V), losses(N, 0.0f);
  logits[std::size_t(V) + 17] = std::nanf("");  // row 1
  std::vector<std::int32_t> targets = {1, 2, 3};
  const DeviceArray<float> d_logits(logits), d_losses(losses);
  const DeviceArray<std::int32_t> d_targets(targets);
  const double sum =
      ops::fused_classifier(d_logits.tensor({N, V}), d_losses.tensor({N}), d_targets.tensor({N}), 1.0f);
  const Vec result = d_losses.to_host();
  CHECK(std::isfinite(result[0]));
  CHECK(std::isnan(result[1]));
  CHECK(std::isfinite(result[2]));
  CHECK(std::isnan(sum));
}

TEST_CASE("cuda sum_squares matches the cpu reference and is deterministic", "[cuda][ops]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);

  std::mt19937 rng(111);
  for (const std::int64_t N : {std::int64_t(1), std::int64_t(3), std::int64_t(5), std::int64_t(1000),
                               std::int64_t(4099), std::int64_t(1) << 20, std::int64_t(3000017)}) {
    for (const std::size_t offset : {0, 1, 2, 3}) {  // every misalignment of the 128-bit body
      CAPTURE(N, offset);
      Vec x = uniform_vec(rng, std::size_t(N), -3.0f, 3.0f);
      const double ref = ops::sum_squares(t(x, {N}));
      const DeviceArray<float> d_x(x, offset);
      const double first = ops::sum_squares(d_x.tensor({N}));
      const double second = ops::sum_squares(d_x.tensor({N}));
      REQUIRE(ref > 0.0);
      CHECK(std::abs(first - ref) <= 1e-10 * ref);  // both in double; float would be ~1e-7
      CHECK(first == second);
      require_guards("x", d_x);
    }
  }
}

TEST_CASE("cuda adamw_update matches the cpu reference", "[cuda][ops]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);

  std::mt19937 rng(112);
  for (const std::int64_t N : element_counts) {
    for (const int step : {1, 10}) {
      for (const std::size_t offset : {0, 1}) {
        CAPTURE(N, step, offset);
        const std::size_t n = std::size_t(N);
        Vec param = uniform_vec(rng, n), grad = uniform_vec(rng, n, -2.0f, 2.0f),
            m = uniform_vec(rng, n, -0.1f, 0.1f);
        Vec v = uniform_vec(rng, n, 0.0f, 0.01f);
        // A large learning rate, so that the change of the parameters is far above their rounding.
        const ops::AdamWParams p{0.05f, 0.9f, 0.95f, 1e-8f, 0.1f, step, 0.5f};
        Vec param_ref = param, m_ref = m, v_ref = v;
        ops::adamw_update(t(param_ref, {N}), t(grad, {N}), t(m_ref, {N}), t(v_ref, {N}), p);
        const DeviceArray<float> d_param(param, offset), d_grad(grad, offset), d_m(m, offset), d_v(v, offset);
        ops::adamw_update(d_param.tensor({N}), d_grad.tensor({N}), d_m.tensor({N}), d_v.tensor({N}), p);

        Vec delta_ref(n), delta(n);
        const Vec param_result = d_param.to_host();
        for (std::size_t i = 0; i < n; ++i) {
          delta_ref[i] = param_ref[i] - param[i];
          delta[i] = param_result[i] - param[i];
        }
        require_close("param change", delta, delta_ref, elementwise_tolerance);
        require_close("m", d_m.to_host(), m_ref, elementwise_tolerance);
        require_close("v", d_v.to_host(), v_ref, elementwise_tolerance);
        for (const auto* a : {&d_param, &d_m, &d_v}) require_guards("output", *a);
      }
    }
  }
}

TEST_CASE("cuda ops refuse arguments on different devices", "[cuda][ops]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);

  Vec a(4, 1.0f), out(4);
  const DeviceArray<float> d_b(a);
  CHECK_THROWS_AS(ops::residual_forward(t(out, {4}), t(a, {4}), d_b.tensor({4})), RuntimeError);
}

// ---- bf16 (mixed precision) overloads ---------------------------------------------------------

namespace {

// bf16 outputs: the rounding of the result alone is up to 2^-9 relative (half an ulp), so 1e-2
// of the largest reference element is a few ulps. fp32 outputs of bf16 ops see the same bf16
// inputs as the reference and differ only in summation order: 2e-3 is loose for them.
constexpr double bf16_tolerance = 1e-2;
constexpr double bf16_fp32_tolerance = 2e-3;

const std::vector<std::pair<int, int>> bf16_batch_shapes = {{1, 1}, {2, 17}, {1, 257}};
// 64 and 768 take the 128-bit paths (8 bf16) at offset 0; 1, 3 and 127 the scalar ones.
const std::vector<int> bf16_channel_sizes = {1, 3, 64, 127, 768};
const std::vector<std::int64_t> bf16_element_counts = {1, 3, 8, 9, 1000, 4099, 1 << 20};

cudaStream_t stream() {
  return cuda::compute_stream();
}
cuda::bf16* bf(const DeviceArray<Bf16>& a) {
  return reinterpret_cast<cuda::bf16*>(a.data());
}
// A host vector rounded to bf16, on the device.
DeviceArray<Bf16> device_bf16(const Vec& v, std::size_t offset) {
  return DeviceArray<Bf16>(to_bf16(v), offset);
}
Vec host(const DeviceArray<Bf16>& a) {
  return to_float(a.to_host());
}
// Uniform random values already rounded to bf16 (what a bf16 tensor can hold).
Vec uniform_bf16(std::mt19937& rng, std::size_t n, float lo = -1.0f, float hi = 1.0f) {
  return round_bf16(uniform_vec(rng, n, lo, hi));
}

// require_changed for a bf16 output that was accumulated into: an increment below half an ulp
// of the old value leaves a bf16 element as it was, so with a handful of elements "nothing
// changed" can be right; from 64 elements on, some must have changed.
void require_changed_bf16(const std::string& what, const Vec& after, const Vec& before) {
  if (after.size() >= 64) require_changed(what, after, before);
}

std::uint32_t bits_of(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

}  // namespace

TEST_CASE("cuda bf16 convert widens exactly and rounds to nearest even", "[cuda][bf16]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);

  // Every one of the 65536 bf16 values widens to the float with the same upper bits (NaN payloads
  // too), and rounds back to itself (NaNs to a NaN).
  std::vector<Bf16> all(65536);
  for (std::size_t i = 0; i < all.size(); ++i) all[i].bits = std::uint16_t(i);
  const std::int64_t n_all = std::int64_t(all.size());
  for (const std::size_t offset : {0, 1}) {
    CAPTURE(offset);
    const DeviceArray<Bf16> d_all(all, offset),
        d_back(std::vector<Bf16>(all.size(), sentinel<Bf16>()), offset);
    const DeviceArray<float> d_wide(Vec(all.size(), sentinel<float>()), offset);
    cuda::convert(d_wide.data(), bf(d_all), n_all, stream());
    cuda::convert(bf(d_back), d_wide.data(), n_all, stream());
    const Vec wide = d_wide.to_host();
    const std::vector<Bf16> back = d_back.to_host();
    std::size_t wrong_wide = 0, wrong_back = 0;
    for (std::size_t i = 0; i < all.size(); ++i) {
      if (bits_of(wide[i]) != std::uint32_t(i) << 16) ++wrong_wide;
      const bool nan = std::isnan(to_float(all[i]));
      if (nan ? !std::isnan(to_float(back[i])) : back[i].bits != all[i].bits) ++wrong_back;
    }
    CHECK(wrong_wide == 0);
    CHECK(wrong_back == 0);
    require_guards("wide", d_wide);
    require_guards("back", d_back);
  }

  // float -> bf16 on random bit patterns (every exponent, subnormals, infinities, NaNs) after a
  // list of ties and edge cases, against the host's round-to-nearest-even.
  const std::vector<std::uint32_t> edge_bits = {
      0x00000000, 0x80000000, 0x7f800000, 0xff800000, 0x7fc00000, 0xffc00001,  // zeros, infinities, NaNs
      0x3f808000, 0x3f818000, 0xbf808000, 0xbf818000,  // ties: to even down, to even up
      0x3f808001, 0x3f807fff,                          // just above, just below a tie
      0x00008000, 0x00018000, 0x00000001, 0x007fffff,  // subnormal ties and extremes
      0x7f7f7fff, 0x7f7f8000, 0x7f7fffff, 0xff7fffff,  // the top of the range: stays, overflows
      0x00800000, 0x3f800000, 0x4b7fffff};
  std::mt19937 rng(200);
  for (const std::int64_t N : {std::int64_t(1), std::int64_t(3), std::int64_t(8), std::int64_t(9),
                               std::int64_t(4099), std::int64_t(1) << 20}) {
    for (const std::size_t offset : {0, 1}) {
      CAPTURE(N, offset);
      Vec x(static_cast<std::size_t>(N));
      for (std::size_t i = 0; i < x.size(); ++i) {
        const std::uint32_t u = i < edge_bits.size() ? edge_bits[i] : std::uint32_t(rng());
        std::memcpy(&x[i], &u, sizeof u);
      }
      const DeviceArray<float> d_x(x, offset);
      const DeviceArray<Bf16> d_y(std::vector<Bf16>(x.size(), sentinel<Bf16>()), offset);
      cuda::convert(bf(d_y), d_x.data(), N, stream());
      const std::vector<Bf16> y = d_y.to_host();
      std::size_t wrong = 0, first_wrong = x.size();
      for (std::size_t i = 0; i < x.size(); ++i) {
        const Bf16 want = to_bf16(x[i]);
        const bool ok = std::isnan(x[i]) ? std::isnan(to_float(y[i])) : y[i].bits == want.bits;
        if (!ok && wrong++ == 0) first_wrong = i;
      }
      INFO(wrong << " elements rounded differently from the host, the first at " << first_wrong
                 << (first_wrong < x.size()
                         ? " (float bits " + std::to_string(bits_of(x[first_wrong])) + ", device bf16 bits " +
                               std::to_string(y[first_wrong].bits) + ", host " +
                               std::to_string(to_bf16(x[first_wrong]).bits) + ")"
                         : std::string()));
      CHECK(wrong == 0);
      require_guards("bf16 out", d_y);
      require_guards("float in", d_x);
    }
  }
}

TEST_CASE("cuda bf16 encoder matches the cpu reference", "[cuda][bf16]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);

  std::mt19937 rng(201);
  for (const auto& [B, T] : bf16_batch_shapes) {
    for (const int C : bf16_channel_sizes) {
      for (const int V : {7, 1001}) {
        for (const bool positions : {true, false}) {
          for (const std::size_t offset : {0, 1}) {
            CAPTURE(B, T, C, V, positions, offset);
            const int maxT = T + 3;
            std::vector<std::int32_t> inp = random_tokens(rng, std::size_t(B) * T, V);
            const Vec wte = uniform_bf16(rng, std::size_t(V) * C),
                      wpe = uniform_bf16(rng, std::size_t(maxT) * C);
            const Vec out = uniform_bf16(rng, std::size_t(B) * T * C), dout = uniform_bf16(rng, out.size());
            const Vec dwte = uniform_vec(rng, wte.size()), dwpe = uniform_vec(rng, wpe.size());  // fp32

            Vec out_ref = out, dwte_ref = dwte, dwpe_ref = dwpe;
            cpu::encoder_forward(out_ref.data(), inp.data(), wte.data(), positions ? wpe.data() : nullptr, B,
                                 T, C);
            cpu::encoder_backward(dwte_ref.data(), positions ? dwpe_ref.data() : nullptr, dout.data(),
                                  inp.data(), B, T, C);

            const DeviceArray<Bf16> d_out = device_bf16(out, offset), d_wte = device_bf16(wte, offset),
                                    d_wpe = device_bf16(wpe, offset), d_dout = device_bf16(dout, offset);
            const DeviceArray<float> d_dwte(dwte, offset), d_dwpe(dwpe, offset);
            const DeviceArray<std::int32_t> d_inp(inp, offset);
            cuda::encoder_forward(bf(d_out), d_inp.data(), bf(d_wte), positions ? bf(d_wpe) : nullptr, B, T,
                                  C, stream());
            cuda::encoder_backward(d_dwte.data(), positions ? d_dwpe.data() : nullptr, bf(d_dout),
                                   d_inp.data(), B, T, C, stream());

            require_close("out", host(d_out), out_ref, bf16_tolerance);
            require_close("dwte", d_dwte.to_host(), dwte_ref, bf16_fp32_tolerance);
            require_changed("dwte", d_dwte.to_host(), dwte);
            if (positions) {
              require_close("dwpe", d_dwpe.to_host(), dwpe_ref, bf16_fp32_tolerance);
              require_changed("dwpe", d_dwpe.to_host(), dwpe);
            } else {
              CHECK(d_dwpe.to_host() == dwpe);  // absent: untouched
            }
            require_guards("out", d_out);
            require_guards("dwte", d_dwte);
            require_guards("dwpe", d_dwpe);
          }
        }
      }
    }
  }
}

TEST_CASE("cuda bf16 layernorm matches the cpu reference", "[cuda][bf16]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);

  std::mt19937 rng(203);
  for (const auto& [B, T] : bf16_batch_shapes) {
    for (const int C : bf16_channel_sizes) {
      for (const std::size_t offset : {0, 1}) {
        const std::int64_t N = std::int64_t(B) * T;
        CAPTURE(N, C, offset);
        const std::size_t n = std::size_t(N) * std::size_t(C);
        const Vec inp = uniform_bf16(rng, n, -2.0f, 3.0f), weight = uniform_bf16(rng, C, 0.5f, 1.5f),
                  bias = uniform_bf16(rng, C), out = uniform_bf16(rng, n), dout = uniform_bf16(rng, n),
                  dinp = uniform_bf16(rng, n);
        const Vec mean = uniform_vec(rng, N), rstd = uniform_vec(rng, N), dweight = uniform_vec(rng, C),
                  dbias = uniform_vec(rng, C);  // fp32

        Vec out_ref = out, mean_ref = mean, rstd_ref = rstd, dinp_ref = dinp, dweight_ref = dweight,
            dbias_ref = dbias;
        cpu::layernorm_forward(out_ref.data(), mean_ref.data(), rstd_ref.data(), inp.data(), weight.data(),
                               bias.data(), N, C);
        cpu::layernorm_backward(dinp_ref.data(), dweight_ref.data(), dbias_ref.data(), dout.data(),
                                inp.data(), weight.data(), mean_ref.data(), rstd_ref.data(), N, C);

        const DeviceArray<Bf16> d_inp = device_bf16(inp, offset), d_weight = device_bf16(weight, offset),
                                d_bias = device_bf16(bias, offset), d_out = device_bf16(out, offset),
                                d_dout = device_bf16(dout, offset), d_dinp = device_bf16(dinp, offset);
        const DeviceArray<float> d_mean(mean, offset), d_rstd(rstd, offset), d_dweight(dweight, offset),
            d_dbias(dbias, offset);
        cuda::layernorm_forward(bf(d_out), d_mean.data(), d_rstd.data(), bf(d_inp), bf(d_weight), bf(d_bias),
                                N, C, stream());
        cuda::layernorm_backward(bf(d_dinp), d_dweight.data(), d_dbias.data(), bf(d_dout), bf(d_inp),
                                 bf(d_weight), d_mean.data(), d_rstd.data(), N, C, stream());

        require_close("out", host(d_out), out_ref, bf16_tolerance);
        require_close("mean", d_mean.to_host(), mean_ref, bf16_fp32_tolerance);
        require_close("rstd", d_rstd.to_host(), rstd_ref, bf16_fp32_tolerance);
        require_close("dinp", host(d_dinp), dinp_ref, bf16_tolerance);
        require_close("dweight", d_dweight.to_host(), dweight_ref, bf16_fp32_tolerance);
        require_close("dbias", d_dbias.to_host(), dbias_ref, bf16_fp32_tolerance);
        if (C > 1) require_changed_bf16("dinp", host(d_dinp), dinp);  // C = 1: the gradient is 0
        require_changed("dbias", d_dbias.to_host(), dbias);
        for (const auto* a : {&d_out, &d_dinp}) require_guards("bf16 output", *a);
        for (const auto* a : {&d_mean, &d_rstd, &d_dweight, &d_dbias}) require_guards("fp32 output", *a);
      }
    }
  }
}

TEST_CASE("cuda bf16 matmul matches the cpu reference", "[cuda][bf16]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);

  std::mt19937 rng(204);
  for (const auto& [B, T] : bf16_batch_shapes) {
    for (const int C : bf16_channel_sizes) {
      for (const int OC : {1, 3, 64, 127, 768}) {
        for (const bool with_bias : {true, false}) {
          for (const std::size_t offset : {0, 1}) {  // offset 1: 2-byte aligned views, odd bias address
            const std::int64_t N = std::int64_t(B) * T;
            CAPTURE(N, C, OC, with_bias, offset);
            const Vec inp = uniform_bf16(rng, std::size_t(N) * C),
                      weight = uniform_bf16(rng, std::size_t(OC) * C), bias = uniform_bf16(rng, OC),
                      out = uniform_bf16(rng, std::size_t(N) * OC), dout = uniform_bf16(rng, out.size()),
                      dinp = uniform_bf16(rng, inp.size());
            const Vec dweight = uniform_vec(rng, weight.size()), dbias = uniform_vec(rng, OC);  // fp32

            Vec out_ref = out, dinp_ref = dinp, dweight_ref = dweight, dbias_ref = dbias;
            cpu::matmul_forward(out_ref.data(), inp.data(), weight.data(), with_bias ? bias.data() : nullptr,
                                N, C, OC);
            cpu::matmul_backward(dinp_ref.data(), dweight_ref.data(), with_bias ? dbias_ref.data() : nullptr,
                                 dout.data(), inp.data(), weight.data(), N, C, OC);

            const DeviceArray<Bf16> d_inp = device_bf16(inp, offset), d_weight = device_bf16(weight, offset),
                                    d_bias = device_bf16(bias, offset), d_out = device_bf16(out, offset),
                                    d_dout = device_bf16(dout, offset), d_dinp = device_bf16(dinp, offset);
            const DeviceArray<float> d_dweight(dweight, offset), d_dbias(dbias, offset);
            cuda::matmul_forward(bf(d_out), bf(d_inp), bf(d_weight), with_bias ? bf(d_bias) : nullptr, N, C,
                                 OC, stream());
            cuda::matmul_backward(bf(d_dinp), d_dweight.data(), with_bias ? d_dbias.data() : nullptr,
                                  bf(d_dout), bf(d_inp), bf(d_weight), N, C, OC, stream());

            require_close("out", host(d_out), out_ref, bf16_tolerance);
            require_close("dinp", host(d_dinp), dinp_ref, bf16_tolerance);
            require_close("dweight", d_dweight.to_host(), dweight_ref, bf16_fp32_tolerance);
            require_changed_bf16("dinp", host(d_dinp), dinp);
            require_changed("dweight", d_dweight.to_host(), dweight);
            if (with_bias) {
              require_close("dbias", d_dbias.to_host(), dbias_ref, bf16_fp32_tolerance);
              require_changed("dbias", d_dbias.to_host(), dbias);
            } else {
              CHECK(d_dbias.to_host() == dbias);
            }
            for (const auto* a : {&d_out, &d_dinp, &d_bias}) require_guards("bf16 array", *a);
            for (const auto* a : {&d_dweight, &d_dbias}) require_guards("fp32 output", *a);
          }
        }
      }
    }
  }
}

TEST_CASE("cuda bf16 attention_decode matches the cpu reference", "[cuda][bf16]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);

  std::mt19937 rng(205);
  struct Heads {
    int NH, NKV, HS;
  };
  for (const Heads& h : {Heads{1, 1, 1}, Heads{4, 4, 16}, Heads{12, 12, 64}, Heads{8, 2, 80}, Heads{6, 1, 33},
                         Heads{2, 1, 1024}}) {
    const int maxT = 130;
    for (const int pos : {0, 7, maxT - 1}) {
      for (const std::size_t offset : {0, 1}) {
        const int C = h.NH * h.HS, KVC = h.NKV * h.HS;
        CAPTURE(h.NH, h.NKV, h.HS, pos, offset);
        const Vec q = uniform_bf16(rng, C, -2.0f, 2.0f),
                  k_cache = uniform_bf16(rng, std::size_t(maxT) * KVC, -2.0f, 2.0f),
                  v_cache = uniform_bf16(rng, k_cache.size()), out = uniform_bf16(rng, C);
        Vec out_ref = out;
        cpu::attention_decode(out_ref.data(), q.data(), k_cache.data(), v_cache.data(), pos, C, h.NH, h.NKV);
        const DeviceArray<Bf16> d_q = device_bf16(q, offset), d_k = device_bf16(k_cache, offset),
                                d_v = device_bf16(v_cache, offset), d_out = device_bf16(out, offset);
        cuda::attention_decode(bf(d_out), bf(d_q), bf(d_k), bf(d_v), pos, C, h.NH, h.NKV, stream());
        require_close("out", host(d_out), out_ref, bf16_tolerance);
        require_guards("out", d_out);
      }
    }
  }
}

TEST_CASE("cuda bf16 elementwise ops match the cpu reference", "[cuda][bf16]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);

  std::mt19937 rng(206);
  for (const std::int64_t N : bf16_element_counts) {
    for (const std::size_t offset : {0, 1}) {
      CAPTURE(N, offset);
      const std::size_t n = std::size_t(N);
      const Vec x = uniform_bf16(rng, n, -5.0f, 5.0f), y = uniform_bf16(rng, n, -3.0f, 3.0f),
                dout = uniform_bf16(rng, n), out = uniform_bf16(rng, n), g1 = uniform_bf16(rng, n),
                g2 = uniform_bf16(rng, n);
      const DeviceArray<Bf16> d_x = device_bf16(x, offset), d_y = device_bf16(y, offset),
                              d_dout = device_bf16(dout, offset);

      {  // gelu
        Vec out_ref = out, dinp_ref = g1;
        cpu::gelu_forward(out_ref.data(), x.data(), N);
        cpu::gelu_backward(dinp_ref.data(), x.data(), dout.data(), N);
        const DeviceArray<Bf16> d_out = device_bf16(out, offset), d_dinp = device_bf16(g1, offset);
        cuda::gelu_forward(bf(d_out), bf(d_x), N, stream());
        cuda::gelu_backward(bf(d_dinp), bf(d_x), bf(d_dout), N, stream());
        require_close("gelu out", host(d_out), out_ref, bf16_tolerance);
        require_close("gelu dinp", host(d_dinp), dinp_ref, bf16_tolerance);
        require_changed_bf16("gelu dinp", host(d_dinp), g1);
        require_guards("gelu out", d_out);
        require_guards("gelu dinp", d_dinp);
      }
      {  // residual
        Vec out_ref = out, da_ref = g1, db_ref = g2;
        cpu::residual_forward(out_ref.data(), x.data(), y.data(), N);
        cpu::residual_backward(da_ref.data(), db_ref.data(), dout.data(), N);
        const DeviceArray<Bf16> d_out = device_bf16(out, offset), d_da = device_bf16(g1, offset),
                                d_db = device_bf16(g2, offset);
        cuda::residual_forward(bf(d_out), bf(d_x), bf(d_y), N, stream());
        cuda::residual_backward(bf(d_da), bf(d_db), bf(d_dout), N, stream());
        require_close("residual out", host(d_out), out_ref, bf16_tolerance);
        require_close("residual da", host(d_da), da_ref, bf16_tolerance);
        require_close("residual db", host(d_db), db_ref, bf16_tolerance);
        require_changed_bf16("residual da", host(d_da), g1);
        for (const auto* a : {&d_out, &d_da, &d_db}) require_guards("residual output", *a);
      }
      {  // swiglu
        Vec out_ref = out, dgate_ref = g1, dup_ref = g2;
        cpu::swiglu_forward(out_ref.data(), x.data(), y.data(), N);
        cpu::swiglu_backward(dgate_ref.data(), dup_ref.data(), dout.data(), x.data(), y.data(), N);
        const DeviceArray<Bf16> d_out = device_bf16(out, offset), d_dgate = device_bf16(g1, offset),
                                d_dup = device_bf16(g2, offset);
        cuda::swiglu_forward(bf(d_out), bf(d_x), bf(d_y), N, stream());
        cuda::swiglu_backward(bf(d_dgate), bf(d_dup), bf(d_dout), bf(d_x), bf(d_y), N, stream());
        require_close("swiglu out", host(d_out), out_ref, bf16_tolerance);
        require_close("swiglu dgate", host(d_dgate), dgate_ref, bf16_tolerance);
        require_close("swiglu dup", host(d_dup), dup_ref, bf16_tolerance);
        require_changed_bf16("swiglu dgate", host(d_dgate), g1);
        require_changed_bf16("swiglu dup", host(d_dup), g2);
        for (const auto* a : {&d_out, &d_dgate, &d_dup}) require_guards("swiglu output", *a);
      }
      require_guards("x", d_x);  // inputs are not written either
    }
  }
}

TEST_CASE("cuda bf16 rmsnorm matches the cpu reference", "[cuda][bf16]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);

  std::mt19937 rng(207);
  for (const auto& [B, T] : bf16_batch_shapes) {
    for (const int C : bf16_channel_sizes) {
      for (const std::size_t offset : {0, 1}) {
        const std::int64_t N = std::int64_t(B) * T;
        CAPTURE(N, C, offset);
        const std::size_t n = std::size_t(N) * std::size_t(C);
        const Vec inp = uniform_bf16(rng, n, -2.0f, 3.0f), weight = uniform_bf16(rng, C, 0.5f, 1.5f),
                  out = uniform_bf16(rng, n), dout = uniform_bf16(rng, n), dinp = uniform_bf16(rng, n);
        const Vec rstd = uniform_vec(rng, N), dweight = uniform_vec(rng, C);  // fp32

        Vec out_ref = out, rstd_ref = rstd, dinp_ref = dinp, dweight_ref = dweight;
        cpu::rmsnorm_forward(out_ref.data(), rstd_ref.data(), inp.data(), weight.data(), N, C, 1e-5f);
        cpu::rmsnorm_backward(dinp_ref.data(), dweight_ref.data(), dout.data(), inp.data(), weight.data(),
                              rstd_ref.data(), N, C);

        const DeviceArray<Bf16> d_inp = device_bf16(inp, offset), d_weight = device_bf16(weight, offset),
                                d_out = device_bf16(out, offset), d_dout = device_bf16(dout, offset),
                                d_dinp = device_bf16(dinp, offset);
        const DeviceArray<float> d_rstd(rstd, offset), d_dweight(dweight, offset);
        cuda::rmsnorm_forward(bf(d_out), d_rstd.data(), bf(d_inp), bf(d_weight), N, C, 1e-5f, stream());
        cuda::rmsnorm_backward(bf(d_dinp), d_dweight.data(), bf(d_dout), bf(d_inp), bf(d_weight),
                               d_rstd.data(), N, C, stream());

        require_close("out", host(d_out), out_ref, bf16_tolerance);
        require_close("rstd", d_rstd.to_host(), rstd_ref, bf16_fp32_tolerance);
        require_close("dinp", host(d_dinp), dinp_ref, bf16_tolerance);
        require_close("dweight", d_dweight.to_host(), dweight_ref, bf16_fp32_tolerance);
        // C = 1: dinp = rstd w dy (1 - x^2 rstd^2) = rstd w dy eps / (x^2 + eps), mostly far
        // below a bf16 ulp of the old value.
        if (C > 1) require_changed_bf16("dinp", host(d_dinp), dinp);
        require_changed("dweight", d_dweight.to_host(), dweight);
        for (const auto* a : {&d_out, &d_dinp}) require_guards("bf16 output", *a);
        for (const auto* a : {&d_rstd, &d_dweight}) require_guards("fp32 output", *a);
      }
    }
  }
}

TEST_CASE("cuda bf16 rope matches the cpu reference", "[cuda][bf16]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);

  std::mt19937 rng(208);
  for (const auto& [B, T] : bf16_batch_shapes) {
    for (const int HS : {2, 6, 16, 64, 128}) {  // HS/2 a multiple of 8 (16, 64, 128): the 128-bit path
      for (const int H : {1, 3}) {
        for (const int n_rot : {H, H - 1}) {
          for (const int pos0 : {0, 4000}) {
            for (const std::size_t offset : {0, 1}) {
              CAPTURE(B, T, H, HS, n_rot, pos0, offset);
              const float theta = pos0 ? 500000.0f : 10000.0f;
              const std::size_t n = std::size_t(B) * T * H * HS;
              const Vec inp = uniform_bf16(rng, n), out = uniform_bf16(rng, n), dout = uniform_bf16(rng, n),
                        dinp = uniform_bf16(rng, n);
              Vec out_ref = out, dinp_ref = dinp;
              cpu::rope_forward(out_ref.data(), inp.data(), B, T, H, HS, n_rot, pos0, theta);
              cpu::rope_backward(dinp_ref.data(), dout.data(), B, T, H, HS, n_rot, pos0, theta);
              const DeviceArray<Bf16> d_inp = device_bf16(inp, offset), d_out = device_bf16(out, offset),
                                      d_dout = device_bf16(dout, offset), d_dinp = device_bf16(dinp, offset);
              cuda::rope_forward(bf(d_out), bf(d_inp), B, T, H, HS, n_rot, pos0, theta, stream());
              cuda::rope_backward(bf(d_dinp), bf(d_dout), B, T, H, HS, n_rot, pos0, theta, stream());
              require_close("out", host(d_out), out_ref, bf16_tolerance);
              require_close("dinp", host(d_dinp), dinp_ref, bf16_tolerance);
              require_changed_bf16("dinp", host(d_dinp), dinp);
              require_guards("out", d_out);
              require_guards("dinp", d_dinp);
            }
          }
        }
      }
    }
  }
}

TEST_CASE("cuda bf16 fused_classifier matches the cpu reference", "[cuda][bf16]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);

  std::mt19937 rng(209);
  for (const std::int64_t N : {1, 5, 257}) {
    for (const int V : {3, 8, 1001, 50257}) {  // 8: the 128-bit path at offset 0
      for (const float scale : {0.0f, 0.125f}) {
        for (const std::size_t offset : {0, 1}) {
          CAPTURE(N, V, scale, offset);
          const Vec logits = uniform_bf16(rng, std::size_t(N) * V, -8.0f, 8.0f), losses = uniform_vec(rng, N);
          std::vector<std::int32_t> targets = random_tokens(rng, N, V);

          Vec logits_ref = logits, losses_ref = losses;
          const double sum_ref =
              cpu::fused_classifier(logits_ref.data(), losses_ref.data(), targets.data(), N, V, scale);
          const DeviceArray<Bf16> d_logits = device_bf16(logits, offset);
          const DeviceArray<float> d_losses(losses, offset);
          const DeviceArray<std::int32_t> d_targets(targets, offset);
          const double sum =
              cuda::fused_classifier(bf(d_logits), d_losses.data(), d_targets.data(), N, V, scale, stream());

          // The losses come from the same bf16 logits in fp32 on both sides.
          require_close("losses", d_losses.to_host(), losses_ref, bf16_fp32_tolerance);
          CHECK(std::abs(sum - sum_ref) <= bf16_fp32_tolerance * std::abs(sum_ref));
          if (scale > 0.0f) {
            require_close("dlogits", host(d_logits), logits_ref, bf16_tolerance);
          } else {
            CHECK(host(d_logits) == logits);  // left alone
          }
          require_guards("logits", d_logits);
          require_guards("losses", d_losses);
        }
      }
    }
  }

  // A NaN logit makes its row's loss NaN (the trainer's NaN guard), as in fp32.
  const std::int64_t N = 3;
  const int V = 1001;
  Vec logits = uniform_bf16(rng, std::size_t(N) * V);
  logits[std::size_t(V) + 17] = std::numeric_limits<float>::quiet_NaN();  // row 1
  std::vector<std::int32_t> targets = {1, 2, 3};
  const DeviceArray<Bf16> d_logits = device_bf16(logits, 0);
  const DeviceArray<float> d_losses(Vec(N, 0.0f));
  const DeviceArray<std::int32_t> d_targets(targets);
  const double sum =
      cuda::fused_classifier(bf(d_logits), d_losses.data(), d_targets.data(), N, V, 1.0f, stream());
  const Vec result = d_losses.to_host();
  CHECK(std::isfinite(result[0]));
  CHECK(std::isnan(result[1]));
  CHECK(std::isfinite(result[2]));
  CHECK(std::isnan(sum));
}
