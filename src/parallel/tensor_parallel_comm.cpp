#include "parallel/tensor_parallel_comm.h"

#include <algorithm>

#include "core/error.h"
#include "ops/ops.h"

namespace llmtrain::parallel {

Tensor CommTensorGroup::widened(const Tensor& t, std::int64_t room) {
  const std::size_t bytes = std::size_t(t.numel() + room) * sizeof(float);
  if (wide_.bytes() < bytes) wide_ = ops::Buffer(device_, bytes);
  const Tensor wide = wide_.view(DType::f32, {t.numel()});
  ops::convert(wide, Tensor(t.data, t.dtype, t.device, {t.numel()}));
  return wide;
}

// Every collective is queued (dist::Communicator::queue_*): over NCCL it is ordered on the compute
// stream, in the activations' dtype, and the host goes on.
void CommTensorGroup::all_reduce_sum(const Tensor& t) {
  if (comm_.world_size() == 1) return;
  if (t.dtype == DType::f32 || (t.dtype == DType::bf16 && comm_.sums_bf16())) {
    comm_.queue_all_reduce_sum(t.data, t.numel(), t.dtype);
    return;
  }
  const Tensor wide = widened(t);
  comm_.queue_all_reduce_sum(wide.data, t.numel(), DType::f32);
  ops::convert(Tensor(t.data, t.dtype, t.device, {t.numel()}), wide);
}

void CommTensorGroup::all_gather(const Tensor& part, const Tensor& full) {
  if (full.numel() != part.numel() * comm_.world_size() || full.dtype != part.dtype) {
    throw RuntimeError("tensor group: all_gather of mismatched parts");
  }
  comm_.queue_all_gather(part.data, full.data, part.numel(), part.dtype);
}

void CommTensorGroup::reduce_scatter(const Tensor& full, const Tensor& part) {
  if (full.numel() != part.numel() * comm_.world_size() || full.dtype != part.dtype) {
    throw RuntimeError("tensor group: reduce_scatter of mismatched parts");
  }
  if (full.dtype == DType::f32 || (full.dtype == DType::bf16 && comm_.sums_bf16())) {
    comm_.queue_reduce_scatter_sum(full.data, part.data, part.numel(), full.dtype);
    return;
  }
  // bf16 where the communicator sums f32 only: widened, this rank's part received after the input.
  const Tensor wide = widened(full, part.numel());
  float* summed = wide.as<float>() + full.numel();
  comm_.queue_reduce_scatter_sum(wide.data, summed, part.numel(), DType::f32);
  ops::convert(Tensor(part.data, part.dtype, part.device, {part.numel()}),
               Tensor(summed, DType::f32, wide.device, {part.numel()}));
}

void CommTensorGroup::all_reduce_max(const Tensor& t) {
  if (t.dtype != DType::f32) throw RuntimeError("tensor group: all_reduce_max of f32 only");
  if (comm_.world_size() > 1) comm_.all_reduce_max(t.as<float>(), t.numel());
}

std::vector<Placed> place(const std::vector<optim::Piece>& pieces, const std::vector<model::Segment>& segments) {
  std::vector<Placed> out;
  for (const optim::Piece& piece : pieces) {
    // Segments are in local order: the first that ends after the piece begins, onwards.
    auto s = std::upper_bound(segments.begin(), segments.end(), piece.begin,
                              [](std::int64_t at, const model::Segment& seg) { return at < seg.local + seg.length; });
    for (; s != segments.end() && s->local < piece.end; ++s) {
      const std::int64_t lo = std::max(piece.begin, s->local), hi = std::min(piece.end, s->local + s->length);
      if (lo >= hi) continue;
      out.push_back({{s->logical + (lo - s->local), s->logical + (hi - s->local)}, piece.local + (lo - piece.begin)});
    }
  }
  return out;
}

std::vector<model::FlatRange> norm_ranges(const model::Model& model) {
  std::vector<model::FlatRange> out;
  for (const auto& info : model.param_infos()) {
    if (!info.slice.owned_by(model.widths().index())) continue;
    if (!out.empty() && out.back().end == info.offset) {
      out.back().end += info.numel;
    } else {
      out.push_back({info.offset, info.offset + info.numel});
    }
  }
  return out;
}

double sum_squares_in(const Tensor& local, const std::vector<optim::Piece>& pieces,
                      const std::vector<model::FlatRange>& counted) {
  // Every range adds into one sum on the device, read once (not one wait per parameter).
  ops::DeviceSum sum(local.device);
  for (const optim::Piece& piece : pieces) {
    for (const auto& range : counted) {
      const std::int64_t lo = std::max(piece.begin, range.begin), hi = std::min(piece.end, range.end);
      if (lo >= hi) continue;
      ops::sum_squares(Tensor(local.as<float>() + piece.local + (lo - piece.begin), DType::f32, local.device,
                              {hi - lo}),
                       &sum);
    }
  }
  return sum.take();
}

}  // namespace llmtrain::parallel
