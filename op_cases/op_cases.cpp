// The op builders and the check grids of the op case registry (op_cases.h).
#include "op_cases.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <tuple>
#include <vector>

#include "core/bf16.h"
#include "ops/muon_ops.h"
#include "ops/ops.h"

namespace llmtrain::op_cases {

Arg input(std::string name, Shape shape, float lo, float hi) {
  Arg a;
  a.name = std::move(name);
  a.shape = std::move(shape);
  a.lo = lo;
  a.hi = hi;
  return a;
}
Arg tokens(std::string name, Shape shape, int V) {
  Arg a = input(std::move(name), std::move(shape), 0.0f, float(V));
  a.kind = Kind::i32;
  return a;
}
Arg output(std::string name, Shape shape, Tol tol) {
  Arg a = input(std::move(name), std::move(shape));
  a.role = Role::out;
  a.tol = tol;
  return a;
}
Arg accumulated(std::string name, Shape shape, Tol tol, Changes changes) {
  Arg a = output(std::move(name), std::move(shape), tol);
  a.role = Role::acc;
  a.changes = changes;
  return a;
}
Arg always_f32(Arg a) {
  a.kind = Kind::f32;
  return a;
}
Arg present_if(bool present, Arg a) {
  if (!present) a.role = Role::absent;
  return a;
}
Arg range(float lo, float hi, Arg a) {
  a.lo = lo;
  a.hi = hi;
  return a;
}

DType dtype_in_run(const Arg& a, DType act) {
  return a.kind == Kind::act ? act : a.kind == Kind::f32 ? DType::f32 : DType::i32;
}

std::size_t numel(const Shape& shape) {
  std::size_t n = 1;
  for (const std::int64_t d : shape) n *= std::size_t(d);
  return n;
}

Tensor view(void* data, DType dtype, Device device, const Shape& shape) {
  if (shape.empty() || shape.size() > std::size_t(Tensor::max_dims)) {
    throw std::logic_error("op case tensor of " + std::to_string(shape.size()) + " dimensions");
  }
  Tensor t(data, dtype, device, {1});
  t.ndim = int(shape.size());
  for (std::size_t i = 0; i < shape.size(); ++i) t.shape[i] = shape[i];
  return t;
}

Arg& OpCase::arg(std::string_view name) {
  for (Arg& a : args) {
    if (a.name == name) return a;
  }
  throw std::logic_error("op case " + op + " has no tensor named " + std::string(name));
}

std::string shape_name(std::initializer_list<std::pair<const char*, std::int64_t>> dims) {
  std::string s;
  for (const auto& [name, value] : dims) {
    if (!s.empty()) s += ' ';
    s.append(name).append("=").append(std::to_string(value));
  }
  return s;
}

// ---- the op builders -------------------------------------------------------------------------

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

}  // namespace llmtrain::op_cases

// ---- the check grids -------------------------------------------------------------------------
// The grids are the union of those the fp32 and bf16 tests used: odd sizes, sizes that take the
// 128-bit paths (64 and 768 channels: 4 f32 or 8 bf16 per access), and the real model's sizes.
// Each case runs at offset 0 and at a misaligned offset of one element.

namespace llmtrain::op_cases {
namespace {

const std::vector<std::pair<int, int>> batch_shapes = {{1, 1}, {1, 5}, {2, 17}, {2, 32}, {1, 257}};  // B, T
const std::vector<int> channel_sizes = {1, 3, 64, 127, 768};
const std::vector<std::int64_t> element_counts = {1, 3, 4, 5, 8, 9, 1000, 4099, 1 << 20};

// Adds `c` once per offset.
void add(std::vector<OpCase>& cases, const OpCase& c, std::initializer_list<std::size_t> offsets = {0, 1}) {
  for (const std::size_t offset : offsets) {
    cases.push_back(c);
    cases.back().offset = offset;
  }
}

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

}  // namespace

const std::map<std::string, std::vector<OpCase>>& check_cases() {
  static const std::map<std::string, std::vector<OpCase>> table = [] {
    std::map<std::string, std::vector<OpCase>> t;
    for (auto* builder : {encoder_cases, layernorm_cases, layernorm_residual_cases, matmul_cases, matmul_gelu_cases,
                          attention_decode_cases, elementwise_cases, rmsnorm_cases, rope_cases, fused_classifier_cases,
                          vocab_parallel_cases, sum_squares_cases, adamw_cases, muon_cases, moe_cases}) {
      for (OpCase& c : builder()) t[c.op].push_back(std::move(c));
    }
    return t;
  }();
  return table;
}

}  // namespace llmtrain::op_cases
