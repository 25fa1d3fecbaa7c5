#include "parallel/context_attention.h"

#include <algorithm>
#include <string>
#include <vector>

#include "core/error.h"

namespace llmtrain::parallel {
namespace {

// Block i of `many` (n, B, T, W): (B, T, W).
Tensor block(const Tensor& many, std::int64_t i) {
  const std::int64_t each = many.shape[1] * many.shape[2] * many.shape[3];
  char* at = static_cast<char*>(many.data) + std::size_t(i * each) * dtype_size(many.dtype);
  return Tensor(at, many.dtype, many.device, {many.shape[1], many.shape[2], many.shape[3]});
}

Tensor flat(const Tensor& t) { return Tensor(t.data, t.dtype, t.device, {t.numel()}); }

}  // namespace

ops::Chunks ContextAttention::chunks(int rank, int T) const {
  if (size_ == 1) return {T, 0, -1};
  const int len = T / (2 * size_);
  return {len, rank, 2 * size_ - 1 - rank};
}

void ContextAttention::check_length(int T) const {
  if (size_ > 1 && T % (2 * size_) != 0) {
    throw InputError("dist.context_parallel = " + std::to_string(size_) + ": a sequence of " + std::to_string(T) +
                     " tokens does not split into 2 x dist.context_parallel chunks (model.context_length)");
  }
}

ContextGroup& ContextAttention::group() const {
  if (!group_) throw RuntimeError("context parallelism: no context group was set");
  return *group_;
}

void ContextAttention::sum(std::vector<double>& values) {
  if (size_ > 1) group().sum(values);
}

namespace {
constexpr std::size_t work_align = 256;
std::size_t aligned(std::size_t bytes) { return (bytes + work_align - 1) / work_align * work_align; }
}  // namespace

std::vector<Tensor> ContextAttention::forward_work(int size, bool ring, DType compute, DType out, std::int64_t B,
                                                  std::int64_t Tl, std::int64_t NH, std::int64_t NKV, std::int64_t C) {
  const std::int64_t KVC = C / NH * NKV;
  // The key/value blocks (ring: 2 in flight; all-gather: every rank's and this rank's), one
  // block's result and log-sum-exps, and the running result unless out is f32.
  return {Tensor(nullptr, compute, Device::cpu, {ring ? 2 : size + 1, B, Tl, 2 * KVC}),
          Tensor(nullptr, DType::f32, Device::cpu, {B, Tl, C}), Tensor(nullptr, DType::f32, Device::cpu, {B, NH, Tl}),
          Tensor(nullptr, DType::f32, Device::cpu, {B, Tl, out == DType::f32 ? 0 : C})};
}

std::vector<Tensor> ContextAttention::backward_work(int size, bool ring, DType compute, DType dqkv, std::int64_t B,
                                                   std::int64_t Tl, std::int64_t NH, std::int64_t NKV, std::int64_t C) {
  const std::int64_t KVC = C / NH * NKV, W = C + 2 * KVC;
  // The blocks again, their f32 gradients (ring: 2 travelling; all-gather: every rank's and this
  // rank's share), and the f32 query gradients unless dqkv is f32.
  return {Tensor(nullptr, compute, Device::cpu, {ring ? 2 : size + 1, B, Tl, 2 * KVC}),
          Tensor(nullptr, DType::f32, Device::cpu, {ring ? 2 : size + 1, B, Tl, 2 * KVC}),
          Tensor(nullptr, DType::f32, Device::cpu, {B, Tl, dqkv == DType::f32 ? 0 : W})};
}

std::size_t ContextAttention::work_bytes(const std::vector<Tensor>& shapes) {
  std::size_t total = 0;
  for (const Tensor& t : shapes) total += aligned(t.bytes());
  return total;
}

std::size_t ContextAttention::own_work_bytes(const model::AttentionRoom& room, int size, bool ring, DType compute) {
  if (size <= 1) return 0;
  const std::size_t forward =
      work_bytes(forward_work(size, ring, compute, compute, room.B, room.Tl, room.NH, room.NKV, room.C));
  const std::size_t backward =
      work_bytes(backward_work(size, ring, compute, room.dqkv, room.B, room.Tl, room.NH, room.NKV, room.C));
  const std::size_t own_forward = forward > room.forward_free ? forward : 0;
  const std::size_t own_backward = backward > room.backward_free ? backward : 0;
  return std::max(own_forward, own_backward);
}

std::vector<Tensor> ContextAttention::work(const std::vector<Tensor>& shapes, const Tensor& free) {
  const std::size_t total = work_bytes(shapes);
  char* base = nullptr;
  if (free.data && free.device == device_ && free.bytes() >= total) {
    base = static_cast<char*>(free.data);
  } else {
    if (work_.bytes() < total) {
      work_ = ops::Buffer();
      work_ = ops::Buffer(device_, total);
    }
    base = static_cast<char*>(work_.data());
  }
  std::vector<Tensor> out;
  std::size_t used = 0;
  for (const Tensor& t : shapes) {
    Tensor carved = t;
    carved.data = base + used;
    carved.device = device_;
    out.push_back(carved);
    used += aligned(t.bytes());
  }
  return out;
}

void ContextAttention::attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, int NH, int NKV,
                                         const Tensor& segments, const Tensor& free) {
  const std::int64_t B = qkv.shape[0], Tl = qkv.shape[1], C = out.shape[2], KVC = C / NH * NKV;
  const int n = size_, r = rank_, next = (r + 1) % n, prev = (r + n - 1) % n;
  const ops::Chunks me = rows(int(Tl) * n);
  // The running result accumulates in out itself when that is f32.
  const bool f32_out = out.dtype == DType::f32;
  const std::vector<Tensor> w = work(forward_work(n, ring_, compute_, out.dtype, B, Tl, NH, NKV, C), free);
  const Tensor &blocks = w[0], &part = w[1], &part_lse = w[2];
  const Tensor acc = f32_out ? out : w[3];
  if (ring_) {
    // Block s comes from rank r - s; the next one travels while this one computes. This rank's
    // own block is sent from the second buffer (the first receive goes to the first) and attended
    // to in place, in qkv. The waits are stream-ordered (queue_wait: no host wait per step on a
    // GPU); the two buffers are still safe to alternate: exchange s receives into the buffer
    // step s - 1 attended to, and starts after the work given before it, that attention included;
    // step s's attention comes after the wait for exchange s - 1, which filled its block.
    ops::kv_pack(block(blocks, 1), qkv, NH, NKV);
    std::unique_ptr<ContextGroup::Pending> pending = group().start_exchange(block(blocks, 1), block(blocks, 0), next, prev);
    ops::attention_block_forward(acc, lse, qkv, qkv, me, me, NH, NKV, segments);
    for (int s = 1; s < n; ++s) {
      pending->queue_wait();
      const Tensor current = block(blocks, (s - 1) % 2);
      pending.reset();
      if (s + 1 < n) pending = group().start_exchange(current, block(blocks, s % 2), next, prev);
      ops::attention_block_forward(part, part_lse, qkv, current, me, chunks((r + n - s) % n, int(Tl) * n), NH, NKV, segments);
      ops::attention_lse_merge(acc, lse, part, part_lse);
    }
  } else {
    // Blocks 0 .. n-1: every rank's; block n: this rank's, packed.
    const Tensor own = block(blocks, n);
    const Tensor all(blocks.data, blocks.dtype, device_, {n, B, Tl, 2 * KVC});
    ops::kv_pack(own, qkv, NH, NKV);
    group().all_gather(flat(own), flat(all));
    for (int j = 0; j < n; ++j) {
      const ops::Chunks theirs = chunks(j, int(Tl) * n);
      if (j == 0) {
        ops::attention_block_forward(acc, lse, qkv, block(all, j), me, theirs, NH, NKV, segments);
        continue;
      }
      ops::attention_block_forward(part, part_lse, qkv, block(all, j), me, theirs, NH, NKV, segments);
      ops::attention_lse_merge(acc, lse, part, part_lse);
    }
  }
  if (!f32_out) ops::convert(flat(out), flat(acc));
}

void ContextAttention::attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                                          const Tensor& lse, int NH, int NKV, const Tensor& segments,
                                          const Tensor& free) {
  const std::int64_t B = qkv.shape[0], Tl = qkv.shape[1], C = dout.shape[2], KVC = C / NH * NKV;
  const int n = size_, r = rank_, next = (r + 1) % n, prev = (r + n - 1) % n;
  const ops::Chunks me = rows(int(Tl) * n);
  // The query gradients (and, ring, this rank's own block's key/value gradients, in its columns)
  // accumulate in dqkv itself when that is f32.
  const bool f32_grad = dqkv.dtype == DType::f32;
  const std::vector<Tensor> w = work(backward_work(n, ring_, compute_, dqkv.dtype, B, Tl, NH, NKV, C), free);
  const Tensor &blocks = w[0], &grads = w[1];
  const Tensor dq = f32_grad ? dqkv : w[2];
  ops::zero(dq);
  if (ring_) {
    // The key/value blocks go round again; block s's gradient accumulator starts at the rank
    // after its owner, takes each rank's share in turn and reaches the owner after the last.
    // Stream-ordered waits, as forward: an accumulator is added to only after the wait for the
    // exchange that brought it, and the one sent at step s is received into again only by the
    // exchange of step s + 1, which starts after the work given before it.
    ops::kv_pack(block(blocks, 1), qkv, NH, NKV);
    std::unique_ptr<ContextGroup::Pending> pending = group().start_exchange(block(blocks, 1), block(blocks, 0), next, prev);
    std::unique_ptr<ContextGroup::Pending> returning;
    ops::attention_block_backward(dq, dq, dout, qkv, out, lse, qkv, me, me, NH, NKV, segments);
    for (int s = 1; s < n; ++s) {
      pending->queue_wait();
      pending.reset();
      const Tensor current = block(blocks, (s - 1) % 2);
      if (s + 1 < n) pending = group().start_exchange(current, block(blocks, s % 2), next, prev);
      const Tensor accumulator = block(grads, (s - 1) % 2);
      if (s == 1) {
        ops::zero(accumulator);
      } else {
        returning->queue_wait();
        returning.reset();
      }
      ops::attention_block_backward(dq, accumulator, dout, qkv, out, lse, current, me,
                                    chunks((r + n - s) % n, int(Tl) * n), NH, NKV, segments);
      returning = group().start_exchange(accumulator, block(grads, s % 2), next, prev);
    }
    returning->queue_wait();
    // This rank's key/value gradients: its own block's share (dq's key/value columns) and the
    // other ranks' (the accumulator that came back), summed in the accumulator no longer in use.
    const Tensor mine_back = block(grads, (n - 1) % 2), total = block(grads, n % 2);
    ops::kv_pack(total, dq, NH, NKV);
    ops::residual_forward(flat(total), flat(total), flat(mine_back));
    ops::qkv_join(dqkv, dq, total, NH, NKV);
  } else {
    // Blocks 0 .. n-1: every rank's and their gradients; block n: this rank's, packed, and its share.
    const Tensor own = block(blocks, n), dkv = block(grads, n);
    const Tensor all(blocks.data, blocks.dtype, device_, {n, B, Tl, 2 * KVC});
    const Tensor all_grads(grads.data, DType::f32, device_, {n, B, Tl, 2 * KVC});
    ops::kv_pack(own, qkv, NH, NKV);
    group().all_gather(flat(own), flat(all));
    ops::zero(all_grads);
    for (int j = 0; j < n; ++j) {
      ops::attention_block_backward(dq, block(all_grads, j), dout, qkv, out, lse, block(all, j), me,
                                    chunks(j, int(Tl) * n), NH, NKV, segments);
    }
    group().reduce_scatter(flat(all_grads), flat(dkv));
    ops::qkv_join(dqkv, dq, dkv, NH, NKV);
  }
}

double ContextAttention::sent_bytes(const model::AttentionRoom& room, int size, std::size_t element, bool backward) {
  const double kv_width = 2.0 * double(room.NKV) * double(room.C / room.NH);
  const double block = double(room.B) * double(room.Tl) * kv_width;
  return double(size - 1) * block * double(backward ? element + sizeof(float) : element);
}

}  // namespace llmtrain::parallel
