// Every CUDA op against its CPU reference, written as data in the manner of ggml's test-backend-ops.
// An OpCase names an op and a shape, lists the op's tensors (shape, dtype, role, random range,
// tolerance per dtype) and calls the public ops:: functions on them; one driver (run_case) runs a
// case at one activation dtype, f32 or bf16, on the CPU and on the GPU, and compares:
//
//   - inputs are random from a seed derived from the case's name; in a bf16 run they are rounded
//     to bf16 on the host, and the reference is the f32 CPU op on those same rounded values (its
//     outputs unrounded), so a bf16 kernel is held to its fp32 arithmetic plus one rounding;
//   - every device tensor is framed by sentinels (cuda_compare.h) at offset 0 or at a misaligned
//     offset of one element (the kernels' scalar paths; sizes divisible by 4 (f32) or 8 (bf16) at
//     offset 0 take their 128-bit paths);
//   - outputs must be finite, the reference not all zero, and the error normalised by the
//     reference's largest element within the tensor's tolerance for the run's dtype: f32 about
//     1e-5 for elementwise ops, 1e-4 for matmuls and reductions; bf16 outputs 1e-2 (the rounding
//     of the result alone is up to 2^-9 relative: a few bf16 ulps of the largest element); f32
//     outputs of bf16 ops (weight gradients, statistics) 2e-3, as they differ from the reference
//     only in summation order;
//   - accumulating outputs (+=) start from nonzero values and, where marked, must change;
//   - inputs and absent tensors (a bias that is not there) must come back bit for bit;
//   - where marked, repeated runs on fresh copies must agree bit for bit.
//
// Each op has one Catch2 test case per dtype ("cuda layernorm bf16 matches the cpu reference");
// a failure names the case ("layernorm bf16 N=64 C=127 offset=1") and the tensor. Without a GPU
// every [cuda] case skips visibly.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "catch_compat.h"
#include "core/error.h"
#include "cuda_compare.h"
#include "grad_check.h"
#include "ops/buffer.h"
#include "ops/ops.h"

using namespace llmtrain;
using namespace llmtrain::test;

namespace {

// ---- what a case is --------------------------------------------------------------------------

enum class Kind {
  act,  // the run's dtype: activations, their gradients, the weights an op reads
  f32,  // always f32: weight gradients and statistics (mean, rstd, losses), optimizer state
  i32,  // token ids
};
enum class Role {
  in,      // read only: must come back bit for bit
  out,     // overwritten (pre-filled with random values that must not survive)
  acc,     // accumulated into (+=), pre-filled with random values
  absent,  // passed as a tensor without data (no bias, no position table); must stay untouched
};
enum class Changes { no, yes, f32_only };  // whether an accumulating output must change
enum class Compare { values, change };     // change: compare (after - before), for an update

/// A normalised error allowed for an output, in an f32 run and in a bf16 run.
struct Tol {
  double f32, bf16;
};
constexpr Tol act_elementwise{1e-5, 1e-2};  // elementwise outputs in the run's dtype
constexpr Tol act_reduction{1e-4, 1e-2};    // matmul and reduction outputs in the run's dtype
constexpr Tol f32_elementwise{1e-5, 2e-3};  // f32 outputs: statistics, losses
constexpr Tol f32_reduction{1e-4, 2e-3};    // f32 outputs summed over rows: weight gradients
// f32 sums over rows of an intermediate that a bf16 run rounds to bf16 and the reference keeps in
// f32 (the fused MLP's GELU output and dpre): one more bf16 rounding inside.
constexpr Tol f32_reduction_of_bf16{1e-4, 1e-2};

using Shape = std::vector<std::int64_t>;

struct Arg {
  std::string name;
  Shape shape;
  Kind kind = Kind::act;
  Role role = Role::in;
  float lo = -1.0f, hi = 1.0f;  // uniform random values in [lo, hi); i32: token ids in [lo, hi)
  Tol tol{0.0, 0.0};            // outputs only
  Changes changes = Changes::no;
  Compare compare = Compare::values;
  double scale_floor = 0.0;  // errors normalised by at least this (see losses)
};

Arg input(std::string name, Shape shape, float lo = -1.0f, float hi = 1.0f) {
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
Arg accumulated(std::string name, Shape shape, Tol tol, Changes changes = Changes::yes) {
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

/// The tensors of one run of a case, by name; an absent one is a Tensor without data.
class Args {
 public:
  void add(const std::string& name, const Tensor& t) {
    names_.push_back(name);
    tensors_.push_back(t);
  }
  const Tensor& operator[](std::string_view name) const {
    for (std::size_t i = 0; i < names_.size(); ++i) {
      if (names_[i] == name) return tensors_[i];
    }
    throw std::logic_error("op case has no tensor named " + std::string(name));
  }

 private:
  std::vector<std::string> names_;
  std::vector<Tensor> tensors_;
};

struct OpCase {
  OpCase(std::string op_name, std::string shape_desc) : op(std::move(op_name)), shape(std::move(shape_desc)) {}

  std::string op;     // which test case runs it: "layernorm"
  std::string shape;  // "N=64 C=127"
  std::vector<Arg> args;
  std::function<double(const Args&)> run;  // the ops:: calls; returns the op's result, or 0
  // When set, the reference runs this instead of `run`, told the run's dtype: for a fused op
  // whose bf16 kernel rounds an intermediate to bf16 that the f32 reference would keep.
  std::function<double(const Args&, DType)> reference;
  std::vector<DType> dtypes{DType::f32, DType::bf16};
  std::size_t offset = 0;          // leading sentinels of every device tensor (1: misaligned views)
  std::optional<Tol> result_tol;   // compare run's return value too, relative to
  double result_scale_floor = 0.0;  // max(|reference|, this)
  int runs = 1;                    // > 1: repeated device runs must agree bit for bit

  std::string name(DType dtype) const {
    return op + " " + dtype_name(dtype) + " " + shape + " offset=" + std::to_string(offset);
  }
};

std::string shape_name(std::initializer_list<std::pair<const char*, std::int64_t>> dims) {
  std::string s;
  for (const auto& [name, value] : dims) {
    if (!s.empty()) s += ' ';
    s.append(name).append("=").append(std::to_string(value));
  }
  return s;
}

// Adds `c` once per offset.
void add(std::vector<OpCase>& cases, const OpCase& c, std::initializer_list<std::size_t> offsets = {0, 1}) {
  for (const std::size_t offset : offsets) {
    cases.push_back(c);
    cases.back().offset = offset;
  }
}

// ---- the cases -------------------------------------------------------------------------------
// The grids are the union of those the fp32 and bf16 tests used: odd sizes, sizes that take the
// 128-bit paths (64 and 768 channels: 4 f32 or 8 bf16 per access), and the real model's sizes.

const std::vector<std::pair<int, int>> batch_shapes = {{1, 1}, {1, 5}, {2, 17}, {2, 32}, {1, 257}};  // B, T
const std::vector<int> channel_sizes = {1, 3, 64, 127, 768};
const std::vector<std::int64_t> element_counts = {1, 3, 4, 5, 8, 9, 1000, 4099, 1 << 20};

std::vector<OpCase> encoder_cases() {
  std::vector<OpCase> cases;
  for (const auto& [B, T] : batch_shapes) {
    for (const int C : channel_sizes) {
      for (const int V : {7, 1001}) {  // 7: long runs of one token in the sorted backward
        for (const bool positions : {true, false}) {
          const int maxT = T + 3;
          OpCase c{"encoder", shape_name({{"B", B}, {"T", T}, {"C", C}, {"V", V}, {"positions", positions}})};
          c.args = {tokens("inp", {B, T}, V),
                    input("wte", {V, C}),
                    present_if(positions, input("wpe", {maxT, C})),
                    output("out", {B, T, C}, act_elementwise),
                    input("dout", {B, T, C}),
                    // Same additions in the same order as the CPU: expected bit-identical in f32.
                    always_f32(accumulated("dwte", {V, C}, f32_elementwise)),
                    present_if(positions, always_f32(accumulated("dwpe", {maxT, C}, f32_elementwise)))};
          c.run = [](const Args& a) {
            ops::encoder_forward(a["out"], a["inp"], a["wte"], a["wpe"]);
            ops::encoder_backward(a["dwte"], a["dwpe"], a["dout"], a["inp"]);
            return 0.0;
          };
          add(cases, c);
        }
      }
    }
  }
  // Many repeats of every token: the sorted backward must sum them in a fixed order.
  const int B = 4, T = 256, C = 768, V = 50;
  OpCase c{"encoder_backward deterministic", shape_name({{"B", B}, {"T", T}, {"C", C}, {"V", V}})};
  c.args = {tokens("inp", {B, T}, V), input("dout", {B, T, C}),
            range(0.0f, 0.0f, always_f32(accumulated("dwte", {V, C}, f32_elementwise)))};
  c.run = [](const Args& a) {
    ops::encoder_backward(a["dwte"], Tensor(), a["dout"], a["inp"]);
    return 0.0;
  };
  c.runs = 3;
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
    for (const int C : channels) {
      const std::int64_t N = std::int64_t(B) * T;
      OpCase c{"layernorm", shape_name({{"N", N}, {"C", C}})};
      c.args = {input("inp", {N, C}, -2.0f, 3.0f),
                input("weight", {C}, 0.5f, 1.5f),
                input("bias", {C}),
                output("out", {N, C}, act_elementwise),
                always_f32(output("mean", {N}, f32_elementwise)),
                always_f32(output("rstd", {N}, f32_elementwise)),
                input("dout", {N, C}),
                accumulated("dinp", {N, C}, act_reduction, C > 1 ? Changes::yes : Changes::no),  // C = 1: 0
                always_f32(accumulated("dweight", {C}, f32_reduction, Changes::no)),  // C = 1: 0 too
                always_f32(accumulated("dbias", {C}, f32_reduction))};
      c.run = [](const Args& a) {
        ops::layernorm_forward(a["out"], a["mean"], a["rstd"], a["inp"], a["weight"], a["bias"]);
        ops::layernorm_backward(a["dinp"], a["dweight"], a["dbias"], a["dout"], a["inp"], a["weight"], a["mean"],
                                a["rstd"]);
        return 0.0;
      };
      add(cases, c);
    }
  }
  return cases;
}

// residual = a + b, then its LayerNorm, in one kernel.
std::vector<OpCase> layernorm_residual_cases() {
  std::vector<OpCase> cases;
  for (const auto& [B, T] : batch_shapes) {
    for (const int C : channel_sizes) {
      const std::int64_t N = std::int64_t(B) * T;
      OpCase c{"layernorm_residual", shape_name({{"N", N}, {"C", C}})};
      c.args = {input("a", {N, C}, -2.0f, 3.0f),
                input("b", {N, C}),
                input("weight", {C}, 0.5f, 1.5f),
                input("bias", {C}),
                output("residual", {N, C}, act_elementwise),
                output("out", {N, C}, act_elementwise),
                always_f32(output("mean", {N}, f32_elementwise)),
                always_f32(output("rstd", {N}, f32_elementwise))};
      c.run = [](const Args& a) {
        ops::layernorm_residual_forward(a["residual"], a["out"], a["mean"], a["rstd"], a["a"], a["b"], a["weight"],
                                        a["bias"]);
        return 0.0;
      };
      // A bf16 kernel normalises the residual it stored, rounded to bf16 (as the unfused ops
      // would): so does the reference, else a row of nearly equal values (C = 3) differs by far
      // more than a rounding.
      c.reference = [](const Args& a, DType dtype) {
        ops::layernorm_residual_forward(a["residual"], a["out"], a["mean"], a["rstd"], a["a"], a["b"], a["weight"],
                                        a["bias"]);
        if (dtype == DType::bf16) {
          float* residual = a["residual"].as<float>();
          for (std::int64_t i = 0; i < a["residual"].numel(); ++i) residual[i] = to_float(to_bf16(residual[i]));
          ops::layernorm_forward(a["out"], a["mean"], a["rstd"], a["residual"], a["weight"], a["bias"]);
        }
        return 0.0;
      };
      add(cases, c);
    }
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
            OpCase c{"matmul", shape_name({{"N", N}, {"C", C}, {"OC", OC}, {"bias", with_bias}}) +
                                   (overwrite ? " overwrite" : "")};
            c.args = {input("inp", {N, C}),
                      input("weight", {OC, C}),
                      present_if(with_bias, input("bias", {OC})),  // offset 1: an odd bias address
                      output("out", {N, OC}, act_reduction),
                      input("dout", {N, OC}),
                      overwrite ? output("dinp", {N, C}, act_reduction) : accumulated("dinp", {N, C}, act_reduction),
                      always_f32(accumulated("dweight", {OC, C}, f32_reduction)),
                      present_if(with_bias, always_f32(accumulated("dbias", {OC}, f32_reduction)))};
            c.run = [overwrite](const Args& a) {
              ops::matmul_forward(a["out"], a["inp"], a["weight"], a["bias"]);
              ops::matmul_backward(a["dinp"], a["dweight"], a["dbias"], a["dout"], a["inp"], a["weight"],
                                   overwrite ? ops::Accumulate::no : ops::Accumulate::yes);
              return 0.0;
            };
            add(cases, c);
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
    for (const bool with_bias : {true, false}) {
      const auto [N, C, F, OC] = d;
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
      c.run = [](const Args& a) {
        ops::matmul_gelu_forward(a["out"], a["pre"], a["inp"], a["fc_w"], a["fc_b"]);
        ops::matmul_backward_dgelu(a["dpre"], a["dproj_w"], a["dproj_b"], a["dfc_b"], a["dout"], a["out"], a["pre"],
                                   a["proj_w"]);
        return 0.0;
      };
      add(cases, c);
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
      c.run = [pos, NH, NKV](const Args& a) {
        ops::attention_decode(a["out"], a["q"], a["k_cache"], a["v_cache"], pos, NH, NKV);
        return 0.0;
      };
      add(cases, c);
    }
  }
  return cases;
}

std::vector<OpCase> elementwise_cases() {
  std::vector<OpCase> cases;
  for (const std::int64_t N : element_counts) {
    OpCase gelu{"gelu", shape_name({{"N", N}})};
    gelu.args = {input("inp", {N}, -5.0f, 5.0f), input("dout", {N}), output("out", {N}, act_elementwise),
                 accumulated("dinp", {N}, act_elementwise)};
    gelu.run = [](const Args& a) {
      ops::gelu_forward(a["out"], a["inp"]);
      ops::gelu_backward(a["dinp"], a["inp"], a["dout"]);
      return 0.0;
    };
    add(cases, gelu);

    OpCase residual{"residual", shape_name({{"N", N}})};
    residual.args = {input("a", {N}, -5.0f, 5.0f), input("b", {N}, -3.0f, 3.0f), input("dout", {N}),
                     output("out", {N}, act_elementwise), accumulated("da", {N}, act_elementwise),
                     accumulated("db", {N}, act_elementwise)};
    residual.run = [](const Args& a) {
      ops::residual_forward(a["out"], a["a"], a["b"]);
      ops::residual_backward(a["da"], a["db"], a["dout"]);
      return 0.0;
    };
    add(cases, residual);

    OpCase swiglu{"swiglu", shape_name({{"N", N}})};
    swiglu.args = {input("gate", {N}, -5.0f, 5.0f), input("up", {N}, -3.0f, 3.0f), input("dout", {N}),
                   output("out", {N}, act_elementwise), accumulated("dgate", {N}, act_elementwise),
                   accumulated("dup", {N}, act_elementwise)};
    swiglu.run = [](const Args& a) {
      ops::swiglu_forward(a["out"], a["gate"], a["up"]);
      ops::swiglu_backward(a["dgate"], a["dup"], a["dout"], a["gate"], a["up"]);
      return 0.0;
    };
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
      c.run = [](const Args& a) {
        ops::rmsnorm_forward(a["out"], a["rstd"], a["inp"], a["weight"], 1e-5f);
        ops::rmsnorm_backward(a["dinp"], a["dweight"], a["dout"], a["inp"], a["weight"], a["rstd"]);
        return 0.0;
      };
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
            c.run = [theta, n_rot, pos0](const Args& a) {
              ops::rope_forward(a["out"], a["inp"], theta, n_rot, pos0);
              ops::rope_backward(a["dinp"], a["dout"], theta, n_rot, pos0);
              return 0.0;
            };
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
      for (const float scale : {0.0f, 0.125f}) {
        OpCase c{"fused_classifier", shape_name({{"N", N}, {"V", V}, {"dlogits", scale > 0.0f}})};
        // Without a scale the logits are left alone (bit for bit); with one they become dlogits.
        // A loss is log-sum-exp - logit, terms of the logits' size: a nearly certain row's loss
        // (1e-6 at N=1, V=3) carries their rounding, so losses are compared at a scale of 1 at least.
        Arg losses = always_f32(output("losses", {N}, f32_elementwise));
        losses.scale_floor = 1.0;
        c.args = {scale > 0.0f ? range(-8.0f, 8.0f, output("logits", {N, V}, act_elementwise))
                               : input("logits", {N, V}, -8.0f, 8.0f),
                  losses, tokens("targets", {N}, V)};
        c.run = [scale](const Args& a) { return ops::fused_classifier(a["logits"], a["losses"], a["targets"], scale); };
        c.result_tol = f32_elementwise;  // the loss sum: fp32 losses from the same logits
        c.result_scale_floor = 1.0;      // as the losses
        add(cases, c);
      }
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
      row_max.run = [](const Args& a) {
        ops::classifier_row_max(a["row_max"], a["logits"]);
        return 0.0;
      };
      add(cases, row_max);

      OpCase stats{"vocab_parallel", "row_stats " + shape};
      stats.args = {input("logits", {N, V}, -8.0f, 8.0f), always_f32(input("row_max", {N}, 8.0f, 9.0f)), targets,
                    always_f32(output("sum_exp", {N}, f32_reduction)),
                    always_f32(output("target_logit", {N}, f32_elementwise))};
      stats.run = [vocab_begin](const Args& a) {
        ops::classifier_row_stats(a["sum_exp"], a["target_logit"], a["logits"], a["row_max"], a["targets"],
                                  vocab_begin);
        return 0.0;
      };
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
        finish.run = [vocab_begin, scale](const Args& a) {
          return ops::classifier_parallel_finish(a["logits"], a["losses"], a["row_max"], a["sum_exp"],
                                                 a["target_logit"], a["targets"], vocab_begin, scale);
        };
        finish.result_tol = f32_elementwise;
        finish.result_scale_floor = 1.0;
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
    OpCase c{"sum_squares", shape_name({{"N", N}})};
    c.args = {always_f32(input("x", {N}, -3.0f, 3.0f))};
    c.run = [](const Args& a) { return ops::sum_squares(a["x"]); };
    c.dtypes = {DType::f32};
    c.result_tol = Tol{1e-10, 0.0};  // summed in double on both sides; float would be ~1e-7
    c.runs = 2;
    add(cases, c, {0, 1, 2, 3});  // every misalignment of the 128-bit body
  }
  return cases;
}

std::vector<OpCase> adamw_cases() {
  std::vector<OpCase> cases;
  for (const std::int64_t N : element_counts) {
    for (const int step : {1, 10}) {
      OpCase c{"adamw_update", shape_name({{"N", N}, {"step", step}})};
      Arg param = always_f32(accumulated("param", {N}, f32_elementwise));
      param.compare = Compare::change;  // the update itself, not the parameters it is added to
      c.args = {param, always_f32(input("grad", {N}, -2.0f, 2.0f)),
                range(-0.1f, 0.1f, always_f32(accumulated("m", {N}, f32_elementwise, Changes::no))),
                range(0.0f, 0.01f, always_f32(accumulated("v", {N}, f32_elementwise, Changes::no)))};
      // A large learning rate, so that the change of the parameters is far above their rounding.
      const ops::AdamWParams p{0.05f, 0.9f, 0.95f, 1e-8f, 0.1f, step, 0.5f};
      c.run = [p](const Args& a) {
        ops::adamw_update(a["param"], a["grad"], a["m"], a["v"], p);
        return 0.0;
      };
      c.dtypes = {DType::f32};
      add(cases, c);
    }
  }
  return cases;
}

/// Every case, by op (the name of its test cases).
const std::map<std::string, std::vector<OpCase>>& op_cases() {
  static const std::map<std::string, std::vector<OpCase>> table = [] {
    std::map<std::string, std::vector<OpCase>> t;
    for (auto* builder : {encoder_cases, layernorm_cases, layernorm_residual_cases, matmul_cases, matmul_gelu_cases,
                          attention_decode_cases, elementwise_cases, rmsnorm_cases, rope_cases, fused_classifier_cases,
                          vocab_parallel_cases, sum_squares_cases, adamw_cases}) {
      for (OpCase& c : builder()) t[c.op].push_back(std::move(c));
    }
    return t;
  }();
  return table;
}

// ---- the driver ------------------------------------------------------------------------------

DType dtype_in_run(const Arg& a, DType act) {
  return a.kind == Kind::act ? act : a.kind == Kind::f32 ? DType::f32 : DType::i32;
}

Tensor view(void* data, DType dtype, Device device, const Shape& shape) {
  Tensor t(data, dtype, device, {1});
  REQUIRE(shape.size() <= std::size_t(Tensor::max_dims));
  t.ndim = int(shape.size());
  for (std::size_t i = 0; i < shape.size(); ++i) t.shape[i] = shape[i];
  return t;
}

std::size_t numel(const Shape& shape) {
  std::size_t n = 1;
  for (const std::int64_t d : shape) n *= std::size_t(d);
  return n;
}

/// One tensor's values on the host: floats (already rounded to bf16 for a bf16 tensor), or ids.
struct HostValues {
  std::vector<float> f;
  std::vector<std::int32_t> i;
};

HostValues random_values(const Arg& a, DType dtype, std::mt19937& rng) {
  HostValues v;
  const std::size_t n = numel(a.shape);
  if (dtype == DType::i32) {
    std::uniform_int_distribution<std::int32_t> dist(std::int32_t(a.lo), std::int32_t(a.hi) - 1);
    v.i.resize(n);
    for (auto& x : v.i) x = dist(rng);
    return v;
  }
  v.f = a.lo == a.hi ? std::vector<float>(n, a.lo) : uniform_vec(rng, n, a.lo, a.hi);
  if (dtype == DType::bf16) v.f = round_bf16(v.f);
  return v;
}

/// One tensor of a case on the device, between sentinels.
class DeviceTensor {
 public:
  DeviceTensor(const HostValues& v, DType dtype, std::size_t offset) : array_(make(v, dtype, offset)) {}

  Tensor tensor(const Shape& shape) const {
    return std::visit([&](const auto& a) { return view(a.data(), dtype_of_array(a), Device::cuda, shape); }, array_);
  }
  /// The values, widened to float (f32 and bf16 tensors).
  std::vector<float> values() const {
    if (const auto* a = std::get_if<DeviceArray<float>>(&array_)) return a->to_host();
    return to_float(std::get<DeviceArray<Bf16>>(array_).to_host());
  }
  /// True when the device holds exactly `v`, bit for bit.
  bool holds(const HostValues& v) const {
    if (const auto* a = std::get_if<DeviceArray<std::int32_t>>(&array_)) return a->to_host() == v.i;
    if (const auto* a = std::get_if<DeviceArray<Bf16>>(&array_)) {
      const std::vector<Bf16> got = a->to_host(), want = to_bf16(v.f);
      return std::memcmp(got.data(), want.data(), got.size() * sizeof(Bf16)) == 0;
    }
    const std::vector<float> got = std::get<DeviceArray<float>>(array_).to_host();
    return std::memcmp(got.data(), v.f.data(), got.size() * sizeof(float)) == 0;
  }
  bool guards_intact() const {
    return std::visit([](const auto& a) { return a.guards_intact(); }, array_);
  }

 private:
  template <class T>
  static DType dtype_of_array(const DeviceArray<T>&) {
    return dtype_of<T>();
  }
  using Array = std::variant<DeviceArray<float>, DeviceArray<Bf16>, DeviceArray<std::int32_t>>;

  static Array make(const HostValues& v, DType dtype, std::size_t offset) {
    if (dtype == DType::i32) return Array(std::in_place_type<DeviceArray<std::int32_t>>, v.i, offset);
    if (dtype == DType::bf16) return Array(std::in_place_type<DeviceArray<Bf16>>, to_bf16(v.f), offset);
    return Array(std::in_place_type<DeviceArray<float>>, v.f, offset);
  }

  Array array_;
};

std::vector<float> minus(std::vector<float> a, const std::vector<float>& b) {
  for (std::size_t i = 0; i < a.size(); ++i) a[i] -= b[i];
  return a;
}

std::uint64_t seed_of(const std::string& name) {  // FNV-1a: the same inputs on every platform
  std::uint64_t h = 1469598103934665603ull;
  for (const char ch : name) h = (h ^ std::uint8_t(ch)) * 1099511628211ull;
  return h;
}

/// The reference result of a case: the f32 CPU op on the same (rounded) values.
struct Reference {
  std::vector<HostValues> values;
  double result = 0.0;
};

Reference run_reference(const OpCase& c, const std::vector<HostValues>& inputs, DType dtype = DType::f32) {
  Reference ref;
  ref.values = inputs;
  Args args;
  for (std::size_t k = 0; k < c.args.size(); ++k) {
    const Arg& a = c.args[k];
    HostValues& v = ref.values[k];
    if (a.role == Role::absent) {
      args.add(a.name, Tensor());
    } else if (a.kind == Kind::i32) {
      args.add(a.name, view(v.i.data(), DType::i32, Device::cpu, a.shape));
    } else {
      args.add(a.name, view(v.f.data(), DType::f32, Device::cpu, a.shape));
    }
  }
  ref.result = c.reference ? c.reference(args, dtype) : c.run(args);
  return ref;
}

/// Runs one case at one activation dtype on the CPU and the GPU and requires them to agree.
void run_case(const OpCase& c, DType dtype) {
  const std::string name = c.name(dtype);
  INFO("op case: " << name);
  const double result_tol = c.result_tol ? (dtype == DType::bf16 ? c.result_tol->bf16 : c.result_tol->f32) : 0.0;

  std::mt19937 rng(std::uint32_t(seed_of(name)));
  std::vector<HostValues> inputs;
  for (const Arg& a : c.args) inputs.push_back(random_values(a, dtype_in_run(a, dtype), rng));
  const Reference ref = run_reference(c, inputs, dtype);

  std::vector<std::vector<float>> first_outputs(c.args.size());
  double first_result = 0.0;
  for (int run = 0; run < c.runs; ++run) {
    INFO("device run " << run + 1 << " of " << c.runs);
    std::vector<DeviceTensor> device;
    device.reserve(c.args.size());
    Args args;
    for (std::size_t k = 0; k < c.args.size(); ++k) {
      const Arg& a = c.args[k];
      device.emplace_back(inputs[k], dtype_in_run(a, dtype), c.offset);
      args.add(a.name, a.role == Role::absent ? Tensor() : device.back().tensor(a.shape));
    }
    const double result = c.run(args);

    for (std::size_t k = 0; k < c.args.size(); ++k) {
      const Arg& a = c.args[k];
      const DeviceTensor& d = device[k];
      {
        INFO(a.name << ": a sentinel before or after the tensor was overwritten");
        REQUIRE(d.guards_intact());
      }
      if (a.role == Role::in || a.role == Role::absent) {
        INFO(a.name << (a.role == Role::in ? " (an input)" : " (absent)") << " was changed by the op");
        REQUIRE(d.holds(inputs[k]));
        continue;
      }
      std::vector<float> got = d.values();
      if (run > 0) {
        INFO(a.name << " differs between device runs " << 1 << " and " << run + 1);
        REQUIRE(std::memcmp(got.data(), first_outputs[k].data(), got.size() * sizeof(float)) == 0);
        continue;
      }
      const double tol = dtype == DType::bf16 ? a.tol.bf16 : a.tol.f32;
      if (a.compare == Compare::change) {
        require_close(a.name + " change", minus(got, inputs[k].f), minus(ref.values[k].f, inputs[k].f), tol);
      } else {
        require_close(a.name, got, ref.values[k].f, tol, a.scale_floor);
      }
      // An accumulating op that added nothing would match a reference that added nothing. A bf16
      // element whose increment is below half an ulp stays as it was, so a handful of them may
      // all stay; from 64 elements on, some must change.
      const bool bf16 = dtype_in_run(a, dtype) == DType::bf16;
      const bool must_change = a.changes == Changes::yes || (a.changes == Changes::f32_only && dtype == DType::f32);
      if (must_change && (!bf16 || got.size() >= 64)) require_changed(a.name, got, inputs[k].f);
      first_outputs[k] = std::move(got);
    }
    if (run > 0) {
      INFO("the result differs between device runs: " << first_result << " and " << result);
      REQUIRE(std::memcmp(&result, &first_result, sizeof result) == 0);
    } else if (c.result_tol) {
      // In double (sum_squares is held to 1e-10): finite, the reference not zero, relative error.
      const double scale = std::max(std::abs(ref.result), c.result_scale_floor);
      INFO("result " << result << ", reference " << ref.result << ", tolerance " << result_tol << " of " << scale);
      REQUIRE(std::isfinite(ref.result));
      REQUIRE(ref.result != 0.0);
      REQUIRE(std::isfinite(result));
      REQUIRE(std::abs(result - ref.result) <= result_tol * scale);
    }
    first_result = result;
  }
}

/// Runs every case of `op` that has `dtype`; skips visibly without a GPU.
void run_op_cases(const std::string& op, DType dtype) {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);
  const auto found = op_cases().find(op);
  REQUIRE(found != op_cases().end());
  int ran = 0;
  for (const OpCase& c : found->second) {
    if (std::find(c.dtypes.begin(), c.dtypes.end(), dtype) == c.dtypes.end()) continue;
    run_case(c, dtype);
    ++ran;
  }
  REQUIRE(ran > 0);
}

// The ops that have test cases (filled by LLMTRAIN_OP_TEST), to check that none is left out.
std::set<std::string>& ops_with_test_cases() {
  static std::set<std::string> names;
  return names;
}
bool register_op_test(const char* op) { return ops_with_test_cases().insert(op).second; }

}  // namespace

#define LLMTRAIN_CONCAT_(a, b) a##b
#define LLMTRAIN_CONCAT(a, b) LLMTRAIN_CONCAT_(a, b)
// The test cases of one op: "cuda OP f32 matches the cpu reference" [cuda][ops] and, for an op
// with bf16 kernels, "cuda OP bf16 ..." [cuda][bf16].
#define LLMTRAIN_OP_TEST_F32(op)                                                                             \
  [[maybe_unused]] static const bool LLMTRAIN_CONCAT(registered_op_test_, __LINE__) = register_op_test(op); \
  TEST_CASE("cuda " op " f32 matches the cpu reference", "[cuda][ops]") { run_op_cases(op, DType::f32); }
#define LLMTRAIN_OP_TEST(op) \
  LLMTRAIN_OP_TEST_F32(op)   \
  TEST_CASE("cuda " op " bf16 matches the cpu reference", "[cuda][bf16]") { run_op_cases(op, DType::bf16); }

LLMTRAIN_OP_TEST("encoder")
LLMTRAIN_OP_TEST("encoder_backward deterministic")
LLMTRAIN_OP_TEST("layernorm")
LLMTRAIN_OP_TEST("layernorm_residual")
LLMTRAIN_OP_TEST("matmul")
LLMTRAIN_OP_TEST("matmul_gelu")
LLMTRAIN_OP_TEST("attention_decode")
LLMTRAIN_OP_TEST("gelu")
LLMTRAIN_OP_TEST("residual")
LLMTRAIN_OP_TEST("swiglu")
LLMTRAIN_OP_TEST("rmsnorm")
LLMTRAIN_OP_TEST("rope")
LLMTRAIN_OP_TEST("fused_classifier")
LLMTRAIN_OP_TEST("vocab_parallel")
LLMTRAIN_OP_TEST_F32("sum_squares")
LLMTRAIN_OP_TEST_F32("adamw_update")

// Runs without a GPU: the table itself.
TEST_CASE("every op case has a test case, outputs with tolerances, and runs on the cpu", "[ops]") {
  std::set<std::string> in_table;
  for (const auto& [op, cases] : op_cases()) {
    in_table.insert(op);
    std::set<std::string> names;
    for (const OpCase& c : cases) {
      for (const DType dtype : c.dtypes) {
        INFO(c.name(dtype));
        CHECK(names.insert(c.name(dtype)).second);  // no case twice
        int outputs = 0;
        for (const Arg& a : c.args) {
          if (a.role != Role::out && a.role != Role::acc) continue;
          ++outputs;
          CHECK((dtype == DType::bf16 ? a.tol.bf16 : a.tol.f32) > 0.0);
        }
        CHECK((outputs > 0 || c.result_tol));
      }
    }
    // The first (smallest) case: every tensor the ops:: calls name exists, and the shapes fit.
    std::mt19937 rng(1);
    std::vector<HostValues> inputs;
    for (const Arg& a : cases.front().args) inputs.push_back(random_values(a, dtype_in_run(a, DType::f32), rng));
    INFO(cases.front().name(DType::f32));
    CHECK_NOTHROW(run_reference(cases.front(), inputs));
  }
  CHECK(in_table == ops_with_test_cases());
}

// ---- what is not a grid of shapes ------------------------------------------------------------

namespace {

std::uint32_t bits_of(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

}  // namespace

TEST_CASE("cuda convert bf16 widens exactly and rounds to nearest even", "[cuda][bf16]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);

  // Every one of the 65536 bf16 values widens to the float with the same upper bits (NaN payloads
  // too), and rounds back to itself (NaNs to a NaN).
  std::vector<Bf16> all(65536);
  for (std::size_t i = 0; i < all.size(); ++i) all[i].bits = std::uint16_t(i);
  const std::int64_t n_all = std::int64_t(all.size());
  for (const std::size_t offset : {0, 1}) {
    CAPTURE(offset);
    const DeviceArray<Bf16> d_all(all, offset), d_back(std::vector<Bf16>(all.size(), sentinel<Bf16>()), offset);
    const DeviceArray<float> d_wide(Vec(all.size(), sentinel<float>()), offset);
    ops::convert(d_wide.tensor({n_all}), d_all.tensor({n_all}));
    ops::convert(d_back.tensor({n_all}), d_wide.tensor({n_all}));
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
      ops::convert(d_y.tensor({N}), d_x.tensor({N}));
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

TEST_CASE("cuda fused_classifier propagates a NaN logit to the loss, f32 and bf16", "[cuda][ops][bf16]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);

  std::mt19937 rng(110);
  const std::int64_t N = 3;
  const int V = 1001;
  Vec logits = uniform_vec(rng, std::size_t(N) * V);
  logits[std::size_t(V) + 17] = std::numeric_limits<float>::quiet_NaN();  // row 1
  std::vector<std::int32_t> targets = {1, 2, 3};
  for (const DType dtype : {DType::f32, DType::bf16}) {
    CAPTURE(dtype_name(dtype));
    const DeviceTensor d_logits(HostValues{dtype == DType::bf16 ? round_bf16(logits) : logits, {}}, dtype, 0);
    const DeviceArray<float> d_losses(Vec(N, 0.0f));
    const DeviceArray<std::int32_t> d_targets(targets);
    const double sum =
        ops::fused_classifier(d_logits.tensor({N, V}), d_losses.tensor({N}), d_targets.tensor({N}), 1.0f);
    const Vec result = d_losses.to_host();
    CHECK(std::isfinite(result[0]));
    CHECK(std::isnan(result[1]));
    CHECK(std::isfinite(result[2]));
    CHECK(std::isnan(sum));
  }
}

TEST_CASE("cuda vocabulary-parallel cross-entropy over 3 uneven ranks and on one rank matches the cpu "
          "fused_classifier, f32 and bf16", "[cuda][ops][bf16]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);

  const std::int64_t N = 37;
  const int V = 1001;
  const float scale = 1.0f / 37.0f;
  std::mt19937 rng(117);
  const Vec values = uniform_vec(rng, std::size_t(N) * V, -8.0f, 8.0f);
  std::vector<std::int32_t> targets(static_cast<std::size_t>(N));
  for (std::size_t i = 0; i < targets.size(); ++i) targets[i] = std::int32_t((i * 271 + 5) % V);  // every range
  // 400 columns: 128-bit accesses for f32 and bf16; 268: f32 only; 333: neither.
  for (const std::vector<int>& widths : {std::vector<int>{400, 333, 268}, std::vector<int>{V}}) {
    for (const DType dtype : {DType::f32, DType::bf16}) {
      CAPTURE(widths.size(), dtype_name(dtype));
      // The reference: the f32 CPU fused_classifier on the full (rounded) logits.
      const Vec logits = dtype == DType::bf16 ? round_bf16(values) : values;
      Vec want_dlogits = logits, want_losses(static_cast<std::size_t>(N));
      const double want_sum =
          ops::fused_classifier(t(want_dlogits, {N, V}), t(want_losses, {N}), ti(targets, {N}), scale);

      std::vector<DeviceTensor> parts;  // each rank's columns
      std::vector<std::int64_t> begins;
      for (int begin = 0; const int w : widths) {
        Vec columns;
        for (std::int64_t i = 0; i < N; ++i) {
          columns.insert(columns.end(), logits.begin() + i * V + begin, logits.begin() + i * V + begin + w);
        }
        parts.emplace_back(HostValues{columns, {}}, dtype, 0);
        begins.push_back(begin);
        begin += w;
      }
      const DeviceArray<std::int32_t> d_targets(targets);
      const Tensor d_t = d_targets.tensor({N});
      // Step 1 on each rank, the max over the ranks on the host.
      Vec row_max(std::size_t(N), -std::numeric_limits<float>::infinity());
      for (std::size_t r = 0; r < parts.size(); ++r) {
        const DeviceArray<float> d_max(Vec(std::size_t(N), 0.0f));
        ops::classifier_row_max(d_max.tensor({N}), parts[r].tensor({N, widths[r]}));
        const Vec local = d_max.to_host();
        for (std::size_t i = 0; i < local.size(); ++i) row_max[i] = std::max(row_max[i], local[i]);
        require_guards("row_max", d_max);
      }
      // Step 2 on each rank, the sums over the ranks on the host.
      const DeviceArray<float> d_row_max(row_max);
      Vec sum_exp(std::size_t(N), 0.0f), target_logit(std::size_t(N), 0.0f);
      for (std::size_t r = 0; r < parts.size(); ++r) {
        const DeviceArray<float> d_sum(Vec(std::size_t(N), 0.0f)), d_target(Vec(std::size_t(N), 0.0f));
        ops::classifier_row_stats(d_sum.tensor({N}), d_target.tensor({N}), parts[r].tensor({N, widths[r]}),
                                  d_row_max.tensor({N}), d_t, begins[r]);
        const Vec s = d_sum.to_host(), tl = d_target.to_host();
        for (std::size_t i = 0; i < s.size(); ++i) {
          sum_exp[i] += s[i];
          target_logit[i] += tl[i];
        }
      }
      // Step 3 on each rank: the losses and this rank's columns of the gradient.
      const DeviceArray<float> d_sum_exp(sum_exp), d_target_logit(target_logit);
      for (std::size_t r = 0; r < parts.size(); ++r) {
        CAPTURE(r);
        const DeviceArray<float> d_losses(Vec(std::size_t(N), 0.0f));
        const double sum = ops::classifier_parallel_finish(parts[r].tensor({N, widths[r]}), d_losses.tensor({N}),
                                                           d_row_max.tensor({N}), d_sum_exp.tensor({N}),
                                                           d_target_logit.tensor({N}), d_t, begins[r], scale);
        require_close("losses", d_losses.to_host(), want_losses, f32_elementwise.f32, 1.0);
        INFO("loss sum " << sum << ", fused_classifier's " << want_sum);
        CHECK(std::abs(sum - want_sum) <= f32_elementwise.f32 * std::abs(want_sum));
        Vec want_columns;
        for (std::int64_t i = 0; i < N; ++i) {
          const auto row = want_dlogits.begin() + i * V + begins[r];
          want_columns.insert(want_columns.end(), row, row + widths[r]);
        }
        const Tol tol = act_elementwise;
        require_close("dlogits", parts[r].values(), want_columns, dtype == DType::bf16 ? tol.bf16 : tol.f32);
        REQUIRE(parts[r].guards_intact());
      }
    }
  }
}

namespace {
/// Columns [0, V) of each row of `rows` (N rows of `ld`).
Vec first_columns(const Vec& rows, std::int64_t N, std::int64_t V, std::int64_t ld) {
  Vec out;
  for (std::int64_t i = 0; i < N; ++i) out.insert(out.end(), rows.begin() + i * ld, rows.begin() + i * ld + V);
  return out;
}
/// Whether every element of columns [V, ld) of every row is `want` (NaN: is NaN).
bool padding_is(const Vec& rows, std::int64_t N, std::int64_t V, std::int64_t ld, float want) {
  for (std::int64_t i = 0; i < N; ++i) {
    for (std::int64_t v = V; v < ld; ++v) {
      const float x = rows[std::size_t(i * ld + v)];
      if (std::isnan(want) ? !std::isnan(x) : x != want) return false;
    }
  }
  return true;
}
}  // namespace

TEST_CASE("cuda padded vocabulary: the head's matmuls and the classifier over rows of logits_stride(V) equal "
          "the unpadded cpu reference, f32 and bf16", "[cuda][ops][bf16]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);

  const std::int64_t N = 37, C = 24, V = 251, ld = ops::logits_stride(V);  // odd V: rows of 256
  REQUIRE(ld == 256);
  const float scale = 1.0f / float(N);
  std::mt19937 rng(131);
  const Vec inp0 = uniform_vec(rng, std::size_t(N * C)), weight0 = uniform_vec(rng, std::size_t(V * C));
  std::vector<std::int32_t> targets(static_cast<std::size_t>(N));
  for (std::size_t i = 0; i < targets.size(); ++i) targets[i] = std::int32_t((i * 97 + 3) % V);
  for (const DType dtype : {DType::f32, DType::bf16}) {
    CAPTURE(dtype_name(dtype));
    const bool bf16 = dtype == DType::bf16;
    Vec inp = bf16 ? round_bf16(inp0) : inp0, weight = bf16 ? round_bf16(weight0) : weight0;
    // The reference: the f32 CPU ops on unpadded (N,V) logits; the device's logits rounded to bf16
    // before the classifier, as a bf16 run rounds them.
    Vec logits(std::size_t(N * V)), losses(static_cast<std::size_t>(N)), dinp(std::size_t(N * C)), dweight(std::size_t(V * C), 0.0f);
    ops::matmul_forward(t(logits, {N, V}), t(inp, {N, C}), t(weight, {V, C}), Tensor());
    const Vec want_logits = logits;
    if (bf16) logits = round_bf16(logits);
    const double want_sum = ops::fused_classifier(t(logits, {N, V}), t(losses, {N}), ti(targets, {N}), scale);
    if (bf16) logits = round_bf16(logits);
    ops::matmul_backward(t(dinp, {N, C}), t(dweight, {V, C}), Tensor(), t(logits, {N, V}), t(inp, {N, C}),
                         t(weight, {V, C}), ops::Accumulate::no);

    // The device: padded rows whose padding starts as NaN, as unwritten memory may be.
    const DeviceTensor d_inp(HostValues{inp, {}}, dtype, 0), d_weight(HostValues{weight, {}}, dtype, 0);
    const DeviceTensor d_logits(HostValues{Vec(std::size_t(N * ld), std::numeric_limits<float>::quiet_NaN()), {}},
                                dtype, 0);
    const DeviceTensor d_dinp(HostValues{Vec(std::size_t(N * C), 0.0f), {}}, dtype, 0);
    const DeviceArray<float> d_dweight(Vec(std::size_t(V * C), 0.0f)), d_losses(Vec(std::size_t(N), 0.0f));
    const DeviceArray<std::int32_t> d_targets(targets);
    ops::matmul_forward(d_logits.tensor({N, ld}), d_inp.tensor({N, C}), d_weight.tensor({V, C}), Tensor());
    const Vec got_logits = d_logits.values();
    require_close("logits", first_columns(got_logits, N, V, ld), want_logits, bf16 ? act_reduction.bf16 : act_reduction.f32);
    CHECK(padding_is(got_logits, N, V, ld, std::numeric_limits<float>::quiet_NaN()));  // not written

    const double sum = ops::fused_classifier(d_logits.tensor({N, ld}), d_losses.tensor({N}), d_targets.tensor({N}),
                                             scale, nullptr, V);
    require_close("losses", d_losses.to_host(), losses, bf16 ? f32_reduction_of_bf16.bf16 : f32_elementwise.f32, 1.0);
    CHECK(std::abs(sum - want_sum) <= (bf16 ? 1e-4 : 1e-5) * std::abs(want_sum));
    const Vec got_dlogits = d_logits.values();
    require_close("dlogits", first_columns(got_dlogits, N, V, ld), logits, bf16 ? act_elementwise.bf16 : act_elementwise.f32);
    CHECK(padding_is(got_dlogits, N, V, ld, 0.0f));  // masked: the gradient's padding is 0

    ops::matmul_backward(d_dinp.tensor({N, C}), d_dweight.tensor({V, C}), Tensor(), d_logits.tensor({N, ld}),
                         d_inp.tensor({N, C}), d_weight.tensor({V, C}), ops::Accumulate::no);
    require_close("dinp", d_dinp.values(), dinp, bf16 ? act_reduction.bf16 : act_reduction.f32);
    require_close("dweight", d_dweight.to_host(), dweight, bf16 ? f32_reduction_of_bf16.bf16 : f32_reduction.f32);

    // The vocabulary-parallel steps on one rank over the same padded rows give the same losses.
    const DeviceTensor d_again(HostValues{Vec(std::size_t(N * ld), std::numeric_limits<float>::quiet_NaN()), {}},
                               dtype, 0);
    ops::matmul_forward(d_again.tensor({N, ld}), d_inp.tensor({N, C}), d_weight.tensor({V, C}), Tensor());
    const DeviceArray<float> d_max(Vec(std::size_t(N), 0.0f)), d_sum_exp(Vec(std::size_t(N), 0.0f)),
        d_target(Vec(std::size_t(N), 0.0f)), d_losses2(Vec(std::size_t(N), 0.0f));
    ops::classifier_row_max(d_max.tensor({N}), d_again.tensor({N, ld}), V);
    ops::classifier_row_stats(d_sum_exp.tensor({N}), d_target.tensor({N}), d_again.tensor({N, ld}), d_max.tensor({N}),
                              d_targets.tensor({N}), 0, V);
    ops::classifier_parallel_finish(d_again.tensor({N, ld}), d_losses2.tensor({N}), d_max.tensor({N}),
                                    d_sum_exp.tensor({N}), d_target.tensor({N}), d_targets.tensor({N}), 0, scale,
                                    nullptr, V);
    require_close("parallel losses", d_losses2.to_host(), losses, bf16 ? f32_reduction_of_bf16.bf16 : f32_elementwise.f32,
                  1.0);
    const Vec got_parallel = d_again.values();
    require_close("parallel dlogits", first_columns(got_parallel, N, V, ld), logits,
                  bf16 ? act_elementwise.bf16 : act_elementwise.f32);
    CHECK(padding_is(got_parallel, N, V, ld, 0.0f));
  }
}

TEST_CASE("cuda vocabulary-parallel steps: a NaN logit makes the sum NaN, a negative target the target logit",
          "[cuda][ops][bf16]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);

  // Rows 0 and 2 are clean; row 1 has a NaN logit; row 2's target is negative. The max skips the
  // NaN (as the CPU's does), so the all-reduced max stays a number and the sum carries the NaN.
  const std::int64_t N = 3;
  const int V = 1001;
  const std::int64_t vocab_begin = 5000;
  std::mt19937 rng(118);
  Vec logits = uniform_vec(rng, std::size_t(N) * V);
  logits[std::size_t(V) + 17] = std::numeric_limits<float>::quiet_NaN();
  std::vector<std::int32_t> targets = {5003, 5004, -1};
  for (const DType dtype : {DType::f32, DType::bf16}) {
    CAPTURE(dtype_name(dtype));
    const Vec values = dtype == DType::bf16 ? round_bf16(logits) : logits;
    const DeviceTensor d_logits(HostValues{values, {}}, dtype, 0);
    const DeviceArray<std::int32_t> d_targets(targets);
    const DeviceArray<float> d_max(Vec(N, 0.0f)), d_sum(Vec(N, 0.0f)), d_target(Vec(N, 0.0f));
    ops::classifier_row_max(d_max.tensor({N}), d_logits.tensor({N, V}));
    const Vec row_max = d_max.to_host();
    for (std::int64_t i = 0; i < N; ++i) {
      float want = -std::numeric_limits<float>::infinity();
      for (int v = 0; v < V; ++v) want = std::max(want, values[std::size_t(i * V + v)]);
      CHECK(row_max[std::size_t(i)] == want);
    }
    ops::classifier_row_stats(d_sum.tensor({N}), d_target.tensor({N}), d_logits.tensor({N, V}), d_max.tensor({N}),
                              d_targets.tensor({N}), vocab_begin);
    const Vec sum_exp = d_sum.to_host(), target_logit = d_target.to_host();
    CHECK(std::isfinite(sum_exp[0]));
    CHECK(std::isnan(sum_exp[1]));
    CHECK(std::isfinite(sum_exp[2]));
    CHECK(target_logit[0] == values[3]);
    CHECK(target_logit[1] == values[std::size_t(V) + 4]);
    CHECK(std::isnan(target_logit[2]));
  }
}

TEST_CASE("cuda ops refuse arguments on different devices", "[cuda][ops]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);

  Vec a(4, 1.0f), out(4);
  const DeviceArray<float> d_b(a);
  CHECK_THROWS_AS(ops::residual_forward(t(out, {4}), t(a, {4}), d_b.tensor({4})), RuntimeError);
}

TEST_CASE("cuda multi-tensor adamw_update_runs matches the cpu adamw_update per run and writes the bf16 copy",
          "[cuda][ops][optim]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);

  // Runs of odd sizes with gaps between them (which must stay untouched), decayed and not, at
  // offsets on and off a multiple of 4 elements (the 128-bit and the scalar paths), one longer
  // than two chunks (several blocks of one run) and one of a single element.
  const std::vector<ops::AdamWRun> runs = {{0, 1000, true},   {1000, 3, false},     {1003, 8197, true},
                                           {9201, 1, false},  {9205, 768, false},   {9973, 4099, true},
                                           {14075, 517, true}};
  const std::int64_t N = 14075 + 517 + 5;  // five elements after the last run
  std::vector<bool> covered(std::size_t(N), false);
  for (const auto& r : runs) {
    for (std::int64_t i = r.offset; i < r.offset + r.length; ++i) covered[std::size_t(i)] = true;
  }
  std::mt19937 rng(2718);
  const Vec param0 = uniform_vec(rng, std::size_t(N)), grad = uniform_vec(rng, std::size_t(N), -2.0f, 2.0f);
  const Vec m0 = uniform_vec(rng, std::size_t(N), -0.1f, 0.1f), v0 = uniform_vec(rng, std::size_t(N), 0.0f, 0.01f);
  const std::vector<Bf16> working0(std::size_t(N), sentinel<Bf16>());
  const ops::AdamWPlan plan(runs, Device::cuda);
  CHECK(plan.chunks() >= std::int64_t(runs.size()) + 2);

  for (const int step : {1, 10}) {
    for (const std::size_t offset : {0, 1}) {
      for (const bool with_working : {true, false}) {
        CAPTURE(step, offset, with_working);
        // A large learning rate and weight decay, so that the update and the decay are far above
        // the rounding of the weights.
        const ops::AdamWParams p{0.05f, 0.9f, 0.95f, 1e-8f, 0.5f, step, 0.5f};
        // The reference: the CPU adamw_update, run by run, with the run's weight decay.
        Vec want_param = param0, want_m = m0, want_v = v0, g = grad;
        for (const auto& r : runs) {
          const auto at = std::size_t(r.offset);
          const ops::AdamWParams q{p.lr, p.beta1, p.beta2, p.eps, r.decay ? p.weight_decay : 0.0f, step, p.grad_scale};
          ops::adamw_update(Tensor(want_param.data() + at, DType::f32, Device::cpu, {r.length}),
                            Tensor(g.data() + at, DType::f32, Device::cpu, {r.length}),
                            Tensor(want_m.data() + at, DType::f32, Device::cpu, {r.length}),
                            Tensor(want_v.data() + at, DType::f32, Device::cpu, {r.length}), q);
        }
        const DeviceArray<float> d_param(param0, offset), d_grad(grad, offset), d_m(m0, offset), d_v(v0, offset);
        const DeviceArray<Bf16> d_working(working0, offset);
        ops::adamw_update_runs(d_param.tensor({N}), d_grad.tensor({N}), d_m.tensor({N}), d_v.tensor({N}),
                               with_working ? d_working.tensor({N}) : Tensor(), plan, p);
        const Vec got_param = d_param.to_host(), got_m = d_m.to_host(), got_v = d_v.to_host();
        require_close("param change", minus(got_param, param0), minus(want_param, param0), f32_elementwise.f32);
        require_close("m", got_m, want_m, f32_elementwise.f32);
        require_close("v", got_v, want_v, f32_elementwise.f32);
        // Outside the runs nothing moves; the gradient is read only.
        std::size_t moved = 0, wrong_copy = 0;
        const std::vector<Bf16> working = d_working.to_host();
        for (std::size_t i = 0; i < std::size_t(N); ++i) {
          if (!covered[i]) {
            moved += bits_of(got_param[i]) != bits_of(param0[i]) || bits_of(got_m[i]) != bits_of(m0[i]) ||
                     bits_of(got_v[i]) != bits_of(v0[i]) || working[i].bits != working0[i].bits;
          } else if (with_working) {
            wrong_copy += working[i].bits != to_bf16(got_param[i]).bits;  // the updated weight, rounded
          } else {
            wrong_copy += working[i].bits != working0[i].bits;
          }
        }
        CHECK(moved == 0);
        CHECK(wrong_copy == 0);
        CHECK(d_grad.to_host() == grad);
        for (const auto* a : {&d_param, &d_grad, &d_m, &d_v}) require_guards("f32 array", *a);
        require_guards("working", d_working);
      }
    }
  }
  // A plan for the wrong device, or runs past the arrays' end, are refused.
  const ops::AdamWPlan cpu_plan(runs, Device::cpu);
  const DeviceArray<float> d_x(param0);
  const ops::AdamWParams p{0.05f, 0.9f, 0.95f, 1e-8f, 0.5f, 1, 1.0f};
  CHECK_THROWS_AS(ops::adamw_update_runs(d_x.tensor({N}), d_x.tensor({N}), d_x.tensor({N}), d_x.tensor({N}), Tensor(),
                                         cpu_plan, p),
                  RuntimeError);
  Vec small(10);
  CHECK_THROWS_AS(ops::adamw_update_runs(t(small, {10}), t(small, {10}), t(small, {10}), t(small, {10}), Tensor(),
                                         cpu_plan, p),
                  RuntimeError);
}

TEST_CASE("cuda fused_classifier, classifier_parallel_finish and sum_squares add into a DeviceSum",
          "[cuda][ops][bf16]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);

  // Three "micro-steps" of different row counts: the deferred sum must be the sum of the values
  // the immediate calls return, added in the same order (bit for bit), and each deferred call
  // returns 0; take() starts the sum again from 0.
  std::mt19937 rng(314);
  const int V = 251;
  for (const DType dtype : {DType::f32, DType::bf16}) {
    CAPTURE(dtype_name(dtype));
    ops::DeviceSum deferred(Device::cuda);
    double immediate = 0.0;
    for (const std::int64_t N : {std::int64_t(5), std::int64_t(64), std::int64_t(700)}) {
      CAPTURE(N);
      Vec logits = uniform_vec(rng, std::size_t(N) * V, -4.0f, 4.0f);
      if (dtype == DType::bf16) logits = round_bf16(logits);
      std::vector<std::int32_t> targets(static_cast<std::size_t>(N));
      for (std::size_t i = 0; i < targets.size(); ++i) targets[i] = std::int32_t((i * 97 + 3) % V);
      const DeviceArray<std::int32_t> d_targets(targets);
      const DeviceArray<float> d_losses(Vec(std::size_t(N), 0.0f)), d_row_max(Vec(std::size_t(N), 0.0f));
      const DeviceArray<float> d_sum_exp(Vec(std::size_t(N), 0.0f)), d_target(Vec(std::size_t(N), 0.0f));
      const DeviceTensor a(HostValues{logits, {}}, dtype, 0), b(HostValues{logits, {}}, dtype, 0);
      immediate += ops::fused_classifier(a.tensor({N, V}), d_losses.tensor({N}), d_targets.tensor({N}), 0.5f);
      CHECK(ops::fused_classifier(b.tensor({N, V}), d_losses.tensor({N}), d_targets.tensor({N}), 0.5f, &deferred) ==
            0.0);
      CHECK(a.values() == b.values());  // the same gradient either way
      // The vocabulary-parallel finish on one rank, deferred too.
      const DeviceTensor c(HostValues{logits, {}}, dtype, 0);
      ops::classifier_row_max(d_row_max.tensor({N}), c.tensor({N, V}));
      ops::classifier_row_stats(d_sum_exp.tensor({N}), d_target.tensor({N}), c.tensor({N, V}), d_row_max.tensor({N}),
                                d_targets.tensor({N}), 0);
      ops::DeviceSum parallel(Device::cuda);
      const double finish_now =
          ops::classifier_parallel_finish(c.tensor({N, V}), d_losses.tensor({N}), d_row_max.tensor({N}),
                                          d_sum_exp.tensor({N}), d_target.tensor({N}), d_targets.tensor({N}), 0, 0.0f);
      CHECK(ops::classifier_parallel_finish(c.tensor({N, V}), d_losses.tensor({N}), d_row_max.tensor({N}),
                                            d_sum_exp.tensor({N}), d_target.tensor({N}), d_targets.tensor({N}), 0,
                                            0.0f, &parallel) == 0.0);
      CHECK(parallel.take() == finish_now);
    }
    const double got = deferred.take();
    CHECK(std::isfinite(got));
    CHECK(got > 0.0);
    CHECK(got == immediate);
    CHECK(deferred.take() == 0.0);
  }
  // The gradient norm's parts (several ranges, some misaligned): one sum, read once, equal to the
  // returned sums added in order.
  {
    const Vec x = uniform_vec(rng, 20011, -3.0f, 3.0f);
    const DeviceArray<float> d_x(x);
    ops::DeviceSum squares(Device::cuda);
    double immediate = 0.0;
    for (const auto& [begin, length] : {std::pair{0, 4096}, std::pair{4097, 3}, std::pair{4101, 15000}}) {
      const Tensor part(d_x.data() + begin, DType::f32, Device::cuda, {length});
      immediate += ops::sum_squares(part);
      CHECK(ops::sum_squares(part, &squares) == 0.0);
    }
    CHECK(immediate > 0.0);
    CHECK(squares.take() == immediate);
  }
  // A loss sum in host memory for device losses is refused.
  ops::DeviceSum host_sum(Device::cpu);
  Vec logits(2 * 4, 0.5f);
  const DeviceArray<float> d_logits(logits), d_losses(Vec(2, 0.0f));
  const DeviceArray<std::int32_t> d_targets(std::vector<std::int32_t>{0, 1});
  CHECK_THROWS_AS(ops::fused_classifier(d_logits.tensor({2, 4}), d_losses.tensor({2}), d_targets.tensor({2}), 1.0f,
                                        &host_sum),
                  RuntimeError);
}
