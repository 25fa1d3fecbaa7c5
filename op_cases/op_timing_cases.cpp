// Timing mode of the op case registry (op_cases.h): every op GPT-2's training step runs, at the
// model's shapes, in the order of bench_kernels' table. The ops the tests check come from their
// builders (each family's file); beside them, timing-only entries: each fused op's unfused sequence
// (so that the fusion's saving reads off the table) and attention (checked by
// flash_attention_test.cpp and flash_attention_bf16_test.cpp over their own grids), ours beside cuDNN's.
#include <string>
#include <vector>

#include "op_cases.h"
#include "ops/ops.h"

namespace llmtrain::op_cases {
namespace {

/// The rows of `c` are its steps named `name` + `suffix`.
void suffix_steps(OpCase& c, const std::string& suffix) {
  for (Step& s : c.steps) s.name += suffix;
}

// residual = a + b, then its LayerNorm, as two ops: beside layernorm_residual_forward.
OpCase residual_layernorm_unfused(std::int64_t N, std::int64_t C) {
  OpCase c{"residual+layernorm (unfused)", shape_name({{"N", N}, {"C", C}})};
  c.args = layernorm_residual_case(N, C).args;  // the fused op's tensors, for the same rows
  Step step{"residual+layernorm (unfused)", [](const Args& a) {
              ops::residual_forward(a["residual"], a["a"], a["b"]);
              ops::layernorm_forward(a["out"], a["mean"], a["rstd"], a["residual"], a["weight"], a["bias"]);
              return 0.0;
            }};
  step.act_elements = 5 * double(N) * double(C);  // the residual written and read back
  c.steps = {step};
  c.use = Use::timing_only;
  return c;
}

// GPT-2's MLP as separate ops: c_fc then its GELU; c_proj's backward then the GELU's. Beside
// matmul_gelu_case's fused epilogues.
OpCase mlp_unfused(std::int64_t N, std::int64_t C, std::int64_t F) {
  OpCase c{"mlp (unfused)", shape_name({{"N", N}, {"C", C}, {"F", F}})};
  c.args = {input("inp", {N, C}),
            input("fc_w", {F, C}, -0.05f, 0.05f),
            input("fc_b", {F}),
            output("pre", {N, F}, act_reduction),
            output("out", {N, F}, act_reduction),
            input("proj_w", {C, F}, -0.05f, 0.05f),
            input("dout", {N, C}, -0.01f, 0.01f),
            output("dout_gelu", {N, F}, act_reduction),
            output("dpre", {N, F}, act_reduction),
            always_f32(accumulated("dproj_w", {C, F}, f32_reduction)),
            always_f32(accumulated("dproj_b", {C}, f32_reduction))};
  const double flops = 2.0 * double(N) * double(C) * double(F);
  Step forward{"fc + gelu (unfused)", [](const Args& a) {
                 ops::matmul_forward(a["pre"], a["inp"], a["fc_w"], a["fc_b"]);
                 ops::gelu_forward(a["out"], a["pre"]);
                 return 0.0;
               }};
  forward.flops = flops;
  Step backward{"fcproj backward + gelu_backward (unfused)", [](const Args& a) {
                  ops::zero(a["dpre"]);
                  ops::matmul_backward(a["dout_gelu"], a["dproj_w"], a["dproj_b"], a["dout"], a["out"], a["proj_w"],
                                       ops::Accumulate::no);
                  ops::gelu_backward(a["dpre"], a["pre"], a["dout_gelu"]);
                  return 0.0;
                }};
  backward.flops = 2 * flops;
  c.steps = {forward, backward};
  c.use = Use::timing_only;
  return c;
}

// Causal self-attention forward and backward with `kernels` (named `kernels_name`); single_pass:
// the backward only (after an untimed forward), with train.deterministic false: the tensor-core
// kernels' single pass (S and dP once, dQ by atomics), the same FLOPs counted, so the rows compare
// by time.
OpCase attention_case(std::int64_t B, std::int64_t T, std::int64_t C, std::int64_t NH, ops::AttentionKernels kernels,
                      const std::string& kernels_name, bool single_pass) {
  const std::int64_t HS = C / NH;
  OpCase c{"attention", shape_name({{"B", B}, {"T", T}, {"NH", NH}, {"HS", HS}})};
  c.args = {input("qkv", {B, T, 3 * C}),
            output("out", {B, T, C}, act_reduction),
            always_f32(output("lse", {B, NH, T}, f32_elementwise)),
            input("dout", {B, T, C}, -0.01f, 0.01f),
            accumulated("dqkv", {B, T, 3 * C}, act_reduction)};
  // Causal: about half of the T x T scores; forward 2 matmuls (QK^T, PV), backward 5.
  const double pair = 2.0 * double(B) * double(NH) * double(T) * double(T + 1) / 2.0 * double(HS);
  const int heads = int(NH);
  Step forward{"attention_forward " + kernels_name, [heads, kernels](const Args& a) {
                 ops::flash_attention_forward(a["out"], a["lse"], a["qkv"], heads, heads, kernels);
                 return 0.0;
               }};
  forward.flops = 2 * pair;
  forward.timed = !single_pass;  // else only the lse its backward needs
  Step backward{"attention_backward " + kernels_name, [heads, kernels, single_pass](const Args& a) {
                  struct Deterministic {  // restored however the call ends
                    explicit Deterministic(bool on) { ops::set_deterministic(on); }
                    ~Deterministic() { ops::set_deterministic(true); }
                  } deterministic(!single_pass);
                  ops::flash_attention_backward(a["dqkv"], a["dout"], a["qkv"], a["out"], a["lse"], heads, heads,
                                                kernels);
                  return 0.0;
                }};
  if (single_pass) backward.name += " single-pass";
  backward.flops = 5 * pair;
  c.steps = {forward, backward};
  c.use = Use::timing_only;
  return c;
}

}  // namespace

std::vector<OpCase> timing_cases(const ModelShape& m) {
  const std::int64_t B = m.B, T = m.T, C = m.C, NH = m.NH, V = m.V, N = B * T, F = 4 * C;
  const std::int64_t Vp = ops::logits_stride(V);  // the model's padded logits rows
  const std::string nc = shape_name({{"N", N}, {"C", C}});
  std::vector<OpCase> cases;

  // ---- embeddings --------------------------------------------------------------------------------
  cases.push_back(encoder_case(B, T, C, V, T, true));
  cases.back().shape = shape_name({{"B", B}, {"T", T}, {"C", C}});

  // ---- LayerNorm, with and without its residual add ------------------------------------------------
  cases.push_back(layernorm_case(N, C));
  cases.back().shape = nc;
  cases.push_back(residual_case(nc, {N, C}));
  cases.back().steps.resize(1);  // the forward only: the backward is two copies of dout
  cases.push_back(residual_layernorm_unfused(N, C));
  cases.push_back(layernorm_residual_case(N, C));
  cases.back().shape = nc;

  // ---- the matmuls of one layer and the head, each its output's first writer (Accumulate::no) ------
  struct Mm {
    const char* name;
    std::int64_t in, out;
    bool bias;
    std::int64_t ld;  // the row stride of out and dout
  };
  // The head as the model runs it (logits rows padded to a multiple of 128) and unpadded, so
  // that a GPU run shows what the padding buys.
  for (const Mm& mm : {Mm{"qkv", C, 3 * C, true, 3 * C}, Mm{"attproj", C, C, true, C}, Mm{"fc", C, F, true, F},
                       Mm{"fcproj", F, C, true, C}, Mm{"lm_head", C, V, false, Vp},
                       Mm{"lm_head (unpadded rows)", C, V, false, V}}) {
    OpCase c = matmul_case(N, mm.in, mm.out, mm.bias, true, mm.ld);
    c.shape = shape_name({{"N", N}, {"C", mm.in}, {"OC", mm.out}, {"ld", mm.ld}});
    c.arg("weight") = range(-0.05f, 0.05f, c.arg("weight"));
    c.arg("dout") = range(-0.01f, 0.01f, c.arg("dout"));
    suffix_steps(c, std::string(" ") + mm.name);
    cases.push_back(c);
  }

  // ---- the MLP's GELU: apart, unfused, and in the matmuls' epilogues --------------------------------
  cases.push_back(gelu_case(shape_name({{"N", N}, {"F", F}}), {N, F}));
  cases.push_back(mlp_unfused(N, C, F));
  {
    OpCase c = matmul_gelu_case(N, C, F, C, true);
    c.shape = shape_name({{"N", N}, {"C", C}, {"F", F}});
    c.arg("fc_w") = range(-0.05f, 0.05f, c.arg("fc_w"));
    c.arg("proj_w") = range(-0.05f, 0.05f, c.arg("proj_w"));
    c.arg("dout") = range(-0.01f, 0.01f, c.arg("dout"));
    cases.push_back(c);
  }

  // ---- attention: ours and cuDNN's ------------------------------------------------------------------
  {
    std::string cudnn_skip;
    if (m.dtype != DType::bf16) {
      cudnn_skip = "cuDNN attention is bf16 only";
    } else if (!ops::cudnn_attention_available(&cudnn_skip) ||
               !ops::cudnn_attention_supported(int(B), int(T), int(C), int(NH), int(NH), &cudnn_skip)) {
      if (cudnn_skip.empty()) cudnn_skip = "cuDNN attention unavailable";
    } else {
      cudnn_skip.clear();
    }
    const auto cudnn = [&] { return attention_case(B, T, C, NH, ops::AttentionKernels::cudnn, "cudnn", false); };
    if (!cudnn_skip.empty()) {
      cases.push_back(cudnn());
      cases.back().skip = cudnn_skip;
    }
    cases.push_back(attention_case(B, T, C, NH, ops::AttentionKernels::flash, "flash", false));
    cases.push_back(attention_case(B, T, C, NH, ops::AttentionKernels::flash, "flash", true));
    const std::int64_t HS = C / NH;
    if (m.dtype != DType::bf16 || (HS != 64 && HS != 128)) {
      cases.back().skip = "the single pass is for the bf16 tensor-core kernels (head size 64 or 128)";
    }
    if (cudnn_skip.empty()) cases.push_back(cudnn());
  }

  // ---- the classifier: softmax, loss and its gradient over the logits, in place ----------------------
  for (const std::int64_t ld : {Vp, V}) {
    OpCase c = fused_classifier_case(N, V, 1.0f / float(N), ld);
    c.shape = shape_name({{"N", N}, {"V", V}, {"ld", ld}});
    c.arg("logits") = range(-4.0f, 4.0f, c.arg("logits"));
    if (ld == V) c.steps.front().name = "fused_classifier (unpadded rows)";
    cases.push_back(c);
  }

  // ---- the optimizer over GPT-2 124M's parameters ------------------------------------------------------
  {
    const std::int64_t P = 12 * (12 * C * C + 13 * C) + (V + T) * C + 2 * C;  // GPT-2 with this C and V
    const std::string params = shape_name({{"params", P}});
    OpCase adamw = adamw_case(P, ops::AdamWParams{6e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 1, 1.0f});
    adamw.shape = params;
    adamw.arg("param") = range(-0.05f, 0.05f, adamw.arg("param"));
    adamw.arg("grad") = range(-1e-3f, 1e-3f, adamw.arg("grad"));
    adamw.arg("m") = range(0.0f, 0.0f, adamw.arg("m"));
    adamw.arg("v") = range(0.0f, 0.0f, adamw.arg("v"));
    cases.push_back(adamw);
    OpCase norm = sum_squares_case(P, -1e-3f, 1e-3f);
    norm.shape = params;
    norm.steps.front().name = "sum_squares (grad norm)";
    cases.push_back(norm);
  }
  return cases;
}

}  // namespace llmtrain::op_cases
