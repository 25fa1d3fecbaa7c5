// The Mixture-of-Experts ops: their checks, then their kernels and arguments (dispatch.h).
#include "ops/moe_ops.h"

#include <tuple>

#include "llmtrain/kernels/cpu.h"
#include "ops/dispatch.h"

namespace llmtrain::ops {

using dispatch::as_int;
using dispatch::Op;

void moe_router_forward(const Tensor& probs, const Tensor& experts, const Tensor& weights, const Tensor& counts,
                        const Tensor& pbar, const Tensor& losses, const Tensor& logits, const Tensor& bias, const RouterKind& kind) {
  const Op op("moe_router_forward");
  const auto N = logits.shape[0], E = logits.shape[1], k = experts.shape[1];
  const DType act = op.activation(logits);
  op.expect("logits", logits, act, {N, E});
  op.expect("probs", probs, DType::f32, {N, E});
  op.expect("experts", experts, DType::i32, {N, k});
  op.expect("weights", weights, DType::f32, {N, k});
  op.expect("counts", counts, DType::f32, {E});
  op.expect("pbar", pbar, DType::f32, {E});
  op.expect("losses", losses, DType::f32, {3});
  if (bias.data) op.expect("bias", bias, act, {E});
  if (k < 1 || k > E) op.fail("top k must be in [1, E]");
  op.run(LLMTRAIN_KERNELS(moe_router_forward), act, [&](auto v) {
    return std::tuple(v.f32(probs), v.i32(experts), v.f32(weights), v.f32(counts), v.f32(pbar), v.f32(losses),
                      v.in(logits),
                      v.in(bias), N, as_int(E), as_int(k), kind.sigmoid, kind.normalize, kind.route_scale);
  });
}

void moe_router_backward(const Tensor& dlogits, const Tensor& dweights, const Tensor& logits, const Tensor& probs,
                         const Tensor& experts, const Tensor& counts, const RouterKind& kind, float aux_scale,
                         float z_scale) {
  const Op op("moe_router_backward");
  const auto N = logits.shape[0], E = logits.shape[1], k = experts.shape[1];
  const DType act = op.activation(logits);
  op.expect("dlogits", dlogits, act, {N, E});
  op.expect("dweights", dweights, DType::f32, {N, k});
  op.expect("probs", probs, DType::f32, {N, E});
  op.expect("experts", experts, DType::i32, {N, k});
  op.expect("counts", counts, DType::f32, {E});
  op.run(LLMTRAIN_KERNELS(moe_router_backward), act, [&](auto v) {
    return std::tuple(v.out(dlogits), v.f32(dweights), v.in(logits), v.f32(probs), v.i32(experts), v.f32(counts), N,
                      as_int(E), as_int(k), kind.sigmoid, kind.normalize, kind.route_scale, aux_scale, z_scale);
  });
}

void moe_dispatch(const Tensor& offsets, const Tensor& row_slot, const Tensor& slot_row, const Tensor& dropped,
                  const Tensor& experts, std::int64_t capacity) {
  const Op op("moe_dispatch");
  const auto N = experts.shape[0], k = experts.shape[1], E = offsets.shape[0] - 1;
  op.expect("experts", experts, DType::i32, {N, k});
  op.expect("offsets", offsets, DType::i32, {E + 1});
  op.expect("row_slot", row_slot, DType::i32, {N * k});
  op.expect("slot_row", slot_row, DType::i32, {N * k});
  op.expect("dropped", dropped, DType::f32, {1});
  if (E < 1) op.fail("no experts");
  op.run(LLMTRAIN_KERNELS(moe_dispatch), DType::f32, [&](auto v) {
    return std::tuple(v.i32(offsets), v.i32(row_slot), v.i32(slot_row), v.f32(dropped), v.i32(experts), N, as_int(E),
                      as_int(k), capacity);
  });
}

void moe_permute_forward(const Tensor& xp, const Tensor& x, const Tensor& row_slot, const Tensor& offsets) {
  const Op op("moe_permute_forward");
  const auto N = x.shape[0], C = x.shape[1], E = offsets.shape[0] - 1;
  const DType act = op.activation(x);
  op.expect("xp", xp, act, {-1, C});
  const auto k = xp.shape[0] / N;
  op.expect("xp", xp, act, {N * k, C});
  op.expect("row_slot", row_slot, DType::i32, {N * k});
  op.expect("offsets", offsets, DType::i32, {E + 1});
  op.run(LLMTRAIN_KERNELS(moe_permute_forward), act, [&](auto v) {
    return std::tuple(v.out(xp), v.in(x), v.i32(row_slot), v.i32(offsets), N, as_int(E), as_int(k), as_int(C));
  });
}

void moe_permute_backward(const Tensor& dx, const Tensor& dxp, const Tensor& slot_row, Accumulate mode) {
  const Op op("moe_permute_backward");
  const auto N = dx.shape[0], C = dx.shape[1], k = slot_row.shape[0] / N;
  const DType act = op.activation(dx);
  op.expect("dxp", dxp, act, {N * k, C});
  op.expect("slot_row", slot_row, DType::i32, {N * k});
  op.run(LLMTRAIN_KERNELS(moe_permute_backward), act, [&](auto v) {
    return std::tuple(v.out(dx), v.in(dxp), v.i32(slot_row), N, as_int(k), as_int(C), mode == Accumulate::yes);
  });
}

void moe_unpermute_forward(const Tensor& out, const Tensor& y, const Tensor& weights, const Tensor& slot_row) {
  const Op op("moe_unpermute_forward");
  const auto N = out.shape[0], C = out.shape[1], k = weights.shape[1];
  const DType act = op.activation(out);
  op.expect("y", y, act, {N * k, C});
  op.expect("weights", weights, DType::f32, {N, k});
  op.expect("slot_row", slot_row, DType::i32, {N * k});
  op.run(LLMTRAIN_KERNELS(moe_unpermute_forward), act, [&](auto v) {
    return std::tuple(v.out(out), v.in(y), v.f32(weights), v.i32(slot_row), N, as_int(k), as_int(C));
  });
}

void moe_unpermute_backward(const Tensor& dy, const Tensor& dweights, const Tensor& dout, const Tensor& y,
                            const Tensor& weights, const Tensor& row_slot, const Tensor& slot_row,
                            const Tensor& offsets) {
  const Op op("moe_unpermute_backward");
  const auto N = dout.shape[0], C = dout.shape[1], k = weights.shape[1], E = offsets.shape[0] - 1;
  const DType act = op.activation(dout);
  op.expect("dy", dy, act, {N * k, C});
  op.expect("y", y, act, {N * k, C});
  op.expect("dweights", dweights, DType::f32, {N, k});
  op.expect("weights", weights, DType::f32, {N, k});
  op.expect("row_slot", row_slot, DType::i32, {N * k});
  op.expect("slot_row", slot_row, DType::i32, {N * k});
  op.expect("offsets", offsets, DType::i32, {E + 1});
  op.run(LLMTRAIN_KERNELS(moe_unpermute_backward), act, [&](auto v) {
    return std::tuple(v.out(dy), v.f32(dweights), v.in(dout), v.in(y), v.f32(weights), v.i32(row_slot),
                      v.i32(slot_row), v.i32(offsets), N, as_int(E), as_int(k), as_int(C));
  });
}

void moe_bias_update(const Tensor& bias, const Tensor& loads, float mean_load, float rate) {
  const Op op("moe_bias_update");
  const auto n = bias.shape[0];
  op.expect("bias", bias, DType::f32, {n});
  op.expect("loads", loads, DType::f32, {n});
  op.run(LLMTRAIN_KERNELS(moe_bias_update), DType::f32,
         [&](auto v) { return std::tuple(v.f32(bias), v.f32(loads), mean_load, n, rate); });
}

void grouped_matmul_forward(const Tensor& out, const Tensor& inp, const Tensor& weight, const Tensor& offsets) {
  const Op op("grouped_matmul_forward");
  const auto R = inp.shape[0], C = inp.shape[1], E = weight.shape[0], OC = weight.shape[1];
  const DType act = op.activation(inp);
  op.expect("weight", weight, act, {E, OC, C});
  op.expect("out", out, act, {R, OC});
  op.expect("offsets", offsets, DType::i32, {E + 1});
  op.run(LLMTRAIN_KERNELS(grouped_matmul_forward), act, [&](auto v) {
    return std::tuple(v.out(out), v.in(inp), v.in(weight), v.i32(offsets), as_int(E), as_int(C), as_int(OC));
  });
}

void grouped_matmul_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dout, const Tensor& inp,
                             const Tensor& weight, const Tensor& offsets, Accumulate mode) {
  const Op op("grouped_matmul_backward");
  const auto R = inp.shape[0], C = inp.shape[1], E = weight.shape[0], OC = weight.shape[1];
  const DType act = op.activation(inp);
  op.expect("weight", weight, act, {E, OC, C});
  if (!dinp.data && !dweight.data) op.fail("neither dinp nor dweight to compute");
  if (dweight.data) op.expect("dweight", dweight, DType::f32, {E, OC, C});
  if (dinp.data) op.expect("dinp", dinp, act, {R, C});
  op.expect("dout", dout, act, {R, OC});
  op.expect("offsets", offsets, DType::i32, {E + 1});
  op.run(LLMTRAIN_KERNELS(grouped_matmul_backward), act, [&](auto v) {
    return std::tuple(v.out(dinp), v.f32(dweight), v.in(dout), v.in(inp), v.in(weight), v.i32(offsets), as_int(E),
                      as_int(C), as_int(OC), mode == Accumulate::yes);
  });
}

}  // namespace llmtrain::ops
