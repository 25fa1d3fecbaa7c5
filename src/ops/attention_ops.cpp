// The attention ops: their checks, then their kernels and arguments, once (src/ops/dispatch.h
// runs them on the right device, in the right precision): flash attention, the blocks of context
// parallelism's ring and their merge, decoding with a KV cache, and what cuDNN's attention offers.
#include <string>
#include <tuple>

#include "llmtrain/kernels/cpu.h"
#include "ops/dispatch.h"
#include "ops/ops.h"
#if LLMTRAIN_HAVE_CUDA
#include "device/runtime.h"
#include "llmtrain/kernels/cudnn_attention.h"
#include "llmtrain/kernels/flash_attention.h"
#endif

namespace llmtrain::ops {

using dispatch::as_int;
using dispatch::Op;

namespace {
// Checks NH and NKV (0 becomes NH) against C = NH HS; returns the qkv row width (NH + 2 NKV) HS.
std::int64_t qkv_width(const Op& op, std::int64_t C, int NH, int& NKV) {
  if (NKV == 0) NKV = NH;
  if (NH <= 0 || C % NH != 0 || NKV <= 0 || NH % NKV != 0) op.fail("NH must divide C and NKV must divide NH");
  return (NH + 2 * NKV) * (C / NH);
}

// A document mask: segments (B,T) i32, nondecreasing along each sequence (checked where the host
// can read them).
void expect_segments(const Op& op, const Tensor& segments, std::int64_t B, std::int64_t T) {
  op.expect("segments", segments, DType::i32, {B, T});
  if (segments.device != Device::cpu) return;
  const std::int32_t* s = segments.as<std::int32_t>();
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t t = 1; t < T; ++t) {
      if (s[b * T + t] < s[b * T + t - 1]) {
        op.fail("segments: decrease at sequence " + std::to_string(b) + ", position " + std::to_string(t));
      }
    }
  }
}

// The segment ids' pointer for a kernel (null without a document mask).
template <class View>
const std::int32_t* segment_ids(const View& v, const Tensor& segments) {
  if (!segments.data) return nullptr;
  return v.i32(segments);
}

}  // namespace

void attention_decode(const Tensor& out, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, int pos,
                      int NH, int NKV) {
  const Op op("attention_decode");
  const auto C = q.shape[0], maxT = k_cache.shape[0];
  qkv_width(op, C, NH, NKV);
  const auto KVC = C / NH * NKV;
  const DType act = op.activation(q);
  op.expect("q", q, act, {C});
  op.expect("out", out, act, {C});
  op.expect("k_cache", k_cache, act, {maxT, KVC});
  op.expect("v_cache", v_cache, act, {maxT, KVC});
  if (pos < 0 || pos >= maxT) op.fail("position " + std::to_string(pos) + " outside the cache");
  // Only the positions up to `pos` are read (and, in bf16 on the CPU, widened).
  const auto rows = [&](const Tensor& cache) {
    return Tensor(cache.data, cache.dtype, cache.device, {std::int64_t(pos) + 1, KVC});
  };
  op.run(LLMTRAIN_KERNELS(attention_decode), act, [&](auto v) {
    return std::tuple(v.out(out), v.in(q), v.in(rows(k_cache)), v.in(rows(v_cache)), pos, as_int(C), NH, NKV);
  });
}

bool cudnn_attention_available(std::string* why_not) {
#if LLMTRAIN_HAVE_CUDA
  return cuda::cudnn_attention_available(why_not);
#else
  *why_not = "this build has no CUDA";
  return false;
#endif
}

bool cudnn_attention_supported(int B, int T, int C, int NH, int NKV, std::string* why_not) {
#if LLMTRAIN_HAVE_CUDA
  return cuda::cudnn_attention_supported(B, T, C, NH, NKV, why_not);
#else
  (void)B, (void)T, (void)C, (void)NH, (void)NKV;
  return cudnn_attention_available(why_not);
#endif
}

std::string cudnn_version() {
#if LLMTRAIN_HAVE_CUDA
  return device::cudnn_version();
#else
  return "not built";
#endif
}

void set_deterministic(bool deterministic) {
#if LLMTRAIN_HAVE_CUDA
  cuda::set_flash_attention_deterministic(deterministic);
#else
  (void)deterministic;
#endif
}

void flash_attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, int NH, int NKV,
                             AttentionKernels kernels, const Tensor& segments) {
  const Op op("flash_attention_forward");
  const auto B = out.shape[0], T = out.shape[1], C = out.shape[2];
  const std::int64_t width = qkv_width(op, C, NH, NKV);
  const DType act = op.activation(qkv);
  op.expect("out", out, act, {B, T, C});
  op.expect("qkv", qkv, act, {B, T, width});
  op.expect("lse", lse, DType::f32, {B, NH, T});
  if (segments.data && qkv.device == Device::cuda) {
    // The document mask on the GPU: context parallelism's block kernels with one block of every
    // key (fp32 results; bf16's out rounded once from them).
    expect_segments(op, segments, B, T);
    const Chunks all{as_int(T), 0};
    if (act == DType::f32) return attention_block_forward(out, lse, qkv, qkv, all, all, NH, NKV, segments);
    const Buffer wide(Device::cuda, std::size_t(out.numel()) * sizeof(float));
    const Tensor out32(wide.data(), DType::f32, Device::cuda, {B, T, C});
    attention_block_forward(out32, lse, qkv, qkv, all, all, NH, NKV, segments);
    return convert(out, out32);
  }
  if (segments.data) {  // the document mask on the CPU
    expect_segments(op, segments, B, T);
    return op.run(dispatch::Kernels{LLMTRAIN_CPU_KERNEL(flash_attention_forward), dispatch::NoKernel{}}, act,
                  [&](auto v) {
                    return std::tuple(v.out(out), v.f32(lse), v.in(qkv), as_int(B), as_int(T), as_int(C), NH, NKV,
                                      v.i32(segments));
                  });
  }
  const auto args = [&](auto v) {
    return std::tuple(v.out(out), v.f32(lse), v.in(qkv), as_int(B), as_int(T), as_int(C), NH, NKV);
  };
  // The CPU reference serves both choices; cuDNN has bf16 kernels only.
  if (kernels == AttentionKernels::cudnn) {
    return op.run(dispatch::Kernels{LLMTRAIN_CPU_KERNEL(flash_attention_forward),
                                    LLMTRAIN_CUDA_KERNEL(cudnn_attention_forward)}, act, args);
  }
  op.run(LLMTRAIN_KERNELS(flash_attention_forward), act, args);
}

void flash_attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                              const Tensor& lse, int NH, int NKV, AttentionKernels kernels, Accumulate dqkv_mode,
                              const Tensor& segments) {
  const Op op("flash_attention_backward");
  const auto B = dout.shape[0], T = dout.shape[1], C = dout.shape[2];
  const std::int64_t width = qkv_width(op, C, NH, NKV);
  const DType act = op.activation(qkv);
  op.expect("dout", dout, act, {B, T, C});
  op.expect("out", out, act, {B, T, C});
  op.expect("qkv", qkv, act, {B, T, width});
  op.expect("dqkv", dqkv, act, {B, T, width});
  op.expect("lse", lse, DType::f32, {B, NH, T});
  if (segments.data && qkv.device == Device::cuda) {  // as the forward: the block kernels, fp32 gradients
    expect_segments(op, segments, B, T);
    const Chunks all{as_int(T), 0};
    if (act == DType::f32) {
      if (dqkv_mode == Accumulate::no) zero(dqkv);
      return attention_block_backward(dqkv, dqkv, dout, qkv, out, lse, qkv, all, all, NH, NKV, segments);
    }
    const Buffer wide(Device::cuda, std::size_t(dqkv.numel()) * sizeof(float));
    const Tensor dqkv32(wide.data(), DType::f32, Device::cuda, {B, T, width});
    if (dqkv_mode == Accumulate::yes) {
      convert(dqkv32, dqkv);
    } else {
      zero(dqkv32);
    }
    attention_block_backward(dqkv32, dqkv32, dout, qkv, out, lse, qkv, all, all, NH, NKV, segments);
    return convert(dqkv, dqkv32);
  }
  if (segments.data) {
    expect_segments(op, segments, B, T);
    return op.run(dispatch::Kernels{LLMTRAIN_CPU_KERNEL(flash_attention_backward), dispatch::NoKernel{}}, act,
                  [&](auto v) {
                    return std::tuple(v.out(dqkv), v.in(dout), v.in(qkv), v.in(out), v.f32(lse), as_int(B),
                                      as_int(T), as_int(C), NH, NKV, dqkv_mode == Accumulate::yes, v.i32(segments));
                  });
  }
  const auto args = [&](auto v) {
    return std::tuple(v.out(dqkv), v.in(dout), v.in(qkv), v.in(out), v.f32(lse), as_int(B), as_int(T), as_int(C),
                      NH, NKV, dqkv_mode == Accumulate::yes);
  };
  if (kernels == AttentionKernels::cudnn) {
    return op.run(dispatch::Kernels{LLMTRAIN_CPU_KERNEL(flash_attention_backward),
                                    LLMTRAIN_CUDA_KERNEL(cudnn_attention_backward)}, act, args);
  }
  op.run(LLMTRAIN_KERNELS(flash_attention_backward), act, args);
}

namespace {

void expect_chunks(const Op& op, const char* name, const Chunks& at, std::int64_t T) {
  if (at.len < 1 || at.first < 0 || at.rows() != T) op.fail(std::string(name) + ": chunks do not cover the rows");
}
}  // namespace

void attention_block_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, const Tensor& kv,
                             const Chunks& q_at, const Chunks& k_at, int NH, int NKV, const Tensor& segments) {
  const Op op("attention_block_forward");
  const auto B = qkv.shape[0], Tq = qkv.shape[1], Tk = kv.shape[1], C = out.shape[2];
  const std::int64_t expected = qkv_width(op, C, NH, NKV), kv_cols = 2 * (C / NH) * NKV;
  const DType act = op.activation(qkv);
  op.expect("qkv", qkv, act, {B, Tq, expected});
  if (kv.ndim != 3 || (kv.shape[2] != expected && kv.shape[2] != kv_cols)) op.fail("kv: not a key/value block");
  op.expect("kv", kv, act, {B, Tk, kv.shape[2]});
  op.expect("out", out, DType::f32, {B, Tq, C});
  op.expect("lse", lse, DType::f32, {B, NH, Tq});
  expect_chunks(op, "q_at", q_at, Tq);
  expect_chunks(op, "k_at", k_at, Tk);
  if (segments.data) expect_segments(op, segments, B, segments.shape[1]);
  const int T = segments.data ? as_int(segments.shape[1]) : 0;
  op.run(LLMTRAIN_KERNELS(attention_block_forward), act, [&](auto v) {
    return std::tuple(v.f32(out), v.f32(lse), v.in(qkv), v.in(kv), as_int(B), as_int(Tq), as_int(Tk), as_int(C), NH,
                      NKV, as_int(kv.shape[2]), q_at, k_at, segment_ids(v, segments), T);
  });
}

void attention_block_backward(const Tensor& dq, const Tensor& dkv, const Tensor& dout, const Tensor& qkv,
                              const Tensor& out, const Tensor& lse, const Tensor& kv, const Chunks& q_at,
                              const Chunks& k_at, int NH, int NKV, const Tensor& segments) {
  const Op op("attention_block_backward");
  const auto B = dout.shape[0], Tq = dout.shape[1], C = dout.shape[2], Tk = kv.shape[1];
  const std::int64_t width = qkv_width(op, C, NH, NKV), kv_cols = 2 * (C / NH) * NKV;
  const DType act = op.activation(qkv);
  op.expect("dout", dout, act, {B, Tq, C});
  op.expect("out", out, act, {B, Tq, C});
  op.expect("qkv", qkv, act, {B, Tq, width});
  if (kv.ndim != 3 || (kv.shape[2] != width && kv.shape[2] != kv_cols)) op.fail("kv: not a key/value block");
  op.expect("kv", kv, act, {B, Tk, kv.shape[2]});
  op.expect("dq", dq, DType::f32, {B, Tq, width});
  op.expect("dkv", dkv, DType::f32, {B, Tk, kv.shape[2]});
  op.expect("lse", lse, DType::f32, {B, NH, Tq});
  expect_chunks(op, "q_at", q_at, Tq);
  expect_chunks(op, "k_at", k_at, Tk);
  if (dq.data == dkv.data && kv.shape[2] != width) op.fail("dq and dkv may be one tensor only for a packed qkv block");
  if (segments.data) expect_segments(op, segments, B, segments.shape[1]);
  const int T = segments.data ? as_int(segments.shape[1]) : 0;
  op.run(LLMTRAIN_KERNELS(attention_block_backward), act, [&](auto v) {
    return std::tuple(v.f32(dq), v.f32(dkv), v.in(dout), v.in(qkv), v.in(out), v.f32(lse), v.in(kv), as_int(B),
                      as_int(Tq), as_int(Tk), as_int(C), NH, NKV, as_int(kv.shape[2]), q_at, k_at,
                      segment_ids(v, segments), T);
  });
}

void attention_lse_merge(const Tensor& out, const Tensor& lse, const Tensor& block_out, const Tensor& block_lse) {
  const Op op("attention_lse_merge");
  const auto B = out.shape[0], T = out.shape[1], C = out.shape[2], NH = lse.shape[1];
  op.expect("out", out, DType::f32, {B, T, C});
  op.expect("lse", lse, DType::f32, {B, NH, T});
  op.expect("block_out", block_out, DType::f32, {B, T, C});
  op.expect("block_lse", block_lse, DType::f32, {B, NH, T});
  if (NH < 1 || C % NH != 0) op.fail("NH must divide C");
  op.run(LLMTRAIN_KERNELS(attention_lse_merge), DType::f32, [&](auto v) {
    return std::tuple(v.f32(out), v.f32(lse), v.f32(block_out), v.f32(block_lse), as_int(B), as_int(T), as_int(C),
                      as_int(NH));
  });
}

void kv_pack(const Tensor& kv, const Tensor& qkv, int NH, int NKV) {
  const Op op("kv_pack");
  const auto B = kv.shape[0], T = kv.shape[1];
  if (NKV == 0) NKV = NH;
  const std::int64_t width = qkv.shape[2], HS = width / (NH + 2 * NKV), C = NH * HS, KVC = NKV * HS;
  const DType act = op.activation(qkv);
  op.expect("qkv", qkv, act, {B, T, C + 2 * KVC});
  op.expect("kv", kv, act, {B, T, 2 * KVC});
  op.run(LLMTRAIN_KERNELS(kv_pack), act, [&](auto v) {
    return std::tuple(v.out(kv), v.in(qkv), std::int64_t(B * T), as_int(C), as_int(KVC));
  });
}

void qkv_join(const Tensor& dqkv, const Tensor& dq, const Tensor& dkv, int NH, int NKV) {
  const Op op("qkv_join");
  const auto B = dqkv.shape[0], T = dqkv.shape[1];
  if (NKV == 0) NKV = NH;
  const std::int64_t width = dqkv.shape[2], HS = width / (NH + 2 * NKV), C = NH * HS, KVC = NKV * HS;
  const DType act = op.activation(dqkv);
  op.expect("dqkv", dqkv, act, {B, T, C + 2 * KVC});
  op.expect("dq", dq, DType::f32, {B, T, C + 2 * KVC});
  op.expect("dkv", dkv, DType::f32, {B, T, 2 * KVC});
  op.run(LLMTRAIN_KERNELS(qkv_join), act, [&](auto v) {
    return std::tuple(v.out(dqkv), v.f32(dq), v.f32(dkv), std::int64_t(B * T), as_int(C), as_int(KVC));
  });
}

}  // namespace llmtrain::ops
