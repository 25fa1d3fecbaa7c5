#include "model/context_parallel.h"

#include <string>

#include "core/error.h"

namespace llmtrain::model {
namespace {

// Block i of `many` (n, B, T, W): (B, T, W).
Tensor block(const Tensor& many, std::int64_t i) {
  const std::int64_t each = many.shape[1] * many.shape[2] * many.shape[3];
  char* at = static_cast<char*>(many.data) + std::size_t(i * each) * dtype_size(many.dtype);
  return Tensor(at, many.dtype, many.device, {many.shape[1], many.shape[2], many.shape[3]});
}

Tensor flat(const Tensor& t) { return Tensor(t.data, t.dtype, t.device, {t.numel()}); }

}  // namespace

ops::Chunks ContextParallel::chunks(int rank, int T) const {
  if (size_ == 1) return {T, 0, -1};
  const int len = T / (2 * size_);
  return {len, rank, 2 * size_ - 1 - rank};
}

void ContextParallel::check_length(int T) const {
  if (size_ > 1 && T % (2 * size_) != 0) {
    throw InputError("dist.context_parallel = " + std::to_string(size_) + ": a sequence of " + std::to_string(T) +
                     " tokens does not split into 2 x dist.context_parallel chunks (model.context_length)");
  }
}

void ContextParallel::take_rows(const std::int32_t* in, int B, int T, std::vector<std::int32_t>& out) const {
  check_length(T);
  const ops::Chunks at = mine(T);
  const int Tl = at.rows();
  out.resize(std::size_t(B) * std::size_t(Tl));
  for (int b = 0; b < B; ++b) {
    for (int i = 0; i < at.count(); ++i) {
      const std::int32_t* from = in + std::int64_t(b) * T + at.start(i);
      std::copy(from, from + at.len, out.begin() + std::int64_t(b) * Tl + std::int64_t(i) * at.len);
    }
  }
}

ContextGroup& ContextParallel::group() const {
  if (!group_) throw RuntimeError("context parallelism: no context group was set");
  return *group_;
}

Tensor ContextParallel::scratch(ops::Buffer& buffer, DType dtype, std::initializer_list<std::int64_t> shape) {
  const Tensor wanted(nullptr, dtype, device_, shape);
  if (buffer.bytes() < wanted.bytes()) {
    buffer = ops::Buffer();
    buffer = ops::Buffer(device_, wanted.bytes());
  }
  return Tensor(buffer.data(), dtype, device_, shape);
}

void ContextParallel::attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, int NH, int NKV) {
  const std::int64_t B = qkv.shape[0], Tl = qkv.shape[1], C = out.shape[2], KVC = C / NH * NKV;
  const int n = size_, r = rank_, next = (r + 1) % n, prev = (r + n - 1) % n;
  const ops::Chunks me = mine(int(Tl) * n);
  const Tensor kv = scratch(kv_own_, compute_, {B, Tl, 2 * KVC});
  const Tensor acc = scratch(acc_out_, DType::f32, {B, Tl, C});
  const Tensor part = scratch(block_out_, DType::f32, {B, Tl, C});
  const Tensor part_lse = scratch(block_lse_, DType::f32, {B, NH, Tl});
  ops::kv_pack(kv, qkv, NH, NKV);
  if (ring_) {
    // Block s comes from rank r - s; the next one travels while this one computes.
    const Tensor blocks = scratch(kv_blocks_, compute_, {2, B, Tl, 2 * KVC});
    std::unique_ptr<ContextGroup::Pending> pending = group().start_exchange(kv, block(blocks, 0), next, prev);
    ops::attention_block_forward(acc, lse, qkv, kv, me, me, NH, NKV);
    for (int s = 1; s < n; ++s) {
      pending->wait();
      const Tensor current = block(blocks, (s - 1) % 2);
      pending.reset();
      if (s + 1 < n) pending = group().start_exchange(current, block(blocks, s % 2), next, prev);
      ops::attention_block_forward(part, part_lse, qkv, current, me, chunks((r + n - s) % n, int(Tl) * n), NH, NKV);
      ops::attention_lse_merge(acc, lse, part, part_lse);
    }
  } else {
    const Tensor all = scratch(kv_blocks_, compute_, {n, B, Tl, 2 * KVC});
    group().all_gather(flat(kv), flat(all));
    for (int j = 0; j < n; ++j) {
      const ops::Chunks theirs = chunks(j, int(Tl) * n);
      if (j == 0) {
        ops::attention_block_forward(acc, lse, qkv, block(all, j), me, theirs, NH, NKV);
        continue;
      }
      ops::attention_block_forward(part, part_lse, qkv, block(all, j), me, theirs, NH, NKV);
      ops::attention_lse_merge(acc, lse, part, part_lse);
    }
  }
  if (out.dtype == DType::f32) {
    ops::copy(flat(out), flat(acc));
  } else {
    ops::convert(flat(out), flat(acc));
  }
}

void ContextParallel::attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                                         const Tensor& lse, int NH, int NKV) {
  const std::int64_t B = qkv.shape[0], Tl = qkv.shape[1], W = qkv.shape[2], C = dout.shape[2], KVC = C / NH * NKV;
  const int n = size_, r = rank_, next = (r + 1) % n, prev = (r + n - 1) % n;
  const ops::Chunks me = mine(int(Tl) * n);
  const Tensor kv = scratch(kv_own_, compute_, {B, Tl, 2 * KVC});
  const Tensor dq = scratch(dq_, DType::f32, {B, Tl, W});
  const Tensor dkv = scratch(dkv_own_, DType::f32, {B, Tl, 2 * KVC});
  ops::zero(dq);
  ops::kv_pack(kv, qkv, NH, NKV);
  if (ring_) {
    // The key/value blocks go round again; block s's gradient accumulator starts at the rank
    // after its owner, takes each rank's share in turn and reaches the owner after the last.
    const Tensor blocks = scratch(kv_blocks_, compute_, {2, B, Tl, 2 * KVC});
    const Tensor grads = scratch(dkv_blocks_, DType::f32, {2, B, Tl, 2 * KVC});
    ops::zero(dkv);
    std::unique_ptr<ContextGroup::Pending> pending = group().start_exchange(kv, block(blocks, 0), next, prev);
    std::unique_ptr<ContextGroup::Pending> returning;
    ops::attention_block_backward(dq, dkv, dout, qkv, out, lse, kv, me, me, NH, NKV);
    for (int s = 1; s < n; ++s) {
      pending->wait();
      pending.reset();
      const Tensor current = block(blocks, (s - 1) % 2);
      if (s + 1 < n) pending = group().start_exchange(current, block(blocks, s % 2), next, prev);
      const Tensor accumulator = block(grads, (s - 1) % 2);
      if (s == 1) {
        ops::zero(accumulator);
      } else {
        returning->wait();
        returning.reset();
      }
      ops::attention_block_backward(dq, accumulator, dout, qkv, out, lse, current, me,
                                    chunks((r + n - s) % n, int(Tl) * n), NH, NKV);
      returning = group().start_exchange(accumulator, block(grads, s % 2), next, prev);
    }
    returning->wait();
    const Tensor mine_back = block(grads, (n - 1) % 2);
    ops::residual_forward(flat(dkv), flat(dkv), flat(mine_back));
  } else {
    const Tensor all = scratch(kv_blocks_, compute_, {n, B, Tl, 2 * KVC});
    const Tensor grads = scratch(dkv_blocks_, DType::f32, {n, B, Tl, 2 * KVC});
    group().all_gather(flat(kv), flat(all));
    ops::zero(grads);
    for (int j = 0; j < n; ++j) {
      ops::attention_block_backward(dq, block(grads, j), dout, qkv, out, lse, block(all, j), me, chunks(j, int(Tl) * n),
                                    NH, NKV);
    }
    group().reduce_scatter(flat(grads), flat(dkv));
  }
  ops::qkv_join(dqkv, dq, dkv, NH, NKV);
}

double ContextParallel::ring_forward_bytes(int size, std::int64_t B, std::int64_t Tl, std::int64_t kv_width,
                                           std::size_t element) {
  return double(size - 1) * double(B * Tl * kv_width) * double(element);
}

double ContextParallel::ring_backward_bytes(int size, std::int64_t B, std::int64_t Tl, std::int64_t kv_width,
                                            std::size_t element) {
  return double(size - 1) * double(B * Tl * kv_width) * double(element + sizeof(float));
}

}  // namespace llmtrain::model
