// The op case registry's optimizer ops (op_cases.h): the gradient norm's sum of squares, AdamW,
// Muon's momentum and update, Newton-Schulz's normalisation, batched products, transpose and
// scaled sum; their builders and check grids.
#include "op_cases.h"

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

#include "ops/muon_ops.h"
#include "ops/ops.h"

namespace llmtrain::op_cases {

OpCase sum_squares_case(std::int64_t N, float lo, float hi) {
  OpCase c{"sum_squares", shape_name({{"N", N}})};
  c.args = {always_f32(input("x", {N}, lo, hi))};
  Step step{"sum_squares", [](const Args& a) { return ops::sum_squares(a["x"]); }};
  step.fixed_bytes = 4.0 * double(N);
  c.steps = {step};
  c.dtypes = {DType::f32};
  c.result_tol = Tol{1e-10, 0.0};  // summed in double on both sides; float would be ~1e-7
  c.runs = 2;
  return c;
}

OpCase adamw_case(std::int64_t N, const ops::AdamWParams& p) {
  OpCase c{"adamw_update", shape_name({{"N", N}, {"step", p.step}})};
  Arg param = always_f32(accumulated("param", {N}, f32_elementwise));
  param.compare = Compare::change;  // the update itself, not the parameters it is added to
  c.args = {param, always_f32(input("grad", {N}, -2.0f, 2.0f)),
            range(-0.1f, 0.1f, always_f32(accumulated("m", {N}, f32_elementwise, Changes::no))),
            range(0.0f, 0.01f, always_f32(accumulated("v", {N}, f32_elementwise, Changes::no)))};
  Step step{"adamw_update", [p](const Args& a) {
              ops::adamw_update(a["param"], a["grad"], a["m"], a["v"], p);
              return 0.0;
            }};
  step.fixed_bytes = 7.0 * 4 * double(N);  // param, m, v read and written, grad read
  c.steps = {step};
  c.dtypes = {DType::f32};
  return c;
}

OpCase muon_momentum_case(std::int64_t N, float momentum, bool nesterov) {
  OpCase c{"muon_momentum", shape_name({{"N", N}, {"nesterov", nesterov ? 1 : 0}})};
  c.args = {range(-0.5f, 0.5f, always_f32(accumulated("buf", {N}, f32_elementwise))),
            always_f32(input("grad", {N}, -2.0f, 2.0f)), always_f32(output("u", {N}, f32_elementwise))};
  Step step{"muon_momentum", [momentum, nesterov](const Args& a) {
              ops::muon_momentum(a["buf"], a["grad"], a["u"], momentum, nesterov, 0.5f);
              return 0.0;
            }};
  step.fixed_bytes = 4.0 * 4 * double(N);  // buf read and written, grad read, u written
  c.steps = {step};
  c.dtypes = {DType::f32};
  return c;
}

OpCase muon_apply_case(std::int64_t N, bool working) {
  OpCase c{"muon_apply", shape_name({{"N", N}})};
  Arg param = always_f32(accumulated("param", {N}, f32_elementwise));
  param.compare = Compare::change;  // the update itself, not the parameters it is added to
  c.args = {param, always_f32(input("o", {N}, -1.0f, 1.0f)),
            present_if(working, output("working", {N}, act_elementwise))};
  Step step{"muon_apply", [](const Args& a) {
              ops::muon_apply(a["param"], a["o"], a["working"], 0.99f, 0.05f);
              return 0.0;
            }};
  step.fixed_bytes = (3.0 * 4 + (working ? 2.0 : 0.0)) * double(N);  // param read and written, o read
  c.steps = {step};
  c.dtypes = {working ? DType::bf16 : DType::f32};
  return c;
}

// Newton-Schulz's steps besides its matmuls (optim/newton_schulz.h): a (rows, cols) matrix over
// its norm, worked on as (m, n) with m <= n.
OpCase newton_schulz_normalise_case(std::int64_t rows, std::int64_t cols) {
  OpCase c{"newton_schulz_normalise", shape_name({{"rows", rows}, {"cols", cols}})};
  c.args = {always_f32(input("u", {rows, cols}, -2.0f, 2.0f)),
            output("x", {std::min(rows, cols), std::max(rows, cols)}, act_elementwise)};
  Step step{"newton_schulz_normalise", [](const Args& a) {
              const Tensor& u = a["u"];
              ops::DeviceSum squares(u.device);
              ops::sum_squares(u.reshape({u.numel()}), &squares);
              ops::newton_schulz_normalise(a["x"], u, squares, 1e-7);
              return 0.0;
            }};
  step.fixed_bytes = 8.0 * double(rows * cols);  // u read twice (the norm, then the scaling)
  step.act_elements = double(rows * cols);        // x written
  c.steps = {step};
  return c;
}

// Newton-Schulz's products over a stack of B matrices of one shape: out (B,M,N) = inp (B,M,K)
// weight^T, weight (B,N,K) (X X^T, A A), or inp weight, weight (B,K,N) (the polynomial times X).
OpCase batched_matmul_case(std::int64_t B, std::int64_t M, std::int64_t N, std::int64_t K,
                           bool transpose_weight) {
  OpCase c{"batched_matmul",
           shape_name({{"B", B}, {"M", M}, {"N", N}, {"K", K}, {"transpose_weight", transpose_weight}})};
  c.args = {input("inp", {B, M, K}), input("weight", transpose_weight ? Shape{B, N, K} : Shape{B, K, N}),
            output("out", {B, M, N}, act_reduction)};
  Step step{"batched_matmul", [transpose_weight](const Args& a) {
              ops::batched_matmul(a["out"], a["inp"], a["weight"], transpose_weight);
              return 0.0;
            }};
  step.flops = 2.0 * double(B) * double(M) * double(N) * double(K);
  c.steps = {step};
  return c;
}

OpCase transpose_case(std::int64_t N, std::int64_t C) {
  OpCase c{"transpose", shape_name({{"N", N}, {"C", C}})};
  c.args = {input("inp", {N, C}), output("out", {C, N}, act_elementwise)};
  Step step{"transpose", [](const Args& a) {
              ops::transpose(a["out"], a["inp"]);
              return 0.0;
            }};
  step.act_elements = 2.0 * double(N * C);
  c.steps = {step};
  return c;
}

OpCase scaled_sum_case(std::int64_t N) {
  OpCase c{"scaled_sum", shape_name({{"N", N}})};
  c.args = {input("x", {N}), input("y", {N}), output("out", {N}, act_elementwise)};
  Step step{"scaled_sum", [](const Args& a) {
              ops::scaled_sum(a["out"], a["x"], a["y"], 3.4445f, -4.775f);
              return 0.0;
            }};
  step.act_elements = 3.0 * double(N);
  c.steps = {step};
  return c;
}

namespace {

std::vector<OpCase> sum_squares_cases() {
  std::vector<OpCase> cases;
  for (const std::int64_t N : {std::int64_t(1), std::int64_t(3), std::int64_t(5), std::int64_t(1000),
                               std::int64_t(4099), std::int64_t(1) << 20, std::int64_t(3000017)}) {
    add(cases, sum_squares_case(N, -3.0f, 3.0f), {0, 1, 2, 3});  // every misalignment of the 128-bit body
  }
  return cases;
}

std::vector<OpCase> adamw_cases() {
  std::vector<OpCase> cases;
  for (const std::int64_t N : element_counts) {
    for (const int step : {1, 10}) {
      // A large learning rate, so that the change of the parameters is far above their rounding.
      add(cases, adamw_case(N, ops::AdamWParams{0.05f, 0.9f, 0.95f, 1e-8f, 0.1f, step, 0.5f}));
    }
  }
  return cases;
}

std::vector<OpCase> muon_cases() {
  std::vector<OpCase> cases;
  for (const std::int64_t N : element_counts) {
    for (const bool nesterov : {true, false}) add(cases, muon_momentum_case(N, 0.95f, nesterov));
    for (const bool working : {false, true}) add(cases, muon_apply_case(N, working));
  }
  // Newton-Schulz: square, wide, tall, odd, one row or column, and a tile edge (32) crossed.
  for (const auto& [rows, cols] : std::vector<std::pair<std::int64_t, std::int64_t>>{
           {1, 1}, {5, 7}, {7, 5}, {16, 16}, {1, 33}, {33, 1}, {31, 70}, {70, 31}, {64, 96}, {96, 64}}) {
    add(cases, newton_schulz_normalise_case(rows, cols));
    add(cases, transpose_case(rows, cols));
  }
  for (const std::int64_t N : element_counts) add(cases, scaled_sum_case(N));
  // Batched products: one matrix, Newton-Schulz's three products of a wide and an odd stack (A is
  // (m, m), X (m, n)), and a batch whose matrices start off cuBLASLt's 16-byte alignment (5 x 3).
  for (const auto& [B, m, n] : std::vector<std::tuple<std::int64_t, std::int64_t, std::int64_t>>{
           {1, 1, 1}, {1, 16, 48}, {3, 5, 7}, {4, 16, 16}, {2, 33, 70}, {5, 1, 3}}) {
    add(cases, batched_matmul_case(B, m, m, n, true));              // A = X X^T
    if (n != m) add(cases, batched_matmul_case(B, m, m, m, true));  // A A^T (a square X's is X X^T's)
    add(cases, batched_matmul_case(B, m, n, m, false));             // poly X
  }
  return cases;
}

[[maybe_unused]] const bool sum_squares_cases_registered = register_check_grid(sum_squares_cases);
[[maybe_unused]] const bool adamw_cases_registered = register_check_grid(adamw_cases);
[[maybe_unused]] const bool muon_cases_registered = register_check_grid(muon_cases);

}  // namespace
}  // namespace llmtrain::op_cases
