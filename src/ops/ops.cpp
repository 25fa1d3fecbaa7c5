#include "ops/ops.h"

#include <deque>
#include <string>
#include <vector>

#include "core/bf16.h"
#include "core/error.h"
#include "ops/cpu/reference.h"
#include "ops/profile.h"
#if LLMTRAIN_HAVE_CUDA
#include <cuda_bf16.h>

#include "ops/cuda/cudnn_attention.h"
#include "ops/cuda/flash_attention.h"
#include "ops/cuda/kernels.h"
#include "ops/cuda/stream.h"
#endif

// `return call;` for an op's CUDA kernel (cuda::op(..., stream), its fp32 or bf16 overload, or
// cuDNN's attention); nothing in a build without CUDA, where on_cuda() has already refused cuda
// tensors.
#if LLMTRAIN_HAVE_CUDA
#define LLMTRAIN_RETURN_CUDA(call) return call
#else
#define LLMTRAIN_RETURN_CUDA(call) (void)0
#endif

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

// All arguments with data (an absent bias has none) on one device; true when that is the GPU.
// A build without CUDA refuses cuda tensors here, so its CUDA branches are never reached.
bool on_cuda(const char* op, std::initializer_list<const Tensor*> tensors) {
  const Tensor* first = nullptr;
  for (const Tensor* t : tensors) {
    if (!t->data) continue;
    if (!first) {
      first = t;
    } else if (t->device != first->device) {
      throw RuntimeError(std::string("ops::") + op + ": arguments on different devices (" +
                         device_name(first->device) + " and " + device_name(t->device) + ")");
    }
  }
  if (!first || first->device != Device::cuda) return false;
#if !LLMTRAIN_HAVE_CUDA
  throw RuntimeError(std::string("ops::") + op +
                     ": cuda tensors in a build without CUDA (configure with -DLLMTRAIN_CUDA=ON)");
#endif
  return true;
}

// The full attention with stored probabilities has no CUDA kernel: on the GPU, attention is
// flash_attention_forward/backward.
void cpu_only(const char* op, std::initializer_list<const Tensor*> tensors) {
  if (on_cuda(op, tensors)) {
    throw RuntimeError(std::string("ops::") + op + ": CPU only; on the GPU use flash_attention_*");
  }
}

int as_int(std::int64_t x) { return static_cast<int>(x); }

// The precision of an op's activations (and of the weights it reads): f32, or bf16 for mixed
// precision, in which weight gradients and statistics (mean, rstd, lse, losses) stay f32.
DType activation_dtype(const char* op, const Tensor& t) {
  if (t.dtype == DType::f32 || t.dtype == DType::bf16) return t.dtype;
  throw RuntimeError(std::string("ops::") + op + ": expected f32 or bf16 activations, got " + t.describe());
}

// The CPU reference in bf16: each bf16 tensor is widened to an f32 copy, the f32 op runs on the
// copies, and outputs are rounded back to bf16 (nearest even) when this object goes. A bf16 op's
// result is thus the f32 op's on the same inputs, rounded once: what the CUDA kernels compute,
// up to the order of their fp32 sums. Accumulating outputs (+=) work, as their values are copied in.
class Widened {
 public:
  Widened() = default;
  Widened(const Widened&) = delete;
  Widened& operator=(const Widened&) = delete;
  ~Widened() {
    for (const Copy& c : copies_) {
      if (!c.output) continue;
      auto* bits = c.target.as<std::uint16_t>();
      for (std::size_t i = 0; i < c.values.size(); ++i) bits[i] = float_to_bf16_bits(c.values[i]);
    }
  }
  Tensor in(const Tensor& t) { return widen(t, false); }
  Tensor out(const Tensor& t) { return widen(t, true); }

 private:
  struct Copy {
    Tensor target;
    std::vector<float> values;
    bool output;
  };
  Tensor widen(const Tensor& t, bool output) {
    if (!t.data || t.dtype != DType::bf16) return t;
    Copy& c = copies_.emplace_back(Copy{t, std::vector<float>(std::size_t(t.numel())), output});
    const auto* bits = t.as<const std::uint16_t>();
    for (std::size_t i = 0; i < c.values.size(); ++i) c.values[i] = bf16_bits_to_float(bits[i]);
    Tensor wide = t;
    wide.data = c.values.data();
    wide.dtype = DType::f32;
    return wide;
  }
  std::deque<Copy> copies_;  // a deque keeps each copy's address as more are added
};

#if LLMTRAIN_HAVE_CUDA
[[maybe_unused]] __nv_bfloat16* bf(const Tensor& t) { return t.as<__nv_bfloat16>(); }
#endif

}  // namespace

void encoder_forward(const Tensor& out, const Tensor& inp, const Tensor& wte, const Tensor& wpe) {
  const OpTimer timer("encoder_forward");
  const auto B = inp.shape[0], T = inp.shape[1], C = wte.shape[1];
  const DType act = activation_dtype("encoder_forward", out);
  expect("encoder_forward", "inp", inp, DType::i32, {-1, -1});
  expect("encoder_forward", "out", out, act, {B, T, C});
  expect("encoder_forward", "wte", wte, act, {-1, C});
  if (wpe.data) {
    expect("encoder_forward", "wpe", wpe, act, {-1, C});
    if (wpe.shape[0] < T) throw RuntimeError("ops::encoder_forward: T exceeds the position table");
  }
  if (on_cuda("encoder_forward", {&out, &inp, &wte, &wpe})) {
    if (act == DType::bf16) {
      LLMTRAIN_RETURN_CUDA(cuda::encoder_forward(bf(out), inp.as<std::int32_t>(), bf(wte), bf(wpe), as_int(B),
                                                      as_int(T), as_int(C), cuda::compute_stream()));
    }
    LLMTRAIN_RETURN_CUDA(cuda::encoder_forward(out.as<float>(), inp.as<std::int32_t>(), wte.as<float>(),
                                               wpe.as<float>(), as_int(B), as_int(T), as_int(C),
                                               cuda::compute_stream()));
  }
  if (act == DType::bf16) {
    Widened w;
    return encoder_forward(w.out(out), inp, w.in(wte), w.in(wpe));
  }
  cpu::encoder_forward(out.as<float>(), inp.as<std::int32_t>(), wte.as<float>(), wpe.as<float>(), as_int(B),
                       as_int(T), as_int(C));
}

void encoder_backward(const Tensor& dwte, const Tensor& dwpe, const Tensor& dout, const Tensor& inp) {
  const OpTimer timer("encoder_backward");
  const auto B = inp.shape[0], T = inp.shape[1], C = dwte.shape[1];
  const DType act = activation_dtype("encoder_backward", dout);
  expect("encoder_backward", "inp", inp, DType::i32, {-1, -1});
  expect("encoder_backward", "dout", dout, act, {B, T, C});
  expect("encoder_backward", "dwte", dwte, DType::f32, {-1, C});
  if (dwpe.data) expect("encoder_backward", "dwpe", dwpe, DType::f32, {-1, C});
  if (dwpe.data && dwpe.shape[0] < T)
    throw RuntimeError("ops::encoder_backward: T exceeds the position table");
  if (on_cuda("encoder_backward", {&dwte, &dwpe, &dout, &inp})) {
    if (act == DType::bf16) {
      LLMTRAIN_RETURN_CUDA(cuda::encoder_backward(dwte.as<float>(), dwpe.as<float>(), bf(dout),
                                                       inp.as<std::int32_t>(), as_int(B), as_int(T), as_int(C),
                                                       cuda::compute_stream()));
    }
    LLMTRAIN_RETURN_CUDA(cuda::encoder_backward(dwte.as<float>(), dwpe.as<float>(), dout.as<float>(),
                                                inp.as<std::int32_t>(), as_int(B), as_int(T), as_int(C),
                                                cuda::compute_stream()));
  }
  if (act == DType::bf16) {
    Widened w;
    return encoder_backward(dwte, dwpe, w.in(dout), inp);
  }
  cpu::encoder_backward(dwte.as<float>(), dwpe.as<float>(), dout.as<float>(), inp.as<std::int32_t>(), as_int(B),
                        as_int(T), as_int(C));
}

void layernorm_forward(const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& inp,
                       const Tensor& weight, const Tensor& bias) {
  const OpTimer timer("layernorm_forward");
  const auto N = inp.shape[0], C = inp.shape[1];
  const DType act = activation_dtype("layernorm_forward", inp);
  expect("layernorm_forward", "inp", inp, act, {N, C});
  expect("layernorm_forward", "out", out, act, {N, C});
  expect("layernorm_forward", "mean", mean, DType::f32, {N});
  expect("layernorm_forward", "rstd", rstd, DType::f32, {N});
  expect("layernorm_forward", "weight", weight, act, {C});
  expect("layernorm_forward", "bias", bias, act, {C});
  if (on_cuda("layernorm_forward", {&out, &mean, &rstd, &inp, &weight, &bias})) {
    if (act == DType::bf16) {
      LLMTRAIN_RETURN_CUDA(cuda::layernorm_forward(bf(out), mean.as<float>(), rstd.as<float>(), bf(inp),
                                                        bf(weight), bf(bias), N, as_int(C), cuda::compute_stream()));
    }
    LLMTRAIN_RETURN_CUDA(cuda::layernorm_forward(out.as<float>(), mean.as<float>(), rstd.as<float>(),
                                                 inp.as<float>(), weight.as<float>(), bias.as<float>(), N,
                                                 as_int(C), cuda::compute_stream()));
  }
  if (act == DType::bf16) {
    Widened w;
    return layernorm_forward(w.out(out), mean, rstd, w.in(inp), w.in(weight), w.in(bias));
  }
  cpu::layernorm_forward(out.as<float>(), mean.as<float>(), rstd.as<float>(), inp.as<float>(), weight.as<float>(),
                         bias.as<float>(), N, as_int(C));
}

void layernorm_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dbias, const Tensor& dout,
                        const Tensor& inp, const Tensor& weight, const Tensor& mean, const Tensor& rstd) {
  const OpTimer timer("layernorm_backward");
  const auto N = inp.shape[0], C = inp.shape[1];
  const DType act = activation_dtype("layernorm_backward", inp);
  expect("layernorm_backward", "inp", inp, act, {N, C});
  expect("layernorm_backward", "dinp", dinp, act, {N, C});
  expect("layernorm_backward", "dout", dout, act, {N, C});
  expect("layernorm_backward", "dweight", dweight, DType::f32, {C});
  expect("layernorm_backward", "dbias", dbias, DType::f32, {C});
  expect("layernorm_backward", "weight", weight, act, {C});
  expect("layernorm_backward", "mean", mean, DType::f32, {N});
  expect("layernorm_backward", "rstd", rstd, DType::f32, {N});
  if (on_cuda("layernorm_backward", {&dinp, &dweight, &dbias, &dout, &inp, &weight, &mean, &rstd})) {
    if (act == DType::bf16) {
      LLMTRAIN_RETURN_CUDA(cuda::layernorm_backward(bf(dinp), dweight.as<float>(), dbias.as<float>(), bf(dout),
                                                         bf(inp), bf(weight), mean.as<float>(), rstd.as<float>(), N,
                                                         as_int(C), cuda::compute_stream()));
    }
    LLMTRAIN_RETURN_CUDA(cuda::layernorm_backward(
        dinp.as<float>(), dweight.as<float>(), dbias.as<float>(), dout.as<float>(), inp.as<float>(),
        weight.as<float>(), mean.as<float>(), rstd.as<float>(), N, as_int(C), cuda::compute_stream()));
  }
  if (act == DType::bf16) {
    Widened w;
    return layernorm_backward(w.out(dinp), dweight, dbias, w.in(dout), w.in(inp), w.in(weight), mean, rstd);
  }
  cpu::layernorm_backward(dinp.as<float>(), dweight.as<float>(), dbias.as<float>(), dout.as<float>(),
                          inp.as<float>(), weight.as<float>(), mean.as<float>(), rstd.as<float>(), N, as_int(C));
}

void matmul_forward(const Tensor& out, const Tensor& inp, const Tensor& weight, const Tensor& bias) {
  const OpTimer timer("matmul_forward");
  const auto N = inp.shape[0], C = inp.shape[1], OC = weight.shape[0];
  const DType act = activation_dtype("matmul_forward", inp);
  expect("matmul_forward", "inp", inp, act, {N, C});
  expect("matmul_forward", "weight", weight, act, {OC, C});
  expect("matmul_forward", "out", out, act, {N, OC});
  if (bias.data) expect("matmul_forward", "bias", bias, act, {OC});
  if (on_cuda("matmul_forward", {&out, &inp, &weight, &bias})) {
    if (act == DType::bf16) {
      LLMTRAIN_RETURN_CUDA(cuda::matmul_forward(bf(out), bf(inp), bf(weight), bf(bias), N, as_int(C), as_int(OC),
                                                     cuda::compute_stream()));
    }
    LLMTRAIN_RETURN_CUDA(cuda::matmul_forward(out.as<float>(), inp.as<float>(), weight.as<float>(),
                                              bias.as<float>(), N, as_int(C), as_int(OC),
                                              cuda::compute_stream()));
  }
  if (act == DType::bf16) {
    Widened w;
    return matmul_forward(w.out(out), w.in(inp), w.in(weight), w.in(bias));
  }
  cpu::matmul_forward(out.as<float>(), inp.as<float>(), weight.as<float>(), bias.as<float>(), N, as_int(C),
                      as_int(OC));
}

void matmul_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dbias, const Tensor& dout,
                     const Tensor& inp, const Tensor& weight) {
  const OpTimer timer("matmul_backward");
  const auto N = inp.shape[0], C = inp.shape[1], OC = weight.shape[0];
  const DType act = activation_dtype("matmul_backward", inp);
  expect("matmul_backward", "inp", inp, act, {N, C});
  expect("matmul_backward", "dinp", dinp, act, {N, C});
  expect("matmul_backward", "weight", weight, act, {OC, C});
  expect("matmul_backward", "dweight", dweight, DType::f32, {OC, C});
  expect("matmul_backward", "dout", dout, act, {N, OC});
  if (dbias.data) expect("matmul_backward", "dbias", dbias, DType::f32, {OC});
  if (on_cuda("matmul_backward", {&dinp, &dweight, &dbias, &dout, &inp, &weight})) {
    if (act == DType::bf16) {
      LLMTRAIN_RETURN_CUDA(cuda::matmul_backward(bf(dinp), dweight.as<float>(), dbias.as<float>(), bf(dout),
                                                      bf(inp), bf(weight), N, as_int(C), as_int(OC),
                                                      cuda::compute_stream()));
    }
    LLMTRAIN_RETURN_CUDA(cuda::matmul_backward(dinp.as<float>(), dweight.as<float>(), dbias.as<float>(),
                                               dout.as<float>(), inp.as<float>(), weight.as<float>(), N,
                                               as_int(C), as_int(OC), cuda::compute_stream()));
  }
  if (act == DType::bf16) {
    Widened w;
    return matmul_backward(w.out(dinp), dweight, dbias, w.in(dout), w.in(inp), w.in(weight));
  }
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
  cpu_only("attention_forward", {&out, &att, &qkv});
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
  cpu_only("attention_backward", {&dqkv, &dout, &qkv, &att});
  cpu::attention_backward(dqkv.as<float>(), dout.as<float>(), qkv.as<float>(), att.as<float>(), as_int(B), as_int(T),
                          as_int(C), NH, NKV);
}

void attention_decode(const Tensor& out, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, int pos,
                      int NH, int NKV) {
  const OpTimer timer("attention_decode");
  if (NKV == 0) NKV = NH;
  const auto C = q.shape[0], maxT = k_cache.shape[0];
  if (NH <= 0 || C % NH != 0 || NKV <= 0 || NH % NKV != 0) {
    throw RuntimeError("ops::attention_decode: NH must divide C and NKV must divide NH");
  }
  const auto KVC = C / NH * NKV;
  const DType act = activation_dtype("attention_decode", q);
  expect("attention_decode", "q", q, act, {C});
  expect("attention_decode", "out", out, act, {C});
  expect("attention_decode", "k_cache", k_cache, act, {maxT, KVC});
  expect("attention_decode", "v_cache", v_cache, act, {maxT, KVC});
  if (pos < 0 || pos >= maxT) {
    throw RuntimeError("ops::attention_decode: position " + std::to_string(pos) + " outside the cache");
  }
  if (on_cuda("attention_decode", {&out, &q, &k_cache, &v_cache})) {
    if (act == DType::bf16) {
      LLMTRAIN_RETURN_CUDA(cuda::attention_decode(bf(out), bf(q), bf(k_cache), bf(v_cache), pos, as_int(C), NH,
                                                       NKV, cuda::compute_stream()));
    }
    LLMTRAIN_RETURN_CUDA(cuda::attention_decode(out.as<float>(), q.as<float>(), k_cache.as<float>(),
                                                v_cache.as<float>(), pos, as_int(C), NH, NKV,
                                                cuda::compute_stream()));
  }
  if (act == DType::bf16) {
    // Only the positions up to `pos` are read: widen those rows, not the whole cache.
    Widened w;
    const auto rows = [&](const Tensor& cache) {
      return Tensor(cache.data, cache.dtype, cache.device, {std::int64_t(pos) + 1, KVC});
    };
    return attention_decode(w.out(out), w.in(q), w.in(rows(k_cache)), w.in(rows(v_cache)), pos, NH, NKV);
  }
  cpu::attention_decode(out.as<float>(), q.as<float>(), k_cache.as<float>(), v_cache.as<float>(), pos, as_int(C), NH,
                        NKV);
}

namespace {
// Flash attention's head counts: NKV 0 becomes NH; returns the qkv row width (NH+2NKV)HS.
std::int64_t flash_qkv_width(const char* op, std::int64_t C, int NH, int& NKV) {
  if (NKV == 0) NKV = NH;
  if (NH <= 0 || C % NH != 0 || NKV <= 0 || NH % NKV != 0) {
    throw RuntimeError(std::string("ops::") + op + ": NH must divide C and NKV must divide NH");
  }
  return (NH + 2 * NKV) * (C / NH);
}
}  // namespace

namespace {
// cuDNN's fused attention takes bf16 (or fp16) only.
void check_cudnn_attention(const char* op, DType act) {
  if (act != DType::bf16) {
    throw InputError(std::string("model.attention: \"cudnn\" needs train.precision \"bf16\" (cuDNN's fused "
                                 "attention has no fp32 kernels); ") + op + " got " + dtype_name(act));
  }
}
}  // namespace

void flash_attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, int NH, int NKV,
                             AttentionKernels kernels) {
  const OpTimer timer("flash_attention_forward");
  const auto B = out.shape[0], T = out.shape[1], C = out.shape[2];
  const std::int64_t width = flash_qkv_width("flash_attention_forward", C, NH, NKV);
  const DType act = activation_dtype("flash_attention_forward", qkv);
  expect("flash_attention_forward", "out", out, act, {B, T, C});
  expect("flash_attention_forward", "qkv", qkv, act, {B, T, width});
  expect("flash_attention_forward", "lse", lse, DType::f32, {B, NH, T});
  if (on_cuda("flash_attention_forward", {&out, &lse, &qkv})) {
    if (kernels == AttentionKernels::cudnn) {
      check_cudnn_attention("flash_attention_forward", act);
      LLMTRAIN_RETURN_CUDA(cuda::cudnn_attention_forward(bf(out), lse.as<float>(), bf(qkv), as_int(B), as_int(T),
                                                          as_int(C), NH, NKV, cuda::compute_stream()));
    }
    if (act == DType::bf16) {
      LLMTRAIN_RETURN_CUDA(cuda::flash_attention_forward(bf(out), lse.as<float>(), bf(qkv), as_int(B), as_int(T),
                                                              as_int(C), NH, NKV, cuda::compute_stream()));
    }
    LLMTRAIN_RETURN_CUDA(cuda::flash_attention_forward(out.as<float>(), lse.as<float>(), qkv.as<float>(), as_int(B),
        as_int(T), as_int(C), NH, NKV, cuda::compute_stream()));
  }
  if (act == DType::bf16) {
    Widened w;
    return flash_attention_forward(w.out(out), lse, w.in(qkv), NH, NKV);
  }
  cpu::flash_attention_forward(out.as<float>(), lse.as<float>(), qkv.as<float>(), as_int(B), as_int(T), as_int(C), NH,
                               NKV);
}

void flash_attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                              const Tensor& lse, int NH, int NKV, AttentionKernels kernels) {
  const OpTimer timer("flash_attention_backward");
  const auto B = dout.shape[0], T = dout.shape[1], C = dout.shape[2];
  const std::int64_t width = flash_qkv_width("flash_attention_backward", C, NH, NKV);
  const DType act = activation_dtype("flash_attention_backward", qkv);
  expect("flash_attention_backward", "dout", dout, act, {B, T, C});
  expect("flash_attention_backward", "out", out, act, {B, T, C});
  expect("flash_attention_backward", "qkv", qkv, act, {B, T, width});
  expect("flash_attention_backward", "dqkv", dqkv, act, {B, T, width});
  expect("flash_attention_backward", "lse", lse, DType::f32, {B, NH, T});
  if (on_cuda("flash_attention_backward", {&dqkv, &dout, &qkv, &out, &lse})) {
    if (kernels == AttentionKernels::cudnn) {
      check_cudnn_attention("flash_attention_backward", act);
      LLMTRAIN_RETURN_CUDA(cuda::cudnn_attention_backward(bf(dqkv), bf(dout), bf(qkv), bf(out), lse.as<float>(),
                                                           as_int(B), as_int(T), as_int(C), NH, NKV,
                                                           cuda::compute_stream()));
    }
    if (act == DType::bf16) {
      LLMTRAIN_RETURN_CUDA(cuda::flash_attention_backward(bf(dqkv), bf(dout), bf(qkv), bf(out), lse.as<float>(),
                                                               as_int(B), as_int(T), as_int(C), NH, NKV,
                                                               cuda::compute_stream()));
    }
    LLMTRAIN_RETURN_CUDA(cuda::flash_attention_backward(dqkv.as<float>(), dout.as<float>(), qkv.as<float>(),
        out.as<float>(), lse.as<float>(), as_int(B), as_int(T), as_int(C), NH, NKV, cuda::compute_stream()));
  }
  if (act == DType::bf16) {
    Widened w;
    return flash_attention_backward(w.out(dqkv), w.in(dout), w.in(qkv), w.in(out), lse, NH, NKV);
  }
  cpu::flash_attention_backward(dqkv.as<float>(), dout.as<float>(), qkv.as<float>(), out.as<float>(), lse.as<float>(),
                                as_int(B), as_int(T), as_int(C), NH, NKV);
}

namespace {
// Elementwise ops: tensors of one size and one dtype (f32, or bf16 for mixed precision); returns it.
DType expect_same_size(const char* op, std::initializer_list<const Tensor*> tensors, bool f32_only = false) {
  const Tensor& first = **tensors.begin();
  const DType dtype = first.dtype == DType::bf16 && !f32_only ? DType::bf16 : DType::f32;
  for (const Tensor* t : tensors) {
    if (!t->data || t->dtype != dtype || t->numel() != first.numel()) {
      throw RuntimeError(std::string("ops::") + op + ": expected " + dtype_name(dtype) + " tensors of " +
                         std::to_string(first.numel()) + " elements, got " + (t->data ? t->describe() : "null"));
    }
  }
  return dtype;
}
}  // namespace

void gelu_forward(const Tensor& out, const Tensor& inp) {
  const OpTimer timer("gelu_forward");
  const DType act = expect_same_size("gelu_forward", {&out, &inp});
  if (on_cuda("gelu_forward", {&out, &inp})) {
    if (act == DType::bf16) {
      LLMTRAIN_RETURN_CUDA(cuda::gelu_forward(bf(out), bf(inp), inp.numel(), cuda::compute_stream()));
    }
    LLMTRAIN_RETURN_CUDA(cuda::gelu_forward(out.as<float>(), inp.as<float>(), inp.numel(), cuda::compute_stream()));
  }
  if (act == DType::bf16) {
    Widened w;
    return gelu_forward(w.out(out), w.in(inp));
  }
  cpu::gelu_forward(out.as<float>(), inp.as<float>(), inp.numel());
}

void gelu_backward(const Tensor& dinp, const Tensor& inp, const Tensor& dout) {
  const OpTimer timer("gelu_backward");
  const DType act = expect_same_size("gelu_backward", {&dinp, &inp, &dout});
  if (on_cuda("gelu_backward", {&dinp, &inp, &dout})) {
    if (act == DType::bf16) {
      LLMTRAIN_RETURN_CUDA(cuda::gelu_backward(bf(dinp), bf(inp), bf(dout), inp.numel(), cuda::compute_stream()));
    }
    LLMTRAIN_RETURN_CUDA(cuda::gelu_backward(dinp.as<float>(), inp.as<float>(), dout.as<float>(), inp.numel(), cuda::compute_stream()));
  }
  if (act == DType::bf16) {
    Widened w;
    return gelu_backward(w.out(dinp), w.in(inp), w.in(dout));
  }
  cpu::gelu_backward(dinp.as<float>(), inp.as<float>(), dout.as<float>(), inp.numel());
}

void residual_forward(const Tensor& out, const Tensor& a, const Tensor& b) {
  const OpTimer timer("residual_forward");
  const DType act = expect_same_size("residual_forward", {&out, &a, &b});
  if (on_cuda("residual_forward", {&out, &a, &b})) {
    if (act == DType::bf16) {
      LLMTRAIN_RETURN_CUDA(cuda::residual_forward(bf(out), bf(a), bf(b), out.numel(), cuda::compute_stream()));
    }
    LLMTRAIN_RETURN_CUDA(cuda::residual_forward(out.as<float>(), a.as<float>(), b.as<float>(), out.numel(), cuda::compute_stream()));
  }
  if (act == DType::bf16) {
    Widened w;
    return residual_forward(w.out(out), w.in(a), w.in(b));
  }
  cpu::residual_forward(out.as<float>(), a.as<float>(), b.as<float>(), out.numel());
}

void residual_backward(const Tensor& da, const Tensor& db, const Tensor& dout) {
  const OpTimer timer("residual_backward");
  const DType act = expect_same_size("residual_backward", {&da, &db, &dout});
  if (on_cuda("residual_backward", {&da, &db, &dout})) {
    if (act == DType::bf16) {
      LLMTRAIN_RETURN_CUDA(cuda::residual_backward(bf(da), bf(db), bf(dout), dout.numel(), cuda::compute_stream()));
    }
    LLMTRAIN_RETURN_CUDA(cuda::residual_backward(da.as<float>(), db.as<float>(), dout.as<float>(), dout.numel(), cuda::compute_stream()));
  }
  if (act == DType::bf16) {
    Widened w;
    return residual_backward(w.out(da), w.out(db), w.in(dout));
  }
  cpu::residual_backward(da.as<float>(), db.as<float>(), dout.as<float>(), dout.numel());
}

void rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& inp, const Tensor& weight, float eps) {
  const OpTimer timer("rmsnorm_forward");
  const auto N = inp.shape[0], C = inp.shape[1];
  const DType act = activation_dtype("rmsnorm_forward", inp);
  expect("rmsnorm_forward", "inp", inp, act, {N, C});
  expect("rmsnorm_forward", "out", out, act, {N, C});
  expect("rmsnorm_forward", "rstd", rstd, DType::f32, {N});
  expect("rmsnorm_forward", "weight", weight, act, {C});
  if (on_cuda("rmsnorm_forward", {&out, &rstd, &inp, &weight})) {
    if (act == DType::bf16) {
      LLMTRAIN_RETURN_CUDA(cuda::rmsnorm_forward(bf(out), rstd.as<float>(), bf(inp), bf(weight), N, as_int(C), eps,
                                                      cuda::compute_stream()));
    }
    LLMTRAIN_RETURN_CUDA(cuda::rmsnorm_forward(out.as<float>(), rstd.as<float>(), inp.as<float>(),
                                               weight.as<float>(), N, as_int(C), eps,
                                               cuda::compute_stream()));
  }
  if (act == DType::bf16) {
    Widened w;
    return rmsnorm_forward(w.out(out), rstd, w.in(inp), w.in(weight), eps);
  }
  cpu::rmsnorm_forward(out.as<float>(), rstd.as<float>(), inp.as<float>(), weight.as<float>(), N, as_int(C), eps);
}

void rmsnorm_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dout, const Tensor& inp,
                      const Tensor& weight, const Tensor& rstd) {
  const OpTimer timer("rmsnorm_backward");
  const auto N = inp.shape[0], C = inp.shape[1];
  const DType act = activation_dtype("rmsnorm_backward", inp);
  expect("rmsnorm_backward", "inp", inp, act, {N, C});
  expect("rmsnorm_backward", "dinp", dinp, act, {N, C});
  expect("rmsnorm_backward", "dout", dout, act, {N, C});
  expect("rmsnorm_backward", "dweight", dweight, DType::f32, {C});
  expect("rmsnorm_backward", "weight", weight, act, {C});
  expect("rmsnorm_backward", "rstd", rstd, DType::f32, {N});
  if (on_cuda("rmsnorm_backward", {&dinp, &dweight, &dout, &inp, &weight, &rstd})) {
    if (act == DType::bf16) {
      LLMTRAIN_RETURN_CUDA(cuda::rmsnorm_backward(bf(dinp), dweight.as<float>(), bf(dout), bf(inp), bf(weight),
                                                       rstd.as<float>(), N, as_int(C), cuda::compute_stream()));
    }
    LLMTRAIN_RETURN_CUDA(cuda::rmsnorm_backward(dinp.as<float>(), dweight.as<float>(), dout.as<float>(),
                                                inp.as<float>(), weight.as<float>(), rstd.as<float>(), N,
                                                as_int(C), cuda::compute_stream()));
  }
  if (act == DType::bf16) {
    Widened w;
    return rmsnorm_backward(w.out(dinp), dweight, w.in(dout), w.in(inp), w.in(weight), rstd);
  }
  cpu::rmsnorm_backward(dinp.as<float>(), dweight.as<float>(), dout.as<float>(), inp.as<float>(), weight.as<float>(),
                        rstd.as<float>(), N, as_int(C));
}

void rope_forward(const Tensor& out, const Tensor& inp, float theta, int rotated_heads, int pos0) {
  const OpTimer timer("rope_forward");
  const auto B = inp.shape[0], T = inp.shape[1], NH = inp.shape[2], HS = inp.shape[3];
  const DType act = activation_dtype("rope_forward", inp);
  expect("rope_forward", "inp", inp, act, {B, T, NH, HS});
  expect("rope_forward", "out", out, act, {B, T, NH, HS});
  if (HS % 2 != 0) throw RuntimeError("ops::rope_forward: the head size must be even");
  if (rotated_heads < 0 || rotated_heads > NH) rotated_heads = as_int(NH);
  if (on_cuda("rope_forward", {&out, &inp})) {
    if (act == DType::bf16) {
      LLMTRAIN_RETURN_CUDA(cuda::rope_forward(bf(out), bf(inp), as_int(B), as_int(T), as_int(NH), as_int(HS),
                                               rotated_heads, pos0, theta, cuda::compute_stream()));
    }
    LLMTRAIN_RETURN_CUDA(cuda::rope_forward(out.as<float>(), inp.as<float>(), as_int(B), as_int(T), as_int(NH), as_int(HS),
                                          rotated_heads, pos0, theta, cuda::compute_stream()));
  }
  if (act == DType::bf16) {
    Widened w;
    return rope_forward(w.out(out), w.in(inp), theta, rotated_heads, pos0);
  }
  cpu::rope_forward(out.as<float>(), inp.as<float>(), as_int(B), as_int(T), as_int(NH), as_int(HS), rotated_heads, pos0,
                    theta);
}

void rope_backward(const Tensor& dinp, const Tensor& dout, float theta, int rotated_heads, int pos0) {
  const OpTimer timer("rope_backward");
  const auto B = dout.shape[0], T = dout.shape[1], NH = dout.shape[2], HS = dout.shape[3];
  const DType act = activation_dtype("rope_backward", dout);
  expect("rope_backward", "dout", dout, act, {B, T, NH, HS});
  expect("rope_backward", "dinp", dinp, act, {B, T, NH, HS});
  if (HS % 2 != 0) throw RuntimeError("ops::rope_backward: the head size must be even");
  if (rotated_heads < 0 || rotated_heads > NH) rotated_heads = as_int(NH);
  if (on_cuda("rope_backward", {&dinp, &dout})) {
    if (act == DType::bf16) {
      LLMTRAIN_RETURN_CUDA(cuda::rope_backward(bf(dinp), bf(dout), as_int(B), as_int(T), as_int(NH), as_int(HS),
                                               rotated_heads, pos0, theta, cuda::compute_stream()));
    }
    LLMTRAIN_RETURN_CUDA(cuda::rope_backward(dinp.as<float>(), dout.as<float>(), as_int(B), as_int(T), as_int(NH), as_int(HS),
                                          rotated_heads, pos0, theta, cuda::compute_stream()));
  }
  if (act == DType::bf16) {
    Widened w;
    return rope_backward(w.out(dinp), w.in(dout), theta, rotated_heads, pos0);
  }
  cpu::rope_backward(dinp.as<float>(), dout.as<float>(), as_int(B), as_int(T), as_int(NH), as_int(HS), rotated_heads, pos0,
                    theta);
}

void swiglu_forward(const Tensor& out, const Tensor& gate, const Tensor& up) {
  const OpTimer timer("swiglu_forward");
  const DType act = expect_same_size("swiglu_forward", {&out, &gate, &up});
  if (on_cuda("swiglu_forward", {&out, &gate, &up})) {
    if (act == DType::bf16) {
      LLMTRAIN_RETURN_CUDA(cuda::swiglu_forward(bf(out), bf(gate), bf(up), out.numel(), cuda::compute_stream()));
    }
    LLMTRAIN_RETURN_CUDA(cuda::swiglu_forward(out.as<float>(), gate.as<float>(), up.as<float>(), out.numel(), cuda::compute_stream()));
  }
  if (act == DType::bf16) {
    Widened w;
    return swiglu_forward(w.out(out), w.in(gate), w.in(up));
  }
  cpu::swiglu_forward(out.as<float>(), gate.as<float>(), up.as<float>(), out.numel());
}

void swiglu_backward(const Tensor& dgate, const Tensor& dup, const Tensor& dout, const Tensor& gate, const Tensor& up) {
  const OpTimer timer("swiglu_backward");
  const DType act = expect_same_size("swiglu_backward", {&dgate, &dup, &dout, &gate, &up});
  if (on_cuda("swiglu_backward", {&dgate, &dup, &dout, &gate, &up})) {
    if (act == DType::bf16) {
      LLMTRAIN_RETURN_CUDA(cuda::swiglu_backward(bf(dgate), bf(dup), bf(dout), bf(gate), bf(up), dout.numel(), cuda::compute_stream()));
    }
    LLMTRAIN_RETURN_CUDA(cuda::swiglu_backward(dgate.as<float>(), dup.as<float>(), dout.as<float>(), gate.as<float>(), up.as<float>(), dout.numel(), cuda::compute_stream()));
  }
  if (act == DType::bf16) {
    Widened w;
    return swiglu_backward(w.out(dgate), w.out(dup), w.in(dout), w.in(gate), w.in(up));
  }
  cpu::swiglu_backward(dgate.as<float>(), dup.as<float>(), dout.as<float>(), gate.as<float>(), up.as<float>(), dout.numel());
}

double fused_classifier(const Tensor& logits, const Tensor& losses, const Tensor& targets, float dlogits_scale) {
  const OpTimer timer("fused_classifier");
  const auto N = logits.shape[0], V = logits.shape[1];
  const DType act = activation_dtype("fused_classifier", logits);
  expect("fused_classifier", "logits", logits, act, {N, V});
  expect("fused_classifier", "losses", losses, DType::f32, {N});
  expect("fused_classifier", "targets", targets, DType::i32, {N});
  if (on_cuda("fused_classifier", {&logits, &losses, &targets})) {
    if (act == DType::bf16) {
      LLMTRAIN_RETURN_CUDA(cuda::fused_classifier(bf(logits), losses.as<float>(), targets.as<std::int32_t>(), N,
                                                       as_int(V), dlogits_scale, cuda::compute_stream()));
    }
    LLMTRAIN_RETURN_CUDA(cuda::fused_classifier(logits.as<float>(), losses.as<float>(),
                                                targets.as<std::int32_t>(), N, as_int(V), dlogits_scale,
                                                cuda::compute_stream()));
  }
  if (act == DType::bf16) {
    Widened w;
    return fused_classifier(dlogits_scale > 0 ? w.out(logits) : w.in(logits), losses, targets, dlogits_scale);
  }
  return cpu::fused_classifier(logits.as<float>(), losses.as<float>(), targets.as<std::int32_t>(), N, as_int(V),
                               dlogits_scale);
}

double sum_squares(const Tensor& x) {
  const OpTimer timer("sum_squares");
  expect_same_size("sum_squares", {&x}, /*f32_only=*/true);
  if (on_cuda("sum_squares", {&x})) {
    LLMTRAIN_RETURN_CUDA(cuda::sum_squares(x.as<float>(), x.numel(), cuda::compute_stream()));
  }
  return cpu::sum_squares(x.as<float>(), x.numel());
}

void adamw_update(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const AdamWParams& p) {
  const OpTimer timer("adamw_update");
  expect_same_size("adamw_update", {&param, &grad, &m, &v}, /*f32_only=*/true);
  if (on_cuda("adamw_update", {&param, &grad, &m, &v})) {
    LLMTRAIN_RETURN_CUDA(cuda::adamw_update(param.as<float>(), grad.as<float>(), m.as<float>(), v.as<float>(),
                                            param.numel(), p.lr, p.beta1, p.beta2, p.eps, p.weight_decay,
                                            p.step, p.grad_scale, cuda::compute_stream()));
  }
  cpu::adamw_update(param.as<float>(), grad.as<float>(), m.as<float>(), v.as<float>(), param.numel(), p.lr, p.beta1,
                    p.beta2, p.eps, p.weight_decay, p.step, p.grad_scale);
}

void convert(const Tensor& out, const Tensor& in) {
  const OpTimer timer("convert");
  const bool narrowing = out.dtype == DType::bf16 && in.dtype == DType::f32;
  const bool widening = out.dtype == DType::f32 && in.dtype == DType::bf16;
  if (!(narrowing || widening) || !out.data || !in.data || out.numel() != in.numel()) {
    throw RuntimeError("ops::convert: expected f32 -> bf16 or bf16 -> f32 of one size, got " + in.describe() + " -> " +
                       out.describe());
  }
  const std::int64_t N = in.numel();
  if (on_cuda("convert", {&out, &in})) {
    if (narrowing) LLMTRAIN_RETURN_CUDA(cuda::convert(bf(out), in.as<float>(), N, cuda::compute_stream()));
    LLMTRAIN_RETURN_CUDA(cuda::convert(out.as<float>(), bf(in), N, cuda::compute_stream()));
  }
  if (narrowing) {
    auto* bits = out.as<std::uint16_t>();
    const float* x = in.as<float>();
#pragma omp parallel for simd
    for (std::int64_t i = 0; i < N; ++i) bits[i] = float_to_bf16_bits(x[i]);
    return;
  }
  float* x = out.as<float>();
  const auto* bits = in.as<std::uint16_t>();
#pragma omp parallel for simd
  for (std::int64_t i = 0; i < N; ++i) x[i] = bf16_bits_to_float(bits[i]);
}

}  // namespace llmtrain::ops
