#include "ops/nn.h"

#include <string>
#include <vector>

#include "core/error.h"
#include "ops/cpu/nn.h"
#include "ops/profile.h"

namespace llmtrain::ops {
namespace {

// Checks one argument: dtype and shape (a -1 in `shape` matches any size).
void expect(const char* op, const char* name, const Tensor& t, DType dtype, std::vector<std::int64_t> shape) {
  bool ok = t.data != nullptr && t.dtype == dtype && t.ndim == int(shape.size());
  for (int i = 0; ok && i < t.ndim; ++i) ok = shape[i] < 0 || t.shape[i] == shape[i];
  if (ok) return;
  std::string want = std::string(dtype_name(dtype)) + "[";
  for (std::size_t i = 0; i < shape.size(); ++i) want += (i ? ", " : "") + (shape[i] < 0 ? "*" : std::to_string(shape[i]));
  throw RuntimeError(std::string("ops::") + op + ": " + name + " is " + (t.data ? t.describe() : "null") +
                     ", expected " + want + "]");
}

// All arguments on one device; only the CPU backend has these ops so far.
void on_cpu(const char* op, std::initializer_list<const Tensor*> tensors) {
  for (const Tensor* t : tensors) {
    if (t->data && t->device != Device::cpu) {
      throw RuntimeError(std::string("ops::") + op + ": no CUDA kernel yet; run with --device cpu");
    }
  }
}

int as_int(std::int64_t x) { return static_cast<int>(x); }

}  // namespace

void encoder_forward(const Tensor& out, const Tensor& inp, const Tensor& wte, const Tensor& wpe) {
  const OpTimer timer("encoder_forward");
  const auto B = inp.shape[0], T = inp.shape[1], C = wte.shape[1];
  expect("encoder_forward", "inp", inp, DType::i32, {-1, -1});
  expect("encoder_forward", "out", out, DType::f32, {B, T, C});
  expect("encoder_forward", "wte", wte, DType::f32, {-1, C});
  expect("encoder_forward", "wpe", wpe, DType::f32, {-1, C});
  if (wpe.shape[0] < T) throw RuntimeError("ops::encoder_forward: T exceeds the position table");
  on_cpu("encoder_forward", {&out, &inp, &wte, &wpe});
  cpu::encoder_forward(out.as<float>(), inp.as<std::int32_t>(), wte.as<float>(), wpe.as<float>(), as_int(B),
                       as_int(T), as_int(C));
}

void encoder_backward(const Tensor& dwte, const Tensor& dwpe, const Tensor& dout, const Tensor& inp) {
  const OpTimer timer("encoder_backward");
  const auto B = inp.shape[0], T = inp.shape[1], C = dwte.shape[1];
  expect("encoder_backward", "inp", inp, DType::i32, {-1, -1});
  expect("encoder_backward", "dout", dout, DType::f32, {B, T, C});
  expect("encoder_backward", "dwte", dwte, DType::f32, {-1, C});
  expect("encoder_backward", "dwpe", dwpe, DType::f32, {-1, C});
  on_cpu("encoder_backward", {&dwte, &dwpe, &dout, &inp});
  cpu::encoder_backward(dwte.as<float>(), dwpe.as<float>(), dout.as<float>(), inp.as<std::int32_t>(), as_int(B),
                        as_int(T), as_int(C));
}

void layernorm_forward(const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& inp,
                       const Tensor& weight, const Tensor& bias) {
  const OpTimer timer("layernorm_forward");
  const auto N = inp.shape[0], C = inp.shape[1];
  expect("layernorm_forward", "inp", inp, DType::f32, {N, C});
  expect("layernorm_forward", "out", out, DType::f32, {N, C});
  expect("layernorm_forward", "mean", mean, DType::f32, {N});
  expect("layernorm_forward", "rstd", rstd, DType::f32, {N});
  expect("layernorm_forward", "weight", weight, DType::f32, {C});
  expect("layernorm_forward", "bias", bias, DType::f32, {C});
  on_cpu("layernorm_forward", {&out, &mean, &rstd, &inp, &weight, &bias});
  cpu::layernorm_forward(out.as<float>(), mean.as<float>(), rstd.as<float>(), inp.as<float>(), weight.as<float>(),
                         bias.as<float>(), N, as_int(C));
}

void layernorm_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dbias, const Tensor& dout,
                        const Tensor& inp, const Tensor& weight, const Tensor& mean, const Tensor& rstd) {
  const OpTimer timer("layernorm_backward");
  const auto N = inp.shape[0], C = inp.shape[1];
  expect("layernorm_backward", "inp", inp, DType::f32, {N, C});
  expect("layernorm_backward", "dinp", dinp, DType::f32, {N, C});
  expect("layernorm_backward", "dout", dout, DType::f32, {N, C});
  expect("layernorm_backward", "dweight", dweight, DType::f32, {C});
  expect("layernorm_backward", "dbias", dbias, DType::f32, {C});
  expect("layernorm_backward", "weight", weight, DType::f32, {C});
  expect("layernorm_backward", "mean", mean, DType::f32, {N});
  expect("layernorm_backward", "rstd", rstd, DType::f32, {N});
  on_cpu("layernorm_backward", {&dinp, &dweight, &dbias, &dout, &inp, &weight, &mean, &rstd});
  cpu::layernorm_backward(dinp.as<float>(), dweight.as<float>(), dbias.as<float>(), dout.as<float>(),
                          inp.as<float>(), weight.as<float>(), mean.as<float>(), rstd.as<float>(), N, as_int(C));
}

void matmul_forward(const Tensor& out, const Tensor& inp, const Tensor& weight, const Tensor& bias) {
  const OpTimer timer("matmul_forward");
  const auto N = inp.shape[0], C = inp.shape[1], OC = weight.shape[0];
  expect("matmul_forward", "inp", inp, DType::f32, {N, C});
  expect("matmul_forward", "weight", weight, DType::f32, {OC, C});
  expect("matmul_forward", "out", out, DType::f32, {N, OC});
  if (bias.data) expect("matmul_forward", "bias", bias, DType::f32, {OC});
  on_cpu("matmul_forward", {&out, &inp, &weight, &bias});
  cpu::matmul_forward(out.as<float>(), inp.as<float>(), weight.as<float>(), bias.as<float>(), N, as_int(C),
                      as_int(OC));
}

void matmul_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dbias, const Tensor& dout,
                     const Tensor& inp, const Tensor& weight) {
  const OpTimer timer("matmul_backward");
  const auto N = inp.shape[0], C = inp.shape[1], OC = weight.shape[0];
  expect("matmul_backward", "inp", inp, DType::f32, {N, C});
  expect("matmul_backward", "dinp", dinp, DType::f32, {N, C});
  expect("matmul_backward", "weight", weight, DType::f32, {OC, C});
  expect("matmul_backward", "dweight", dweight, DType::f32, {OC, C});
  expect("matmul_backward", "dout", dout, DType::f32, {N, OC});
  if (dbias.data) expect("matmul_backward", "dbias", dbias, DType::f32, {OC});
  on_cpu("matmul_backward", {&dinp, &dweight, &dbias, &dout, &inp, &weight});
  cpu::matmul_backward(dinp.as<float>(), dweight.as<float>(), dbias.as<float>(), dout.as<float>(), inp.as<float>(),
                       weight.as<float>(), N, as_int(C), as_int(OC));
}

void attention_forward(const Tensor& out, const Tensor& att, const Tensor& qkv, int NH, int NKV) {
  const OpTimer timer("attention_forward");
  const auto B = out.shape[0], T = out.shape[1], C = out.shape[2];
  if (NKV == 0) NKV = NH;
  if (NH <= 0 || C % NH != 0 || NKV <= 0 || NH % NKV != 0) {
    throw RuntimeError("ops::attention_forward: NH must divide C and NKV must divide NH");
  }
  const std::int64_t width = (NH + 2 * NKV) * (C / NH);
  expect("attention_forward", "out", out, DType::f32, {B, T, C});
  expect("attention_forward", "qkv", qkv, DType::f32, {B, T, width});
  expect("attention_forward", "att", att, DType::f32, {B, NH, T, T});
  on_cpu("attention_forward", {&out, &att, &qkv});
  cpu::attention_forward(out.as<float>(), att.as<float>(), qkv.as<float>(), as_int(B), as_int(T), as_int(C), NH, NKV);
}

void attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& att, int NH,
                        int NKV) {
  const OpTimer timer("attention_backward");
  const auto B = dout.shape[0], T = dout.shape[1], C = dout.shape[2];
  if (NKV == 0) NKV = NH;
  if (NH <= 0 || C % NH != 0 || NKV <= 0 || NH % NKV != 0) {
    throw RuntimeError("ops::attention_backward: NH must divide C and NKV must divide NH");
  }
  const std::int64_t width = (NH + 2 * NKV) * (C / NH);
  expect("attention_backward", "dout", dout, DType::f32, {B, T, C});
  expect("attention_backward", "qkv", qkv, DType::f32, {B, T, width});
  expect("attention_backward", "dqkv", dqkv, DType::f32, {B, T, width});
  expect("attention_backward", "att", att, DType::f32, {B, NH, T, T});
  on_cpu("attention_backward", {&dqkv, &dout, &qkv, &att});
  cpu::attention_backward(dqkv.as<float>(), dout.as<float>(), qkv.as<float>(), att.as<float>(), as_int(B), as_int(T),
                          as_int(C), NH, NKV);
}

void attention_decode(const Tensor& out, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, int pos,
                      int NH) {
  const OpTimer timer("attention_decode");
  const auto C = q.shape[0], maxT = k_cache.shape[0];
  expect("attention_decode", "q", q, DType::f32, {C});
  expect("attention_decode", "out", out, DType::f32, {C});
  expect("attention_decode", "k_cache", k_cache, DType::f32, {maxT, C});
  expect("attention_decode", "v_cache", v_cache, DType::f32, {maxT, C});
  if (pos < 0 || pos >= maxT || NH <= 0 || C % NH != 0) {
    throw RuntimeError("ops::attention_decode: position " + std::to_string(pos) + " outside the cache, or NH does not divide C");
  }
  on_cpu("attention_decode", {&out, &q, &k_cache, &v_cache});
  cpu::attention_decode(out.as<float>(), q.as<float>(), k_cache.as<float>(), v_cache.as<float>(), pos, as_int(C), NH);
}

namespace {
void expect_same_size(const char* op, std::initializer_list<const Tensor*> tensors) {
  const Tensor& first = **tensors.begin();
  for (const Tensor* t : tensors) {
    if (!t->data || t->dtype != DType::f32 || t->numel() != first.numel()) {
      throw RuntimeError(std::string("ops::") + op + ": expected f32 tensors of " + std::to_string(first.numel()) +
                         " elements, got " + (t->data ? t->describe() : "null"));
    }
  }
  on_cpu(op, tensors);
}
}  // namespace

void gelu_forward(const Tensor& out, const Tensor& inp) {
  const OpTimer timer("gelu_forward");
  expect_same_size("gelu_forward", {&out, &inp});
  cpu::gelu_forward(out.as<float>(), inp.as<float>(), inp.numel());
}

void gelu_backward(const Tensor& dinp, const Tensor& inp, const Tensor& dout) {
  const OpTimer timer("gelu_backward");
  expect_same_size("gelu_backward", {&dinp, &inp, &dout});
  cpu::gelu_backward(dinp.as<float>(), inp.as<float>(), dout.as<float>(), inp.numel());
}

void residual_forward(const Tensor& out, const Tensor& a, const Tensor& b) {
  const OpTimer timer("residual_forward");
  expect_same_size("residual_forward", {&out, &a, &b});
  cpu::residual_forward(out.as<float>(), a.as<float>(), b.as<float>(), out.numel());
}

void residual_backward(const Tensor& da, const Tensor& db, const Tensor& dout) {
  const OpTimer timer("residual_backward");
  expect_same_size("residual_backward", {&da, &db, &dout});
  cpu::residual_backward(da.as<float>(), db.as<float>(), dout.as<float>(), dout.numel());
}

void rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& inp, const Tensor& weight, float eps) {
  const OpTimer timer("rmsnorm_forward");
  const auto N = inp.shape[0], C = inp.shape[1];
  expect("rmsnorm_forward", "inp", inp, DType::f32, {N, C});
  expect("rmsnorm_forward", "out", out, DType::f32, {N, C});
  expect("rmsnorm_forward", "rstd", rstd, DType::f32, {N});
  expect("rmsnorm_forward", "weight", weight, DType::f32, {C});
  on_cpu("rmsnorm_forward", {&out, &rstd, &inp, &weight});
  cpu::rmsnorm_forward(out.as<float>(), rstd.as<float>(), inp.as<float>(), weight.as<float>(), N, as_int(C), eps);
}

void rmsnorm_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dout, const Tensor& inp,
                      const Tensor& weight, const Tensor& rstd) {
  const OpTimer timer("rmsnorm_backward");
  const auto N = inp.shape[0], C = inp.shape[1];
  expect("rmsnorm_backward", "inp", inp, DType::f32, {N, C});
  expect("rmsnorm_backward", "dinp", dinp, DType::f32, {N, C});
  expect("rmsnorm_backward", "dout", dout, DType::f32, {N, C});
  expect("rmsnorm_backward", "dweight", dweight, DType::f32, {C});
  expect("rmsnorm_backward", "weight", weight, DType::f32, {C});
  expect("rmsnorm_backward", "rstd", rstd, DType::f32, {N});
  on_cpu("rmsnorm_backward", {&dinp, &dweight, &dout, &inp, &weight, &rstd});
  cpu::rmsnorm_backward(dinp.as<float>(), dweight.as<float>(), dout.as<float>(), inp.as<float>(), weight.as<float>(),
                        rstd.as<float>(), N, as_int(C));
}

void rope_forward(const Tensor& out, const Tensor& inp, float theta) {
  const OpTimer timer("rope_forward");
  const auto B = inp.shape[0], T = inp.shape[1], NH = inp.shape[2], HS = inp.shape[3];
  expect("rope_forward", "inp", inp, DType::f32, {B, T, NH, HS});
  expect("rope_forward", "out", out, DType::f32, {B, T, NH, HS});
  if (HS % 2 != 0) throw RuntimeError("ops::rope_forward: the head size must be even");
  on_cpu("rope_forward", {&out, &inp});
  cpu::rope_forward(out.as<float>(), inp.as<float>(), as_int(B), as_int(T), as_int(NH), as_int(HS), theta);
}

void rope_backward(const Tensor& dinp, const Tensor& dout, float theta) {
  const OpTimer timer("rope_backward");
  const auto B = dout.shape[0], T = dout.shape[1], NH = dout.shape[2], HS = dout.shape[3];
  expect("rope_backward", "dout", dout, DType::f32, {B, T, NH, HS});
  expect("rope_backward", "dinp", dinp, DType::f32, {B, T, NH, HS});
  if (HS % 2 != 0) throw RuntimeError("ops::rope_backward: the head size must be even");
  on_cpu("rope_backward", {&dinp, &dout});
  cpu::rope_backward(dinp.as<float>(), dout.as<float>(), as_int(B), as_int(T), as_int(NH), as_int(HS), theta);
}

void swiglu_forward(const Tensor& out, const Tensor& gate, const Tensor& up) {
  const OpTimer timer("swiglu_forward");
  expect_same_size("swiglu_forward", {&out, &gate, &up});
  cpu::swiglu_forward(out.as<float>(), gate.as<float>(), up.as<float>(), out.numel());
}

void swiglu_backward(const Tensor& dgate, const Tensor& dup, const Tensor& dout, const Tensor& gate, const Tensor& up) {
  const OpTimer timer("swiglu_backward");
  expect_same_size("swiglu_backward", {&dgate, &dup, &dout, &gate, &up});
  cpu::swiglu_backward(dgate.as<float>(), dup.as<float>(), dout.as<float>(), gate.as<float>(), up.as<float>(),
                       dout.numel());
}

double fused_classifier(const Tensor& logits, const Tensor& losses, const Tensor& targets, float dlogits_scale) {
  const OpTimer timer("fused_classifier");
  const auto N = logits.shape[0], V = logits.shape[1];
  expect("fused_classifier", "logits", logits, DType::f32, {N, V});
  expect("fused_classifier", "losses", losses, DType::f32, {N});
  expect("fused_classifier", "targets", targets, DType::i32, {N});
  on_cpu("fused_classifier", {&logits, &losses, &targets});
  return cpu::fused_classifier(logits.as<float>(), losses.as<float>(), targets.as<std::int32_t>(), N, as_int(V),
                               dlogits_scale);
}

double sum_squares(const Tensor& x) {
  const OpTimer timer("sum_squares");
  expect_same_size("sum_squares", {&x});
  return cpu::sum_squares(x.as<float>(), x.numel());
}

void adamw_update(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const AdamWParams& p) {
  const OpTimer timer("adamw_update");
  expect_same_size("adamw_update", {&param, &grad, &m, &v});
  cpu::adamw_update(param.as<float>(), grad.as<float>(), m.as<float>(), v.as<float>(), param.numel(), p.lr, p.beta1,
                    p.beta2, p.eps, p.weight_decay, p.step, p.grad_scale);
}

}  // namespace llmtrain::ops
