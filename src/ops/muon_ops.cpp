// Muon's ops: their checks, then their kernels and arguments (dispatch.h).
#include "ops/muon_ops.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "llmtrain/kernels/cpu.h"
#include "ops/dispatch.h"
#include "ops/ops.h"
#if LLMTRAIN_HAVE_CUDA
#include "device/runtime.h"
#endif

namespace llmtrain::ops {

using dispatch::as_int;
using dispatch::Op;

void muon_momentum(const Tensor& buf, const Tensor& grad, const Tensor& u, float momentum, bool nesterov,
                   float grad_scale) {
  const Op op("muon_momentum");
  const DType act = op.expect_same_size({&buf, &grad, &u}, /*f32_only=*/true);
  op.run(LLMTRAIN_KERNELS(muon_momentum), act, [&](auto view) {
    return std::tuple(view.f32(buf), view.f32(grad), view.f32(u), buf.numel(), momentum, int(nesterov), grad_scale);
  });
}

void muon_apply(const Tensor& param, const Tensor& o, const Tensor& working, float keep, float step) {
  const Op op("muon_apply");
  op.expect_same_size({&param, &o}, /*f32_only=*/true);
  const std::int64_t N = param.numel();
  const bool on_gpu = working.data ? op.on_cuda({&param, &o, &working}) : op.on_cuda({&param, &o});
  // The working copy: bf16 (f32 too on the CPU, where a bf16 run's reference keeps f32 values).
  const bool f32_copy = working.data && working.dtype == DType::f32 && !on_gpu;
  if (working.data && ((working.dtype != DType::bf16 && !f32_copy) || working.numel() != N)) {
    op.fail("expected a bf16 working copy of " + std::to_string(N) + " elements, got " + working.describe());
  }
  if (on_gpu) {
#if LLMTRAIN_HAVE_CUDA
    return op.guarded([&] {
      cuda::muon_apply(param.as<float>(), o.as<float>(), working.data ? working.as<cuda::bf16>() : nullptr, N, keep,
                       step, device::compute_stream());
    });
#endif
  }
  // The CPU reference: the update, then the working copy (convert's rounding for bf16).
  cpu::muon_apply(param.as<float>(), o.as<float>(), N, keep, step);
  if (!working.data) return;
  if (f32_copy) {
    const float* x = param.as<float>();
    std::copy(x, x + N, working.as<float>());
    return;
  }
  convert(working, param);
}

void batched_matmul(const Tensor& out, const Tensor& inp, const Tensor& weight, bool transpose_weight) {
  const Op op("batched_matmul");
  const std::int64_t B = inp.shape[0], M = inp.shape[1], K = inp.shape[2];
  const std::int64_t N = transpose_weight ? weight.shape[1] : weight.shape[2];
  const DType act = op.activation(inp);
  op.expect("inp", inp, act, {B, M, K});
  op.expect("weight", weight, act,
            transpose_weight ? std::vector<std::int64_t>{B, N, K} : std::vector<std::int64_t>{B, K, N});
  op.expect("out", out, act, {B, M, N});
  if (K < 1) op.fail("inp has rows of no elements");
  if (std::max({M, N, K}) > INT_MAX) op.fail("a matrix dimension over 2^31 - 1");
  if (out.data == inp.data || out.data == weight.data) op.fail("out must not be inp or weight");
  op.run(LLMTRAIN_MATMUL_KERNELS(batched_matmul), act, [&](auto v) {
    return std::tuple(v.out(out), v.in(inp), v.in(weight), B, as_int(M), as_int(N), as_int(K),
                      transpose_weight);
  });
}

void newton_schulz_normalise(const Tensor& x, const Tensor& u, const DeviceSum& squares, double eps) {
  const Op op("newton_schulz_normalise");
  const std::int64_t rows = u.shape[0], cols = u.shape[1];
  const DType act = op.activation(x);
  op.expect("u", u, DType::f32, {rows, cols});
  op.expect("x", x, act, {std::min(rows, cols), std::max(rows, cols)});
  if (squares.device() != u.device) op.fail("the sum of squares is on another device than u");
  op.run(LLMTRAIN_KERNELS(newton_schulz_normalise), act, [&](auto v) {
    return std::tuple(v.out(x), v.f32(u), static_cast<const double*>(squares.data()), rows, cols, eps);
  });
}

void transpose(const Tensor& out, const Tensor& inp) {
  const Op op("transpose");
  const std::int64_t N = inp.shape[0], C = inp.shape[1];
  const DType act = op.activation(inp);
  op.expect("inp", inp, act, {N, C});
  op.expect("out", out, act, {C, N});
  op.run(LLMTRAIN_KERNELS(transpose), act, [&](auto v) { return std::tuple(v.out(out), v.in(inp), N, C); });
}

void scaled_sum(const Tensor& out, const Tensor& x, const Tensor& y, float alpha, float beta) {
  const Op op("scaled_sum");
  const DType act = op.expect_same_size({&out, &x, &y});
  if (out.data == x.data || out.data == y.data) op.fail("out must not be x or y");
  op.run(LLMTRAIN_KERNELS(scaled_sum), act,
         [&](auto v) { return std::tuple(v.out(out), v.in(x), v.in(y), out.numel(), alpha, beta); });
}

}  // namespace llmtrain::ops
