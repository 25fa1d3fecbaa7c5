// The op case registry's norms and embedding (op_cases.h): the encoder (token and position
// embedding), LayerNorm (and fused with the residual before it), RMSNorm; their builders and check grids.
#include "op_cases.h"

#include <cstdint>
#include <vector>

#include "core/bf16.h"
#include "ops/ops.h"

namespace llmtrain::op_cases {

OpCase encoder_case(std::int64_t B, std::int64_t T, std::int64_t C, std::int64_t V, std::int64_t maxT,
                    bool positions) {
  OpCase c{"encoder", shape_name({{"B", B}, {"T", T}, {"C", C}, {"V", V}, {"positions", positions}})};
  c.args = {tokens("inp", {B, T}, int(V)),
            input("wte", {V, C}),
            present_if(positions, input("wpe", {maxT, C})),
            output("out", {B, T, C}, act_elementwise),
            input("dout", {B, T, C}),
            // Same additions in the same order as the CPU: expected bit-identical in f32.
            always_f32(accumulated("dwte", {V, C}, f32_elementwise)),
            present_if(positions, always_f32(accumulated("dwpe", {maxT, C}, f32_elementwise)))};
  const double nc = double(B) * double(T) * double(C), tc = positions ? double(T) * double(C) : 0.0;
  Step forward{"encoder_forward", [](const Args& a) {
                 ops::encoder_forward(a["out"], a["inp"], a["wte"], a["wpe"]);
                 return 0.0;
               }};
  forward.act_elements = 2 * nc + tc;  // a row of wte and of wpe read, out written, per token
  Step backward{"encoder_backward", [](const Args& a) {
                  ops::encoder_backward(a["dwte"], a["dwpe"], a["dout"], a["inp"]);
                  return 0.0;
                }};
  backward.act_elements = nc;                // dout read
  backward.fixed_bytes = 2 * nc * 4 + 2 * tc * 4;  // the f32 rows of dwte and dwpe read and written
  c.steps = {forward, backward};
  return c;
}

OpCase layernorm_case(std::int64_t N, std::int64_t C) {
  OpCase c{"layernorm", shape_name({{"N", N}, {"C", C}})};
  c.args = {input("inp", {N, C}, -2.0f, 3.0f),
            input("weight", {C}, 0.5f, 1.5f),
            input("bias", {C}),
            output("out", {N, C}, act_elementwise),
            always_f32(output("mean", {N}, f32_elementwise)),
            always_f32(output("rstd", {N}, f32_elementwise)),
            input("dout", {N, C}),
            accumulated("dinp", {N, C}, act_reduction, C > 1 ? Changes::yes : Changes::no),  // C = 1: 0
            always_f32(accumulated("dweight", {C}, f32_reduction, Changes::no)),             // C = 1: 0 too
            always_f32(accumulated("dbias", {C}, f32_reduction))};
  const double nc = double(N) * double(C);
  Step forward{"layernorm_forward", [](const Args& a) {
                 ops::layernorm_forward(a["out"], a["mean"], a["rstd"], a["inp"], a["weight"], a["bias"]);
                 return 0.0;
               }};
  forward.act_elements = 2 * nc;
  // dinp accumulated (read and written), dout and inp read; the weight gradients in the same pass.
  Step backward{"layernorm_backward", [](const Args& a) {
                  ops::layernorm_backward(a["dinp"], a["dweight"], a["dbias"], a["dout"], a["inp"], a["weight"],
                                          a["mean"], a["rstd"]);
                  return 0.0;
                }};
  backward.act_elements = 4 * nc;
  c.steps = {forward, backward};
  return c;
}

OpCase layernorm_residual_case(std::int64_t N, std::int64_t C) {
  OpCase c{"layernorm_residual", shape_name({{"N", N}, {"C", C}})};
  c.args = {input("a", {N, C}, -2.0f, 3.0f),
            input("b", {N, C}),
            input("weight", {C}, 0.5f, 1.5f),
            input("bias", {C}),
            output("residual", {N, C}, act_elementwise),
            output("out", {N, C}, act_elementwise),
            always_f32(output("mean", {N}, f32_elementwise)),
            always_f32(output("rstd", {N}, f32_elementwise))};
  Step forward{"layernorm_residual_forward", [](const Args& a) {
                 ops::layernorm_residual_forward(a["residual"], a["out"], a["mean"], a["rstd"], a["a"], a["b"],
                                                 a["weight"], a["bias"]);
                 return 0.0;
               }};
  forward.act_elements = 4 * double(N) * double(C);  // a and b read, residual and out written
  c.steps = {forward};
  // A bf16 kernel normalises the residual it stored, rounded to bf16 (as the unfused ops would):
  // so does the reference, else a row of nearly equal values (C = 3) differs by far more than a
  // rounding.
  c.reference = [](const Args& a, DType dtype) {
    ops::layernorm_residual_forward(a["residual"], a["out"], a["mean"], a["rstd"], a["a"], a["b"], a["weight"],
                                    a["bias"]);
    if (dtype == DType::bf16) {
      float* residual = a["residual"].as<float>();
      for (std::int64_t i = 0; i < a["residual"].numel(); ++i) {
        residual[i] = bf16_bits_to_float(float_to_bf16_bits(residual[i]));
      }
      ops::layernorm_forward(a["out"], a["mean"], a["rstd"], a["residual"], a["weight"], a["bias"]);
    }
    return 0.0;
  };
  return c;
}

namespace {

std::vector<OpCase> encoder_cases() {
  std::vector<OpCase> cases;
  for (const auto& [B, T] : batch_shapes) {
    for (const int C : channel_sizes) {
      for (const int V : {7, 1001}) {  // 7: long runs of one token in the sorted backward
        for (const bool positions : {true, false}) add(cases, encoder_case(B, T, C, V, T + 3, positions));
      }
    }
  }
  // Many repeats of every token: the sorted backward must sum them in a fixed order.
  const int B = 4, T = 256, C = 768, V = 50;
  OpCase c{"encoder_backward deterministic", shape_name({{"B", B}, {"T", T}, {"C", C}, {"V", V}})};
  c.args = {tokens("inp", {B, T}, V), input("dout", {B, T, C}),
            range(0.0f, 0.0f, always_f32(accumulated("dwte", {V, C}, f32_elementwise)))};
  c.steps = {{"encoder_backward", [](const Args& a) {
                ops::encoder_backward(a["dwte"], Tensor(), a["dout"], a["inp"]);
                return 0.0;
              }}};
  c.runs = 3;
  c.use = Use::check_only;
  cases.push_back(c);
  return cases;
}

std::vector<OpCase> layernorm_cases() {
  std::vector<OpCase> cases;
  // The backward sums the weight gradients in registers up to C = 1024 (256 unaligned): 1100
  // takes the separate column sums.
  std::vector<int> channels = channel_sizes;
  channels.push_back(1100);
  for (const auto& [B, T] : batch_shapes) {
    for (const int C : channels) add(cases, layernorm_case(std::int64_t(B) * T, C));
  }
  return cases;
}

// residual = a + b, then its LayerNorm, in one kernel.
std::vector<OpCase> layernorm_residual_cases() {
  std::vector<OpCase> cases;
  for (const auto& [B, T] : batch_shapes) {
    for (const int C : channel_sizes) add(cases, layernorm_residual_case(std::int64_t(B) * T, C));
  }
  return cases;
}

std::vector<OpCase> rmsnorm_cases() {
  std::vector<OpCase> cases;
  for (const auto& [B, T] : batch_shapes) {
    for (const int C : channel_sizes) {
      const std::int64_t N = std::int64_t(B) * T;
      OpCase c{"rmsnorm", shape_name({{"N", N}, {"C", C}})};
      c.args = {input("inp", {N, C}, -2.0f, 3.0f),
                input("weight", {C}, 0.5f, 1.5f),
                output("out", {N, C}, act_elementwise),
                always_f32(output("rstd", {N}, f32_elementwise)),
                input("dout", {N, C}),
                // C = 1: dinp = rstd w dy (1 - x^2 rstd^2) = rstd w dy eps / (x^2 + eps), in bf16
                // mostly far below an ulp of the old value.
                accumulated("dinp", {N, C}, act_reduction, C > 1 ? Changes::yes : Changes::f32_only),
                always_f32(accumulated("dweight", {C}, f32_reduction))};
      c.steps = {{"rmsnorm_forward",
                  [](const Args& a) {
                    ops::rmsnorm_forward(a["out"], a["rstd"], a["inp"], a["weight"], 1e-5f);
                    return 0.0;
                  }},
                 {"rmsnorm_backward", [](const Args& a) {
                    ops::rmsnorm_backward(a["dinp"], a["dweight"], a["dout"], a["inp"], a["weight"], a["rstd"]);
                    return 0.0;
                  }}};
      c.use = Use::check_only;
      add(cases, c);
    }
  }
  return cases;
}

[[maybe_unused]] const bool encoder_cases_registered = register_check_grid(encoder_cases);
[[maybe_unused]] const bool layernorm_cases_registered = register_check_grid(layernorm_cases);
[[maybe_unused]] const bool layernorm_residual_cases_registered = register_check_grid(layernorm_residual_cases);
[[maybe_unused]] const bool rmsnorm_cases_registered = register_check_grid(rmsnorm_cases);

}  // namespace
}  // namespace llmtrain::op_cases
