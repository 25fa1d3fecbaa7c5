// Each op: its checks, then its kernels and their arguments, once (src/ops/dispatch.h runs them on
// the right device, in the right precision).
#include "ops/ops.h"

#include <algorithm>
#include <array>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/bf16.h"
#include "llmtrain/kernels/cpu.h"
#include "llmtrain/kernels/vec_math.h"
#include "ops/dispatch.h"
#if LLMTRAIN_HAVE_CUDA
#include "llmtrain/kernels/flash_attention.h"
#include "device/runtime.h"
#endif

namespace llmtrain::ops {

using dispatch::as_int;
using dispatch::Op;

void encoder_forward(const Tensor& out, const Tensor& inp, const Tensor& wte, const Tensor& wpe) {
  const Op op("encoder_forward");
  const auto B = inp.shape[0], T = inp.shape[1], C = wte.shape[1];
  const DType act = op.activation(out);
  op.expect("inp", inp, DType::i32, {-1, -1});
  op.expect("out", out, act, {B, T, C});
  op.expect("wte", wte, act, {-1, C});
  if (wpe.data) {
    op.expect("wpe", wpe, act, {-1, C});
    if (wpe.shape[0] < T) op.fail("T exceeds the position table");
  }
  op.run(LLMTRAIN_KERNELS(encoder_forward), act, [&](auto v) {
    return std::tuple(v.out(out), v.i32(inp), v.in(wte), v.in(wpe), as_int(B), as_int(T), as_int(C));
  });
}

void encoder_backward(const Tensor& dwte, const Tensor& dwpe, const Tensor& dout, const Tensor& inp) {
  const Op op("encoder_backward");
  const auto B = inp.shape[0], T = inp.shape[1], C = dwte.shape[1];
  const DType act = op.activation(dout);
  op.expect("inp", inp, DType::i32, {-1, -1});
  op.expect("dout", dout, act, {B, T, C});
  op.expect("dwte", dwte, DType::f32, {-1, C});
  if (dwpe.data) {
    op.expect("dwpe", dwpe, DType::f32, {-1, C});
    if (dwpe.shape[0] < T) op.fail("T exceeds the position table");
  }
  op.run(LLMTRAIN_KERNELS(encoder_backward), act, [&](auto v) {
    return std::tuple(v.f32(dwte), v.f32(dwpe), v.in(dout), v.i32(inp), as_int(B), as_int(T), as_int(C));
  });
}

namespace {
using Named = std::pair<const char*, const Tensor*>;
struct Rows {
  std::int64_t N;
  int C;
  DType act;
};
// The norms' checks (LayerNorm, RMSNorm): inp (N,C) sets the precision; the other activations
// (N,C) and the per-channel weights (C) are in it; the weight gradients (C) and the statistics
// (N) are f32.
Rows norm_checks(const Op& op, const Tensor& inp, std::initializer_list<Named> activations,
                 std::initializer_list<Named> weights, std::initializer_list<Named> weight_grads,
                 std::initializer_list<Named> statistics) {
  const auto N = inp.shape[0], C = inp.shape[1];
  const DType act = op.activation(inp);
  op.expect("inp", inp, act, {N, C});
  for (const auto& [name, t] : activations) op.expect(name, *t, act, {N, C});
  for (const auto& [name, t] : weights) op.expect(name, *t, act, {C});
  for (const auto& [name, t] : weight_grads) op.expect(name, *t, DType::f32, {C});
  for (const auto& [name, t] : statistics) op.expect(name, *t, DType::f32, {N});
  return {N, as_int(C), act};
}
}  // namespace

void layernorm_forward(const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& inp,
                       const Tensor& weight, const Tensor& bias) {
  const Op op("layernorm_forward");
  const auto [N, C, act] =
      norm_checks(op, inp, {{"out", &out}}, {{"weight", &weight}, {"bias", &bias}}, {}, {{"mean", &mean}, {"rstd", &rstd}});
  op.run(LLMTRAIN_KERNELS(layernorm_forward), act, [&](auto v) {
    return std::tuple(v.out(out), v.f32(mean), v.f32(rstd), v.in(inp), v.in(weight), v.in(bias), N, C);
  });
}

void layernorm_residual_forward(const Tensor& residual, const Tensor& out, const Tensor& mean, const Tensor& rstd,
                                const Tensor& a, const Tensor& b, const Tensor& weight, const Tensor& bias) {
  const Op op("layernorm_residual_forward");
  const auto [N, C, act] = norm_checks(op, a, {{"b", &b}, {"residual", &residual}, {"out", &out}},
                                       {{"weight", &weight}, {"bias", &bias}}, {}, {{"mean", &mean}, {"rstd", &rstd}});
  if (act == DType::bf16 && !op.on_cuda({&residual, &out, &mean, &rstd, &a, &b, &weight, &bias})) {
    // The CPU's bf16 path widens inputs and rounds outputs once: normalise the rounded residual, as
    // the kernel does.
    residual_forward(residual, a, b);
    layernorm_forward(out, mean, rstd, residual, weight, bias);
    return;
  }
  op.run(LLMTRAIN_KERNELS(layernorm_residual_forward), act, [&](auto v) {
    return std::tuple(v.out(residual), v.out(out), v.f32(mean), v.f32(rstd), v.in(a), v.in(b), v.in(weight),
                      v.in(bias), N, C);
  });
}

void layernorm_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dbias, const Tensor& dout,
                        const Tensor& inp, const Tensor& weight, const Tensor& mean, const Tensor& rstd) {
  const Op op("layernorm_backward");
  const auto [N, C, act] = norm_checks(op, inp, {{"dinp", &dinp}, {"dout", &dout}}, {{"weight", &weight}},
                                       {{"dweight", &dweight}, {"dbias", &dbias}}, {{"mean", &mean}, {"rstd", &rstd}});
  op.run(LLMTRAIN_KERNELS(layernorm_backward), act, [&](auto v) {
    return std::tuple(v.out(dinp), v.f32(dweight), v.f32(dbias), v.in(dout), v.in(inp), v.in(weight), v.f32(mean),
                      v.f32(rstd), N, C);
  });
}

namespace {
// The row stride of a matmul's out or dout (N,ld): at least OC (the padded logits are wider).
std::int64_t row_stride(const Op& op, const char* name, const Tensor& t, DType act, std::int64_t N, std::int64_t OC) {
  op.expect(name, t, act, {N, -1});
  if (t.shape[1] < OC) op.fail(std::string(name) + " has fewer columns than the weight has rows");
  return t.shape[1];
}
}  // namespace

void matmul_forward(const Tensor& out, const Tensor& inp, const Tensor& weight, const Tensor& bias) {
  const Op op("matmul_forward");
  const auto N = inp.shape[0], C = inp.shape[1], OC = weight.shape[0];
  const DType act = op.activation(inp);
  op.expect("inp", inp, act, {N, C});
  op.expect("weight", weight, act, {OC, C});
  const std::int64_t ld = row_stride(op, "out", out, act, N, OC);
  if (bias.data) op.expect("bias", bias, act, {OC});
  op.run(LLMTRAIN_MATMUL_KERNELS(matmul_forward), act, [&](auto v) {
    return std::tuple(v.out(out), v.in(inp), v.in(weight), v.in(bias), N, as_int(C), as_int(OC), ld);
  });
}

void matmul_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dbias, const Tensor& dout,
                     const Tensor& inp, const Tensor& weight, Accumulate dinp_mode) {
  const Op op("matmul_backward");
  const auto N = inp.shape[0], C = inp.shape[1], OC = weight.shape[0];
  const DType act = op.activation(inp);
  op.expect("inp", inp, act, {N, C});
  if (!dinp.data && !dweight.data) op.fail("neither dinp nor dweight to compute");
  if (dinp.data) op.expect("dinp", dinp, act, {N, C});
  op.expect("weight", weight, act, {OC, C});
  if (dweight.data) op.expect("dweight", dweight, DType::f32, {OC, C});
  const std::int64_t ld = row_stride(op, "dout", dout, act, N, OC);
  if (dbias.data && !dweight.data) op.fail("dbias without dweight");
  if (dbias.data) op.expect("dbias", dbias, DType::f32, {OC});
  op.run(LLMTRAIN_MATMUL_KERNELS(matmul_backward), act, [&](auto v) {
    return std::tuple(v.out(dinp), v.f32(dweight), v.f32(dbias), v.in(dout), v.in(inp), v.in(weight), N,
                      as_int(C), as_int(OC), ld, dinp_mode == Accumulate::yes);
  });
}

void matmul_gelu_forward(const Tensor& out, const Tensor& pre, const Tensor& inp, const Tensor& weight,
                         const Tensor& bias) {
  const Op op("matmul_gelu_forward");
  const auto N = inp.shape[0], C = inp.shape[1], OC = weight.shape[0];
  const DType act = op.activation(inp);
  op.expect("inp", inp, act, {N, C});
  op.expect("weight", weight, act, {OC, C});
  op.expect("out", out, act, {N, OC});
  op.expect("pre", pre, act, {N, OC});
  if (bias.data) op.expect("bias", bias, act, {OC});
  op.run(LLMTRAIN_MATMUL_KERNELS(matmul_gelu_forward), act, [&](auto v) {
    return std::tuple(v.out(out), v.out(pre), v.in(inp), v.in(weight), v.in(bias), N, as_int(C), as_int(OC));
  });
}

void matmul_backward_dgelu(const Tensor& dpre, const Tensor& dweight, const Tensor& dbias, const Tensor& dpre_bias,
                           const Tensor& dout, const Tensor& inp, const Tensor& pre, const Tensor& weight) {
  const Op op("matmul_backward_dgelu");
  const auto N = inp.shape[0], C = inp.shape[1], OC = weight.shape[0];
  const DType act = op.activation(inp);
  op.expect("inp", inp, act, {N, C});
  op.expect("pre", pre, act, {N, C});
  op.expect("dpre", dpre, act, {N, C});
  op.expect("weight", weight, act, {OC, C});
  if (dweight.data) op.expect("dweight", dweight, DType::f32, {OC, C});
  op.expect("dout", dout, act, {N, OC});
  if (dbias.data && !dweight.data) op.fail("dbias without dweight");
  if (dbias.data) op.expect("dbias", dbias, DType::f32, {OC});
  if (dpre_bias.data) op.expect("dpre_bias", dpre_bias, DType::f32, {C});
  op.run(LLMTRAIN_MATMUL_KERNELS(matmul_backward_dgelu), act, [&](auto v) {
    return std::tuple(v.out(dpre), v.f32(dweight), v.f32(dbias), v.f32(dpre_bias), v.in(dout), v.in(inp), v.in(pre),
                      v.in(weight), N, as_int(C), as_int(OC));
  });
}


#define LLMTRAIN_ELEMENTWISE(name, outputs, inputs)                                                             \
  void name(LLMTRAIN_EW_LIST(LLMTRAIN_EW_TENSOR, outputs), LLMTRAIN_EW_LIST(LLMTRAIN_EW_TENSOR, inputs)) {      \
    const Op op(#name);                                                                                         \
    const auto tensors = {LLMTRAIN_EW_LIST(LLMTRAIN_EW_ADDRESS, outputs),                                       \
                          LLMTRAIN_EW_LIST(LLMTRAIN_EW_ADDRESS, inputs)};                                       \
    const DType act = op.expect_same_size(tensors);                                                             \
    const std::int64_t N = (*tensors.begin())->numel();                                                         \
    op.run(LLMTRAIN_KERNELS(name), act, [&](auto v) {                                                           \
      return std::tuple(LLMTRAIN_EW_LIST(LLMTRAIN_EW_VIEW_OUT, outputs), LLMTRAIN_EW_LIST(LLMTRAIN_EW_VIEW_IN, inputs), \
                        N);                                                                                     \
    });                                                                                                         \
  }
#include "llmtrain/kernels/elementwise.def"
#undef LLMTRAIN_ELEMENTWISE

void rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& inp, const Tensor& weight, float eps) {
  const Op op("rmsnorm_forward");
  const auto [N, C, act] = norm_checks(op, inp, {{"out", &out}}, {{"weight", &weight}}, {}, {{"rstd", &rstd}});
  op.run(LLMTRAIN_KERNELS(rmsnorm_forward), act, [&](auto v) {
    return std::tuple(v.out(out), v.f32(rstd), v.in(inp), v.in(weight), N, C, eps);
  });
}

void rmsnorm_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dout, const Tensor& inp,
                      const Tensor& weight, const Tensor& rstd) {
  const Op op("rmsnorm_backward");
  const auto [N, C, act] = norm_checks(op, inp, {{"dinp", &dinp}, {"dout", &dout}}, {{"weight", &weight}},
                                       {{"dweight", &dweight}}, {{"rstd", &rstd}});
  op.run(LLMTRAIN_KERNELS(rmsnorm_backward), act, [&](auto v) {
    return std::tuple(v.out(dinp), v.f32(dweight), v.in(dout), v.in(inp), v.in(weight), v.f32(rstd), N, C);
  });
}

namespace {
// qk_norm's checks: inp (N, (NH + 2 NKV) HS), its partners of that shape, the weights (HS) in the
// activation dtype, the weight gradients (HS) and rstd (N, NH + NKV) f32. Returns {N, HS, act}.
Rows qk_norm_checks(const Op& op, const Tensor& inp, std::initializer_list<Named> activations,
                    std::initializer_list<Named> weights, std::initializer_list<Named> weight_grads,
                    const Tensor& rstd, int NH, int NKV) {
  if (NH < 1 || NKV < 1) op.fail("needs at least one query and one key head");
  const DType act = op.activation(inp);
  op.expect("inp", inp, act, {-1, -1});
  const std::int64_t N = inp.shape[0], W = inp.shape[1], H = NH + 2 * std::int64_t(NKV);
  if (W % H != 0) op.fail("inp's width must be (NH + 2 NKV) x head size");
  const std::int64_t HS = W / H;
  for (const auto& [name, t] : activations) op.expect(name, *t, act, {N, W});
  for (const auto& [name, t] : weights) op.expect(name, *t, act, {HS});
  for (const auto& [name, t] : weight_grads) op.expect(name, *t, DType::f32, {HS});
  op.expect("rstd", rstd, DType::f32, {N, NH + NKV});
  return {N, as_int(HS), act};
}
}  // namespace

void qk_norm_forward(const Tensor& out, const Tensor& rstd, const Tensor& inp, const Tensor& q_weight,
                     const Tensor& k_weight, int NH, int NKV, float eps) {
  const Op op("qk_norm_forward");
  const auto [N, HS, act] =
      qk_norm_checks(op, inp, {{"out", &out}}, {{"q_weight", &q_weight}, {"k_weight", &k_weight}}, {}, rstd, NH, NKV);
  op.run(LLMTRAIN_KERNELS(qk_norm_forward), act, [&](auto v) {
    return std::tuple(v.out(out), v.f32(rstd), v.in(inp), v.in(q_weight), v.in(k_weight), N, NH, NKV, HS, eps);
  });
}

void qk_norm_backward(const Tensor& dinp, const Tensor& dq_weight, const Tensor& dk_weight, const Tensor& dout,
                      const Tensor& inp, const Tensor& q_weight, const Tensor& k_weight, const Tensor& rstd, int NH,
                      int NKV) {
  const Op op("qk_norm_backward");
  const auto [N, HS, act] =
      qk_norm_checks(op, inp, {{"dinp", &dinp}, {"dout", &dout}}, {{"q_weight", &q_weight}, {"k_weight", &k_weight}},
                     {{"dq_weight", &dq_weight}, {"dk_weight", &dk_weight}}, rstd, NH, NKV);
  op.run(LLMTRAIN_KERNELS(qk_norm_backward), act, [&](auto v) {
    return std::tuple(v.out(dinp), v.f32(dq_weight), v.f32(dk_weight), v.in(dout), v.in(inp), v.in(q_weight),
                      v.in(k_weight), v.f32(rstd), N, NH, NKV, HS);
  });
}

namespace {
// RoPE's shared checks: x (B,T,H,HS) and its partner of one shape, HS even; `rotated_heads` out of
// [0, H] means all. Returns {B, T, H, HS}.
std::array<int, 4> rope_shape(const Op& op, DType act, const char* name, const Tensor& x, const char* partner_name,
                              const Tensor& partner, int& rotated_heads) {
  const auto B = x.shape[0], T = x.shape[1], H = x.shape[2], HS = x.shape[3];
  op.expect(name, x, act, {B, T, H, HS});
  op.expect(partner_name, partner, act, {B, T, H, HS});
  if (HS % 2 != 0) op.fail("the head size must be even");
  if (rotated_heads < 0 || rotated_heads > H) rotated_heads = as_int(H);
  return {as_int(B), as_int(T), as_int(H), as_int(HS)};
}
}  // namespace

void rope_forward(const Tensor& out, const Tensor& inp, float theta, int rotated_heads, int pos0) {
  const Op op("rope_forward");
  const DType act = op.activation(inp);
  const auto [B, T, H, HS] = rope_shape(op, act, "inp", inp, "out", out, rotated_heads);
  op.run(LLMTRAIN_KERNELS(rope_forward), act, [&](auto v) {
    return std::tuple(v.out(out), v.in(inp), B, T, H, HS, rotated_heads, pos0, theta);
  });
}

void rope_backward(const Tensor& dinp, const Tensor& dout, float theta, int rotated_heads, int pos0) {
  const Op op("rope_backward");
  const DType act = op.activation(dout);
  const auto [B, T, H, HS] = rope_shape(op, act, "dout", dout, "dinp", dinp, rotated_heads);
  op.run(LLMTRAIN_KERNELS(rope_backward), act, [&](auto v) {
    return std::tuple(v.out(dinp), v.in(dout), B, T, H, HS, rotated_heads, pos0, theta);
  });
}

DeviceSum::DeviceSum(Device device) : buffer_(device, sizeof(double)) { zero(buffer_.view(DType::u16, {4})); }

double DeviceSum::take() {
  double value = 0.0;
  copy(Tensor(&value, DType::u16, Device::cpu, {4}), buffer_.view(DType::u16, {4}));
  zero(buffer_.view(DType::u16, {4}));
  return value;
}

namespace {
/// The sum's memory, checked to be on the summed tensor's device (null without one).
double* sum_on(const Op& op, DeviceSum* sum, const Tensor& summed) {
  if (!sum) return nullptr;
  if (sum->device() != summed.device) op.fail("the sum is on another device than the tensor summed");
  return sum->data();
}
}  // namespace

namespace {
// The classifier ops' checks: logits (N,ld) set N and the precision, and hold `columns` (-1: all
// ld) of the vocabulary per row; the per-row statistics (N) are f32 and the targets (N) i32.
struct LogitRows {
  std::int64_t N;
  int V;
  std::int64_t ld;
  DType act;
};
LogitRows logits_checks(const Op& op, const Tensor& logits, std::int64_t columns,
                        std::initializer_list<Named> statistics, const Tensor* targets = nullptr,
                        std::int64_t vocab_begin = 0) {
  const auto N = logits.shape[0], ld = logits.shape[1];
  const DType act = op.activation(logits);
  op.expect("logits", logits, act, {N, ld});
  if (columns < 0) columns = ld;
  if (columns > ld) op.fail(std::to_string(columns) + " vocabulary columns in rows of " + std::to_string(ld));
  for (const auto& [name, t] : statistics) op.expect(name, *t, DType::f32, {N});
  if (targets) op.expect("targets", *targets, DType::i32, {N});
  if (vocab_begin < 0) op.fail("vocab_begin " + std::to_string(vocab_begin) + " is negative");
  return {N, as_int(columns), ld, act};
}
}  // namespace

double fused_classifier(const Tensor& logits, const Tensor& losses, const Tensor& targets, float dlogits_scale,
                        DeviceSum* loss_sum, std::int64_t columns) {
  const Op op("fused_classifier");
  const auto [N, V, ld, act] = logits_checks(op, logits, columns, {{"losses", &losses}}, &targets);
  double* const sum = sum_on(op, loss_sum, losses);
  // The logits are overwritten by their gradient only when dlogits_scale > 0.
  return op.run(LLMTRAIN_KERNELS(fused_classifier), act, [&](auto v) {
    return std::tuple(dlogits_scale > 0 ? v.out(logits) : v.in(logits), v.f32(losses), v.i32(targets), N, V, ld,
                      dlogits_scale, sum);
  });
}

void classifier_row_max(const Tensor& row_max, const Tensor& logits, std::int64_t columns) {
  const Op op("classifier_row_max");
  const auto [N, V, ld, act] = logits_checks(op, logits, columns, {{"row_max", &row_max}});
  op.run(LLMTRAIN_KERNELS(classifier_row_max), act,
         [&](auto v) { return std::tuple(v.f32(row_max), v.in(logits), N, V, ld); });
}

void classifier_row_stats(const Tensor& sum_exp, const Tensor& target_logit, const Tensor& logits,
                          const Tensor& row_max, const Tensor& targets, std::int64_t vocab_begin,
                          std::int64_t columns) {
  const Op op("classifier_row_stats");
  const auto [N, V, ld, act] = logits_checks(
      op, logits, columns, {{"sum_exp", &sum_exp}, {"target_logit", &target_logit}, {"row_max", &row_max}},
      &targets, vocab_begin);
  op.run(LLMTRAIN_KERNELS(classifier_row_stats), act, [&](auto v) {
    return std::tuple(v.f32(sum_exp), v.f32(target_logit), v.in(logits), v.f32(row_max), v.i32(targets), N, V, ld,
                      vocab_begin);
  });
}

double classifier_parallel_finish(const Tensor& logits, const Tensor& losses, const Tensor& row_max,
                                  const Tensor& sum_exp, const Tensor& target_logit, const Tensor& targets,
                                  std::int64_t vocab_begin, float dlogits_scale, DeviceSum* loss_sum,
                                  std::int64_t columns) {
  const Op op("classifier_parallel_finish");
  const auto [N, V, ld, act] = logits_checks(
      op, logits, columns,
      {{"losses", &losses}, {"row_max", &row_max}, {"sum_exp", &sum_exp}, {"target_logit", &target_logit}},
      &targets, vocab_begin);
  double* const sum = sum_on(op, loss_sum, losses);
  // The logits are overwritten by their gradient only when dlogits_scale > 0.
  return op.run(LLMTRAIN_KERNELS(classifier_parallel_finish), act, [&](auto v) {
    return std::tuple(dlogits_scale > 0 ? v.out(logits) : v.in(logits), v.f32(losses), v.f32(row_max),
                      v.f32(sum_exp), v.f32(target_logit), v.i32(targets), N, V, ld, vocab_begin, dlogits_scale,
                      sum);
  });
}

double sum_squares(const Tensor& x, DeviceSum* into) {
  const Op op("sum_squares");
  const DType act = op.expect_same_size({&x}, /*f32_only=*/true);
  double* const sum = sum_on(op, into, x);
  return op.run(LLMTRAIN_KERNELS(sum_squares), act,
                [&](auto v) { return std::tuple(v.f32(x), x.numel(), sum); });
}

void adamw_update(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const AdamWParams& p) {
  const Op op("adamw_update");
  const DType act = op.expect_same_size({&param, &grad, &m, &v}, /*f32_only=*/true);
  op.run(LLMTRAIN_KERNELS(adamw_update), act, [&](auto view) {
    return std::tuple(view.f32(param), view.f32(grad), view.f32(m), view.f32(v), param.numel(), p.lr, p.beta1,
                      p.beta2, p.eps, p.weight_decay, p.step, p.grad_scale);
  });
}

AdamWPlan::AdamWPlan(const std::vector<AdamWRun>& runs, Device device) : device_(device) {
  for (AdamWRun run : runs) {
    if (run.state == -1) run.state = run.offset;
    if (run.offset < 0 || run.length < 0 || run.state < 0) {
      throw RuntimeError("AdamWPlan: a run with a negative offset, length or state offset");
    }
    if (run.length == 0) continue;
    runs_.push_back(run);
    extent_ = std::max(extent_, run.offset + run.length);
    state_extent_ = std::max(state_extent_, run.state + run.length);
  }
  if (device_ != Device::cuda) return;
#if LLMTRAIN_HAVE_CUDA
  std::vector<cuda::AdamWChunk> table;
  for (const AdamWRun& run : runs_) {
    for (std::int64_t at = 0; at < run.length; at += cuda::adamw_chunk_elements) {
      const auto length = std::int32_t(std::min<std::int64_t>(cuda::adamw_chunk_elements, run.length - at));
      table.push_back({run.offset + at, run.state + at, length, run.decay ? 1 : 0});
    }
  }
  chunks_ = std::int64_t(table.size());
  if (chunks_ == 0) return;
  const std::size_t bytes = table.size() * sizeof(cuda::AdamWChunk);
  table_ = Buffer(device_, bytes);
  // As raw bytes (u16 pairs): Tensor has no dtype for the struct.
  copy(table_.view(DType::u16, {std::int64_t(bytes / 2)}),
       Tensor(table.data(), DType::u16, Device::cpu, {std::int64_t(bytes / 2)}));
#else
  throw RuntimeError("AdamWPlan: this build has no CUDA backend");
#endif
}

void adamw_update_runs(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                       const Tensor& working, const AdamWPlan& plan, const AdamWParams& p) {
  const Op op("adamw_update_runs");
  op.expect_same_size({&param, &grad}, /*f32_only=*/true);
  op.expect_same_size({&m, &v}, /*f32_only=*/true);
  const std::int64_t N = param.numel(), M = m.numel();
  if (plan.extent() > N || plan.state_extent() > M) {
    op.fail("the plan's runs reach element " + std::to_string(plan.extent()) + " of the weights and " +
            std::to_string(plan.state_extent()) + " of the moments, the arrays hold " + std::to_string(N) + " and " +
            std::to_string(M));
  }
  if (working.data && (working.dtype != DType::bf16 || working.numel() != N)) {
    op.fail("expected a bf16 working copy of " + std::to_string(N) + " elements, got " + working.describe());
  }
  const bool on_gpu = working.data ? op.on_cuda({&param, &grad, &m, &v, &working}) : op.on_cuda({&param, &grad, &m, &v});
  if (on_gpu != (plan.device() == Device::cuda)) op.fail("the plan was laid out for another device than the arrays'");
  if (on_gpu) {
#if LLMTRAIN_HAVE_CUDA
    return op.guarded([&] {
      cuda::adamw_update_chunks(param.as<float>(), grad.as<float>(), m.as<float>(), v.as<float>(),
                                working.data ? working.as<cuda::bf16>() : nullptr,
                                static_cast<const cuda::AdamWChunk*>(plan.chunk_table()), plan.chunks(), p.lr,
                                p.beta1, p.beta2, p.eps, p.weight_decay, p.step, p.grad_scale,
                                device::compute_stream());
    });
#endif
  }
  // The CPU reference: adamw_update on each run, then the rounding convert does.
  for (const AdamWRun& run : plan.runs()) {
    const std::int64_t at = run.offset;
    cpu::adamw_update(param.as<float>() + at, grad.as<float>() + at, m.as<float>() + run.state,
                      v.as<float>() + run.state, run.length, p.lr, p.beta1, p.beta2, p.eps,
                      run.decay ? p.weight_decay : 0.0f, p.step, p.grad_scale);
    if (!working.data) continue;
    const float* x = param.as<float>() + at;
    std::uint16_t* bits = working.as<std::uint16_t>() + at;
    for (std::int64_t i = 0; i < run.length; ++i) bits[i] = float_to_bf16_bits(x[i]);
  }
}

void convert(const Tensor& out, const Tensor& in) {
  const Op op("convert");
  const bool narrowing = out.dtype == DType::bf16 && in.dtype == DType::f32;
  const bool widening = out.dtype == DType::f32 && in.dtype == DType::bf16;
  if (!(narrowing || widening) || !out.data || !in.data || out.numel() != in.numel()) {
    op.fail("expected f32 -> bf16 or bf16 -> f32 of one size, got " + in.describe() + " -> " + out.describe());
  }
  const std::int64_t N = in.numel();
  if (op.on_cuda({&out, &in})) {
#if LLMTRAIN_HAVE_CUDA
    return op.guarded([&] {
      if (narrowing) return cuda::convert(out.as<cuda::bf16>(), in.as<float>(), N, device::compute_stream());
      return cuda::convert(out.as<float>(), in.as<cuda::bf16>(), N, device::compute_stream());
    });
#endif
  }
  if (narrowing) {
    auto* bits = out.as<std::uint16_t>();
    const float* x = in.as<float>();
#pragma omp parallel for simd if (cpu::worth_threads(N))
    for (std::int64_t i = 0; i < N; ++i) bits[i] = float_to_bf16_bits(x[i]);
    return;
  }
  float* x = out.as<float>();
  const auto* bits = in.as<std::uint16_t>();
#pragma omp parallel for simd if (cpu::worth_threads(N))
  for (std::int64_t i = 0; i < N; ++i) x[i] = bf16_bits_to_float(bits[i]);
}

}  // namespace llmtrain::ops
