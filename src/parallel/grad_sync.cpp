#include "parallel/grad_sync.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/crc32.h"
#include "core/error.h"
#include "ops/ops.h"
#include "parallel/expert_parallel_comm.h"
#include "parallel/tensor_parallel_comm.h"

namespace llmtrain::parallel {
namespace {

// Elements [begin, begin + n) of a 1-D tensor.
Tensor slice(const Tensor& t, std::int64_t begin, std::int64_t n) {
  return Tensor(t.as<float>() + begin, t.dtype, t.device, {n});
}

}  // namespace

GradientSync::GradientSync(dist::Communicator& comm, dist::Communicator& host_comm, const Tensor& grads,
                           double bucket_mb, int zero_stage)
    : comm_(comm),
      host_comm_(host_comm),
      grads_(grads.as<float>()),
      P_(grads.numel()),
      // One rank: the shard would be the whole buffer (the same arithmetic as ZeRO 0), and on a
      // GPU there is no device communicator to reduce-scatter with.
      zero_stage_(comm.world_size() == 1 ? 0 : zero_stage),
      device_(grads.device) {
  const int W = comm.world_size();
  if (zero_stage_ == 0) {
    begin_ = 0;
    end_ = P_;
    const auto bucket = std::max<std::int64_t>(1, std::int64_t(bucket_mb * 1024 * 1024 / sizeof(float)));
    for (std::int64_t e = bucket; e < P_ + bucket; e += bucket) bucket_ends_.push_back(std::min(e, P_));
  } else {
    shard_size_ = (P_ + W - 1) / W;  // any parameter count: the last shard is padded
    begin_ = std::min(P_, comm.rank() * shard_size_);
    end_ = std::min(P_, begin_ + shard_size_);
    padded_buffer_ = ops::Buffer(device_, std::size_t(shard_size_ * W) * sizeof(float));
    shard_buffer_ = ops::Buffer(device_, std::size_t(shard_size_) * sizeof(float));
    padded_ = padded_buffer_.view(DType::f32, {shard_size_ * W});
    shard_ = shard_buffer_.view(DType::f32, {shard_size_});
    ops::zero(padded_);  // the padding past P stays zero
    ops::zero(shard_);
  }
}

Tensor GradientSync::grads() const {
  return Tensor(zero_stage_ ? shard_.as<float>() : grads_ + begin_, DType::f32, device_, {end_ - begin_});
}

void GradientSync::on_ready(std::int64_t ready) {
  if (zero_stage_ != 0 || comm_.world_size() == 1) return;
  while (next_bucket_ < bucket_ends_.size() && bucket_ends_[next_bucket_] <= ready) {
    const std::int64_t first = next_bucket_ ? bucket_ends_[next_bucket_ - 1] : 0;
    pending_.push_back(comm_.start_all_reduce_sum(grads_ + first, bucket_ends_[next_bucket_] - first));
    ++next_bucket_;
  }
}

double GradientSync::finish(double& loss_sum) {
  if (zero_stage_ == 0) {
    on_ready(P_);
    for (auto& request : pending_) request->wait();
    pending_.clear();
    next_bucket_ = 0;
  } else {
    ops::copy(slice(padded_, 0, P_), Tensor(grads_, DType::f32, device_, {P_}));
    comm_.reduce_scatter_sum(padded_.as<float>(), shard_.as<float>(), shard_size_);
  }
  if (expert_.group) sum_shared_grads(*expert_.group, grads(), begin_, expert_.shared);
  // ZeRO 0: every rank holds the whole summed buffer, only the loss needs summing; else each
  // rank's shard adds its squares.
  double sums[2] = {loss_sum, !norm_.scoped ? ops::sum_squares(grads())
                                             : sum_squares_in(grads(), {{begin_, end_, 0}}, norm_.counted)};
  host_comm_.all_reduce_sum(sums, zero_stage_ == 0 ? 1 : 2);
  loss_sum = sums[0];
  norm_.sum(sums[1]);  // the other parts of the model
  return std::sqrt(sums[1]);
}

void GradientSync::gather_params(float* params) {
  if (zero_stage_ == 0) return;
  const std::int64_t mine = comm_.rank() * shard_size_;
  ops::copy(slice(padded_, mine, end_ - begin_), Tensor(params + begin_, DType::f32, device_, {end_ - begin_}));
  comm_.all_gather(padded_.as<float>() + mine, padded_.as<float>(), shard_size_);
  ops::copy(Tensor(params, DType::f32, device_, {P_}), slice(padded_, 0, P_));
}

std::vector<int> ranks_differing_from_first(const std::vector<std::int64_t>& checksums) {
  std::vector<int> out;
  for (std::size_t r = 1; r < checksums.size(); ++r) {
    if (checksums[r] != checksums[0]) out.push_back(int(r));
  }
  return out;
}

std::uint32_t weights_crc32(const Tensor& params, std::int64_t chunk) {
  const std::int64_t P = params.numel();
  const bool on_host = params.device == Device::cpu;
  std::vector<float> host(on_host ? 0 : std::size_t(std::min(P, chunk)));
  std::uint32_t crc = 0;
  for (std::int64_t at = 0; at < P; at += chunk) {
    const std::int64_t n = std::min(chunk, P - at);
    const float* from = params.as<float>() + at;
    if (!on_host) {
      ops::copy(Tensor(host.data(), DType::f32, Device::cpu, {n}), Tensor(const_cast<float*>(from), DType::f32, params.device, {n}));
      from = host.data();
    }
    crc = crc32(from, std::size_t(n) * sizeof(float), crc);
  }
  return crc;
}

void check_replicas(dist::Communicator& comm, const Tensor& params, std::int64_t step) {
  const std::uint32_t crc = weights_crc32(params);
  std::vector<std::int64_t> checksums(std::size_t(comm.world_size()), -1);
  checksums[std::size_t(comm.rank())] = std::int64_t(crc);
  comm.all_reduce_max(checksums.data(), std::int64_t(checksums.size()));
  const auto differing = ranks_differing_from_first(checksums);
  if (differing.empty()) return;
  std::string ranks;
  for (const int r : differing) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  throw RuntimeError("after step " + std::to_string(step) + " the weights of rank(s) " + ranks +
                     " differ from rank 0's (replica check): the ranks have diverged");
}

}  // namespace llmtrain::parallel
