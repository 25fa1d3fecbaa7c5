// The op case registry's elementwise ops, rotary embeddings and decoding attention (op_cases.h):
// residual, GELU, SwiGLU, RoPE and attention_decode; their builders and check grids.
#include "op_cases.h"

#include <cstdint>
#include <utility>
#include <vector>

#include "ops/ops.h"

namespace llmtrain::op_cases {

OpCase residual_case(std::string label, const Shape& shape) {
  OpCase c{"residual", std::move(label)};
  c.args = {input("a", shape, -5.0f, 5.0f), input("b", shape, -3.0f, 3.0f), input("dout", shape),
            output("out", shape, act_elementwise), accumulated("da", shape, act_elementwise),
            accumulated("db", shape, act_elementwise)};
  const double n = double(numel(shape));
  Step forward{"residual_forward", [](const Args& a) {
                 ops::residual_forward(a["out"], a["a"], a["b"]);
                 return 0.0;
               }};
  forward.act_elements = 3 * n;
  Step backward{"residual_backward", [](const Args& a) {
                  ops::residual_backward(a["da"], a["db"], a["dout"]);
                  return 0.0;
                }};
  backward.act_elements = 5 * n;  // dout read, da and db read and written
  c.steps = {forward, backward};
  return c;
}

OpCase gelu_case(std::string label, const Shape& shape) {
  OpCase c{"gelu", std::move(label)};
  c.args = {input("inp", shape, -5.0f, 5.0f), input("dout", shape), output("out", shape, act_elementwise),
            accumulated("dinp", shape, act_elementwise)};
  const double n = double(numel(shape));
  Step forward{"gelu_forward", [](const Args& a) {
                 ops::gelu_forward(a["out"], a["inp"]);
                 return 0.0;
               }};
  forward.act_elements = 2 * n;
  Step backward{"gelu_backward", [](const Args& a) {
                  ops::gelu_backward(a["dinp"], a["inp"], a["dout"]);
                  return 0.0;
                }};
  backward.act_elements = 4 * n;  // inp and dout read, dinp read and written
  c.steps = {forward, backward};
  return c;
}

namespace {

std::vector<OpCase> elementwise_cases() {
  std::vector<OpCase> cases;
  for (const std::int64_t N : element_counts) {
    add(cases, gelu_case(shape_name({{"N", N}}), {N}));
    add(cases, residual_case(shape_name({{"N", N}}), {N}));

    OpCase swiglu{"swiglu", shape_name({{"N", N}})};
    swiglu.args = {input("gate", {N}, -5.0f, 5.0f), input("up", {N}, -3.0f, 3.0f), input("dout", {N}),
                   output("out", {N}, act_elementwise), accumulated("dgate", {N}, act_elementwise),
                   accumulated("dup", {N}, act_elementwise)};
    swiglu.steps = {{"swiglu_forward",
                     [](const Args& a) {
                       ops::swiglu_forward(a["out"], a["gate"], a["up"]);
                       return 0.0;
                     }},
                    {"swiglu_backward", [](const Args& a) {
                       ops::swiglu_backward(a["dgate"], a["dup"], a["dout"], a["gate"], a["up"]);
                       return 0.0;
                     }}};
    swiglu.use = Use::check_only;
    add(cases, swiglu);
  }
  return cases;
}

std::vector<OpCase> rope_cases() {
  std::vector<OpCase> cases;
  for (const auto& [B, T] : std::vector<std::pair<int, int>>{{1, 1}, {1, 5}, {2, 17}, {2, 64}, {1, 257}}) {
    // HS/2 a multiple of 4 (8, 16, 64, 128): the f32 128-bit path; of 8 (16, 64, 128): the bf16 one.
    for (const int HS : {2, 6, 8, 16, 64, 128}) {
      for (const int H : {1, 3, 12}) {
        for (const int n_rot : {H, H - 1}) {  // H - 1: the last head passes through (qkv's value heads)
          for (const int pos0 : {0, 4000}) {
            const float theta = pos0 ? 500000.0f : 10000.0f;
            OpCase c{"rope", shape_name({{"B", B}, {"T", T}, {"H", H}, {"HS", HS}, {"rotated", n_rot},
                                         {"pos0", pos0}})};
            c.args = {input("inp", {B, T, H, HS}), input("dout", {B, T, H, HS}),
                      output("out", {B, T, H, HS}, act_elementwise),
                      accumulated("dinp", {B, T, H, HS}, act_elementwise)};
            c.steps = {{"rope_forward",
                        [theta, n_rot, pos0](const Args& a) {
                          ops::rope_forward(a["out"], a["inp"], theta, n_rot, pos0);
                          return 0.0;
                        }},
                       {"rope_backward", [theta, n_rot, pos0](const Args& a) {
                          ops::rope_backward(a["dinp"], a["dout"], theta, n_rot, pos0);
                          return 0.0;
                        }}};
            c.use = Use::check_only;
            add(cases, c);
          }
        }
      }
    }
  }
  return cases;
}

std::vector<OpCase> attention_decode_cases() {
  struct Heads {
    int NH, NKV, HS;
  };
  std::vector<OpCase> cases;
  const int maxT = 130;
  for (const Heads& h : {Heads{1, 1, 1}, Heads{1, 1, 64}, Heads{4, 4, 16}, Heads{12, 12, 64}, Heads{8, 2, 80},
                         Heads{6, 1, 33}, Heads{2, 1, 1024}}) {
    for (const int pos : {0, 1, 7, 100, maxT - 1}) {
      const int C = h.NH * h.HS, KVC = h.NKV * h.HS, NH = h.NH, NKV = h.NKV;
      OpCase c{"attention_decode", shape_name({{"NH", NH}, {"NKV", NKV}, {"HS", h.HS}, {"pos", pos}})};
      c.args = {input("q", {C}, -2.0f, 2.0f), input("k_cache", {maxT, KVC}, -2.0f, 2.0f),
                input("v_cache", {maxT, KVC}), output("out", {C}, act_reduction)};
      c.steps = {{"attention_decode", [pos, NH, NKV](const Args& a) {
                    ops::attention_decode(a["out"], a["q"], a["k_cache"], a["v_cache"], pos, NH, NKV);
                    return 0.0;
                  }}};
      c.use = Use::check_only;
      add(cases, c);
    }
  }
  return cases;
}

[[maybe_unused]] const bool elementwise_cases_registered = register_check_grid(elementwise_cases);
[[maybe_unused]] const bool rope_cases_registered = register_check_grid(rope_cases);
[[maybe_unused]] const bool attention_decode_cases_registered = register_check_grid(attention_decode_cases);

}  // namespace
}  // namespace llmtrain::op_cases
