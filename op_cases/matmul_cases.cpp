// The op case registry's matrix products and the loss (op_cases.h): matmul (with its bias),
// GPT-2's MLP fused with its GELU, the fused classifier and the vocabulary-parallel
// cross-entropy's steps; their builders and check grids.
#include "op_cases.h"

#include <cstdint>
#include <string>
#include <vector>

#include "ops/ops.h"

namespace llmtrain::op_cases {

OpCase matmul_case(std::int64_t N, std::int64_t C, std::int64_t OC, bool with_bias, bool overwrite,
                   std::int64_t ld) {
  OpCase c{"matmul",
           shape_name({{"N", N}, {"C", C}, {"OC", OC}, {"bias", with_bias}}) + (overwrite ? " overwrite" : "")};
  c.args = {input("inp", {N, C}),
            input("weight", {OC, C}),
            present_if(with_bias, input("bias", {OC})),  // offset 1: an odd bias address
            output("out", {N, ld}, act_reduction),
            input("dout", {N, ld}),
            overwrite ? output("dinp", {N, C}, act_reduction) : accumulated("dinp", {N, C}, act_reduction),
            always_f32(accumulated("dweight", {OC, C}, f32_reduction)),
            present_if(with_bias, always_f32(accumulated("dbias", {OC}, f32_reduction)))};
  const double flops = 2.0 * double(N) * double(C) * double(OC);
  Step forward{"matmul_forward", [](const Args& a) {
                 ops::matmul_forward(a["out"], a["inp"], a["weight"], a["bias"]);
                 return 0.0;
               }};
  forward.flops = flops;
  Step backward{"matmul_backward", [overwrite](const Args& a) {
                  ops::matmul_backward(a["dinp"], a["dweight"], a["dbias"], a["dout"], a["inp"], a["weight"],
                                       overwrite ? ops::Accumulate::no : ops::Accumulate::yes);
                  return 0.0;
                }};
  backward.flops = 2 * flops;  // dinp and dweight
  c.steps = {forward, backward};
  return c;
}

OpCase matmul_gelu_case(std::int64_t N, std::int64_t C, std::int64_t F, std::int64_t OC, bool with_bias) {
  OpCase c{"matmul_gelu", shape_name({{"N", N}, {"C", C}, {"F", F}, {"OC", OC}, {"bias", with_bias}})};
  c.args = {input("inp", {N, C}),
            input("fc_w", {F, C}),
            present_if(with_bias, input("fc_b", {F})),
            output("pre", {N, F}, act_reduction),
            output("out", {N, F}, act_reduction),
            input("proj_w", {OC, F}),
            input("dout", {N, OC}),
            output("dpre", {N, F}, act_reduction),
            // From the rounded GELU output and (bf16) the rounded dpre.
            always_f32(accumulated("dproj_w", {OC, F}, f32_reduction_of_bf16)),
            present_if(with_bias, always_f32(accumulated("dproj_b", {OC}, f32_reduction))),
            present_if(with_bias, always_f32(accumulated("dfc_b", {F}, f32_reduction_of_bf16)))};
  Step forward{"matmul_gelu_forward (GELU_AUX_BIAS)", [](const Args& a) {
                 ops::matmul_gelu_forward(a["out"], a["pre"], a["inp"], a["fc_w"], a["fc_b"]);
                 return 0.0;
               }};
  forward.flops = 2.0 * double(N) * double(C) * double(F);
  Step backward{"matmul_backward_dgelu (DGELU)", [](const Args& a) {
                  ops::matmul_backward_dgelu(a["dpre"], a["dproj_w"], a["dproj_b"], a["dfc_b"], a["dout"], a["out"],
                                             a["pre"], a["proj_w"]);
                  return 0.0;
                }};
  backward.flops = 4.0 * double(N) * double(F) * double(OC);  // dpre and dproj_w
  c.steps = {forward, backward};
  return c;
}

OpCase fused_classifier_case(std::int64_t N, std::int64_t V, float scale, std::int64_t ld) {
  OpCase c{"fused_classifier", shape_name({{"N", N}, {"V", V}, {"dlogits", scale > 0.0f}})};
  // Without a scale the logits are left alone (bit for bit); with one they become dlogits.
  // A loss is log-sum-exp - logit, terms of the logits' size: a nearly certain row's loss
  // (1e-6 at N=1, V=3) carries their rounding, so losses are compared at a scale of 1 at least.
  Arg losses = always_f32(output("losses", {N}, f32_elementwise));
  losses.scale_floor = 1.0;
  c.args = {scale > 0.0f ? range(-8.0f, 8.0f, output("logits", {N, ld}, act_elementwise))
                         : input("logits", {N, ld}, -8.0f, 8.0f),
            losses, tokens("targets", {N}, int(V))};
  const std::int64_t columns = ld == V ? -1 : V;  // -1: every column of the rows
  Step step{"fused_classifier", [scale, columns](const Args& a) {
              return ops::fused_classifier(a["logits"], a["losses"], a["targets"], scale, nullptr, columns);
            }};
  step.act_elements = 2 * double(N) * double(V);  // reads the logits, writes their gradient in place
  c.steps = {step};
  c.result_tol = f32_elementwise;  // the loss sum: fp32 losses from the same logits
  c.result_scale_floor = 1.0;      // as the losses
  return c;
}

namespace {

std::vector<OpCase> matmul_cases() {
  std::vector<OpCase> cases;
  for (const auto& [B, T] : batch_shapes) {
    for (const int C : channel_sizes) {
      for (const int OC : {1, 3, 64, 127, 768}) {
        for (const bool with_bias : {true, false}) {
          // overwrite: backward is dinp's first writer (Accumulate::no): its old values must go.
          for (const bool overwrite : {false, true}) {
            const std::int64_t N = std::int64_t(B) * T;
            if (overwrite && (with_bias || N > 64)) continue;
            add(cases, matmul_case(N, C, OC, with_bias, overwrite, OC));
          }
        }
      }
    }
  }
  return cases;
}

// GPT-2's MLP: c_fc with its GELU (GELU_AUX_BIAS on the GPU), then c_proj's backward through
// the GELU (DGELU, DGELU_BGRAD in fp32). F % 8 != 0 takes the unfused path; dpre is written,
// so its random initial values must not survive.
std::vector<OpCase> matmul_gelu_cases() {
  std::vector<OpCase> cases;
  struct Dims {
    std::int64_t N;
    int C, F, OC;
  };
  for (const Dims& d : {Dims{1, 3, 8, 5}, Dims{5, 64, 64, 64}, Dims{34, 127, 127, 3}, Dims{34, 64, 768, 127},
                        Dims{257, 64, 256, 768}, Dims{17, 1, 3, 1}}) {
    for (const bool with_bias : {true, false}) add(cases, matmul_gelu_case(d.N, d.C, d.F, d.OC, with_bias));
  }
  return cases;
}

std::vector<OpCase> fused_classifier_cases() {
  std::vector<OpCase> cases;
  for (const std::int64_t N : {1, 5, 64, 257}) {
    for (const int V : {3, 8, 1001, 50257}) {  // 8: the bf16 128-bit path at offset 0
      for (const float scale : {0.0f, 0.125f}) add(cases, fused_classifier_case(N, V, scale, V));
    }
  }
  return cases;
}

// The vocabulary-parallel steps, each on its own: a rank's logits (N,V) are columns
// [vocab_begin, vocab_begin + V) of a larger vocabulary. The statistics they read stand for the
// all-reduced ones: row_max at or above every logit (as a global max is), positive sums.
// V = 6283 is GPT-2's vocabulary over 8 ranks (odd: scalar accesses); 8 and 1000 take the 128-bit
// paths at offset 0. Targets fall inside and (at 64 rows) on both sides of the rank's range.
std::vector<OpCase> vocab_parallel_cases() {
  std::vector<OpCase> cases;
  for (const std::int64_t N : {1, 5, 64}) {
    for (const int V : {3, 8, 1000, 6283}) {
      const std::int64_t vocab_begin = 3 * std::int64_t(V) + 1;
      const int outside = N >= 64 ? V / 2 + 1 : 0;  // fewer rows: some target must be this rank's
      Arg targets = tokens("targets", {N}, 0);
      targets.lo = float(vocab_begin - outside);
      targets.hi = float(vocab_begin + V + outside);
      const std::string shape = shape_name({{"N", N}, {"V", V}, {"vocab_begin", vocab_begin}});

      OpCase row_max{"vocab_parallel", "row_max " + shape};
      row_max.args = {input("logits", {N, V}, -8.0f, 8.0f), always_f32(output("row_max", {N}, f32_elementwise))};
      row_max.steps = {{"classifier_row_max", [](const Args& a) {
                          ops::classifier_row_max(a["row_max"], a["logits"]);
                          return 0.0;
                        }}};
      row_max.use = Use::check_only;
      add(cases, row_max);

      OpCase stats{"vocab_parallel", "row_stats " + shape};
      stats.args = {input("logits", {N, V}, -8.0f, 8.0f), always_f32(input("row_max", {N}, 8.0f, 9.0f)), targets,
                    always_f32(output("sum_exp", {N}, f32_reduction)),
                    always_f32(output("target_logit", {N}, f32_elementwise))};
      stats.steps = {{"classifier_row_stats", [vocab_begin](const Args& a) {
                        ops::classifier_row_stats(a["sum_exp"], a["target_logit"], a["logits"], a["row_max"],
                                                  a["targets"], vocab_begin);
                        return 0.0;
                      }}};
      stats.use = Use::check_only;
      add(cases, stats);

      for (const float scale : {0.0f, 0.125f}) {
        OpCase finish{"vocab_parallel", "finish " + shape + " dlogits=" + std::to_string(scale > 0.0f)};
        Arg losses = always_f32(output("losses", {N}, f32_elementwise));
        losses.scale_floor = 1.0;  // as fused_classifier's
        finish.args = {scale > 0.0f ? range(-8.0f, 8.0f, output("logits", {N, V}, act_elementwise))
                                    : input("logits", {N, V}, -8.0f, 8.0f),
                       losses,
                       always_f32(input("row_max", {N}, 8.0f, 9.0f)),
                       always_f32(input("sum_exp", {N}, 1.0f, 50.0f)),
                       always_f32(input("target_logit", {N}, -8.0f, 8.0f)),
                       targets};
        finish.steps = {{"classifier_parallel_finish", [vocab_begin, scale](const Args& a) {
                           return ops::classifier_parallel_finish(a["logits"], a["losses"], a["row_max"],
                                                                  a["sum_exp"], a["target_logit"], a["targets"],
                                                                  vocab_begin, scale);
                         }}};
        finish.result_tol = f32_elementwise;
        finish.result_scale_floor = 1.0;
        finish.use = Use::check_only;
        add(cases, finish);
      }
    }
  }
  return cases;
}

[[maybe_unused]] const bool matmul_cases_registered = register_check_grid(matmul_cases);
[[maybe_unused]] const bool matmul_gelu_cases_registered = register_check_grid(matmul_gelu_cases);
[[maybe_unused]] const bool fused_classifier_cases_registered = register_check_grid(fused_classifier_cases);
[[maybe_unused]] const bool vocab_parallel_cases_registered = register_check_grid(vocab_parallel_cases);

}  // namespace
}  // namespace llmtrain::op_cases
