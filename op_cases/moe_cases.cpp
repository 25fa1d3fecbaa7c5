// The Mixture-of-Experts ops' cases (src/ops/moe_ops.h): the router, the dispatch plan with the
// permutation and combination, the grouped GEMM, the expert bias's step. Integer outputs (the
// chosen experts, the plan) are compared exactly (tests/op_check.cpp); the CUDA kernels
// (kernels/cuda/moe.cu, grouped_matmul.cu) against the CPU in tests/cuda_ops_test.cpp.
#include <cmath>
#include <string>
#include <vector>

#include "op_cases.h"
#include "ops/moe_ops.h"

namespace llmtrain::op_cases {
namespace {

Arg indices_out(std::string name, Shape shape) {  // an i32 output, compared exactly
  Arg a = output(std::move(name), std::move(shape), act_elementwise);
  a.kind = Kind::i32;
  a.lo = -1.0f;
  a.hi = 1000.0f;
  return a;
}

// The fraction of slots dropped, overwritten: compared as the change from its random initial value,
// as it is 0 in every dropless case (a reference of zeros says nothing).
Arg dropped_out() {
  Arg a = always_f32(output("dropped", {1}, f32_elementwise));
  a.compare = Compare::change;
  return a;
}

}  // namespace

OpCase moe_router_case(std::int64_t N, std::int64_t E, std::int64_t k, bool sigmoid, bool bias) {
  OpCase c{"moe_router", shape_name({{"N", N}, {"E", E}, {"k", k}, {"sigmoid", sigmoid}, {"bias", bias}})};
  c.args = {input("logits", {N, E}, -2.0f, 2.0f),
            present_if(bias, input("bias", {E}, -0.3f, 0.3f)),
            always_f32(output("probs", {N, E}, f32_elementwise)),
            indices_out("experts", {N, k}),
            always_f32(output("weights", {N, k}, f32_elementwise)),
            always_f32(output("counts", {E}, f32_elementwise)),
            always_f32(output("pbar", {E}, f32_reduction)),
            always_f32(output("losses", {3}, f32_reduction)),
            always_f32(input("dweights", {N, k})),
            output("dlogits", {N, E}, act_reduction)};
  const ops::RouterKind kind{sigmoid, true, sigmoid ? 2.5f : 1.0f};
  c.steps = {{"moe_router_forward",
              [kind](const Args& a) {
                ops::moe_router_forward(a["probs"], a["experts"], a["weights"], a["counts"], a["pbar"], a["losses"],
                                        a["logits"], a["bias"], kind);
                return 0.0;
              }},
             {"moe_router_backward", [kind](const Args& a) {
                ops::moe_router_backward(a["dlogits"], a["dweights"], a["logits"], a["probs"], a["experts"], a["counts"],
                                         kind, 0.3f, 0.1f);
                return 0.0;
              }}};
  c.use = Use::check_only;
  return c;
}

OpCase moe_dispatch_case(std::int64_t N, std::int64_t E, std::int64_t k, std::int64_t C, std::int64_t capacity) {
  OpCase c{"moe_dispatch", shape_name({{"N", N}, {"E", E}, {"k", k}, {"C", C}, {"capacity", capacity}})};
  const std::int64_t S = N * k;
  c.args = {tokens("experts", {N, k}, int(E)),
            indices_out("offsets", {E + 1}),
            indices_out("row_slot", {S}),
            indices_out("slot_row", {S}),
            dropped_out(),
            input("x", {N, C}),
            output("xp", {S, C}, act_elementwise),
            always_f32(input("weights", {N, k}, 0.0f, 1.0f)),
            input("y", {S, C}),
            output("out", {N, C}, act_reduction),
            input("dout", {N, C}),
            output("dy", {S, C}, act_elementwise),
            always_f32(output("dweights", {N, k}, f32_reduction)),
            input("dxp", {S, C}),
            output("dx", {N, C}, act_reduction)};
  c.steps = {{"moe_dispatch",
              [capacity](const Args& a) {
                ops::moe_dispatch(a["offsets"], a["row_slot"], a["slot_row"], a["dropped"], a["experts"], capacity);
                return 0.0;
              }},
             {"moe_permute_forward",
              [](const Args& a) {
                ops::moe_permute_forward(a["xp"], a["x"], a["row_slot"], a["offsets"]);
                return 0.0;
              }},
             {"moe_unpermute_forward",
              [](const Args& a) {
                ops::moe_unpermute_forward(a["out"], a["y"], a["weights"], a["slot_row"]);
                return 0.0;
              }},
             {"moe_unpermute_backward",
              [](const Args& a) {
                ops::moe_unpermute_backward(a["dy"], a["dweights"], a["dout"], a["y"], a["weights"], a["row_slot"],
                                            a["slot_row"], a["offsets"]);
                return 0.0;
              }},
             {"moe_permute_backward", [](const Args& a) {
                ops::moe_permute_backward(a["dx"], a["dxp"], a["slot_row"], ops::Accumulate::no);
                return 0.0;
              }}};
  c.use = Use::check_only;
  return c;
}

OpCase grouped_matmul_case(std::int64_t R, std::int64_t E, std::int64_t C, std::int64_t OC) {
  OpCase c{"grouped_matmul", shape_name({{"R", R}, {"E", E}, {"C", C}, {"OC", OC}})};
  c.args = {tokens("experts", {R, 1}, int(E)),  // each row's expert, through the dispatch plan's offsets
            indices_out("offsets", {E + 1}),
            indices_out("row_slot", {R}),
            indices_out("slot_row", {R}),
            dropped_out(),
            input("inp", {R, C}),
            input("weight", {E, OC, C}),
            output("out", {R, OC}, act_reduction),
            input("dout", {R, OC}),
            accumulated("dinp", {R, C}, act_reduction),
            always_f32(accumulated("dweight", {E, OC, C}, f32_reduction))};
  c.steps = {{"moe_dispatch",
              [](const Args& a) {
                ops::moe_dispatch(a["offsets"], a["row_slot"], a["slot_row"], a["dropped"], a["experts"], 0);
                return 0.0;
              },
              0.0, 0.0, 0.0, false},
             {"grouped_matmul_forward",
              [](const Args& a) {
                ops::grouped_matmul_forward(a["out"], a["inp"], a["weight"], a["offsets"]);
                return 0.0;
              }},
             {"grouped_matmul_backward", [](const Args& a) {
                ops::grouped_matmul_backward(a["dinp"], a["dweight"], a["dout"], a["inp"], a["weight"], a["offsets"]);
                return 0.0;
              }}};
  c.use = Use::check_only;
  return c;
}

OpCase moe_bias_update_case(std::int64_t E) {
  OpCase c{"moe_bias_update", shape_name({{"E", E}})};
  c.args = {always_f32(accumulated("bias", {E}, f32_elementwise)), always_f32(input("loads", {E}, 0.0f, 100.0f))};
  c.steps = {{"moe_bias_update", [](const Args& a) {
                ops::moe_bias_update(a["bias"], a["loads"], 50.0f, 0.01f);
                return 0.0;
              }}};
  c.dtypes = {DType::f32};
  c.use = Use::check_only;
  return c;
}

namespace {

std::vector<OpCase> moe_cases() {
  std::vector<OpCase> cases;
  for (const std::int64_t N : {1, 7, 64, 257}) {
    for (const auto& [E, k] : std::vector<std::pair<std::int64_t, std::int64_t>>{{4, 1}, {4, 2}, {9, 3}, {64, 8}}) {
      for (const bool sigmoid : {false, true}) cases.push_back(moe_router_case(N, E, k, sigmoid, sigmoid));
      for (const std::int64_t capacity : {std::int64_t(0), (N * k + E - 1) / E}) {
        cases.push_back(moe_dispatch_case(N, E, k, 33, capacity));
      }
    }
  }
  for (const auto& [R, E] : std::vector<std::pair<std::int64_t, std::int64_t>>{{1, 1}, {7, 4}, {64, 8}, {300, 16}}) {
    cases.push_back(grouped_matmul_case(R, E, 48, 17));
  }
  for (const std::int64_t E : {1, 8, 256}) cases.push_back(moe_bias_update_case(E));
  return cases;
}

[[maybe_unused]] const bool moe_cases_registered = register_check_grid(moe_cases);

}  // namespace
}  // namespace llmtrain::op_cases
