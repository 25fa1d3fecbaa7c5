// Data-parallel gradient reduction, and the ZeRO shards of the flat parameter buffer.
//
// ZeRO 0: the gradient buffer is cut into buckets of dist.bucket_mb, in buffer order (the last
// layers first); on the last micro-step of an update each bucket's all-reduce starts as soon as
// backward has finished it. ZeRO 1 and 2: the buffer, padded to a multiple of the world size, is
// reduce-scattered after backward; rank r then owns elements [r S, (r+1) S) (S = padded / W) of
// the gradients and of the AdamW state, and the updated weights are all-gathered.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/tensor.h"
#include "dist/communicator.h"
#include "ops/buffer.h"

namespace llmtrain::train {

class GradientSync {
 public:
  /// `grads` (num_params,) live on `device`; `comm` must reach memory there (NCCL for CUDA).
  GradientSync(dist::Communicator& comm, float* grads, std::int64_t num_params, double bucket_mb, int zero_stage,
               Device device = Device::cpu);

  /// The flat-buffer range whose optimizer update this rank makes.
  std::int64_t begin() const { return begin_; }
  std::int64_t end() const { return end_; }
  /// Gradients of [begin, end), summed over ranks (valid after finish()).
  const float* grads() const { return zero_stage_ ? shard_.as<float>() : grads_ + begin_; }

  /// Backward has finished the first `ready` gradient elements (last micro-step only).
  void on_ready(std::int64_t ready);
  /// Completes the reduction of the whole buffer.
  void finish();
  /// After this rank updated params [begin, end): gives every rank every updated weight (ZeRO 1/2).
  void gather_params(float* params);

 private:
  dist::Communicator& comm_;
  float* grads_;
  std::int64_t P_;
  int zero_stage_;
  std::int64_t begin_ = 0, end_ = 0, shard_size_ = 0;
  std::vector<std::int64_t> bucket_ends_;
  std::size_t next_bucket_ = 0;
  std::vector<std::unique_ptr<dist::Request>> pending_;
  Device device_;
  ops::Buffer padded_buffer_, shard_buffer_;  // ZeRO: (W S) and (S,) on the gradients' device
  Tensor padded_, shard_;
};

/// The ranks whose weight checksum differs from rank 0's (checksums indexed by rank).
std::vector<int> ranks_differing_from_first(const std::vector<std::int64_t>& checksums);

/// Compares a CRC-32 of the weights (P,) across ranks; RuntimeError on every rank naming the
/// ranks whose weights differ from rank 0's.
void check_replicas(dist::Communicator& comm, const float* params, std::int64_t P, std::int64_t step);

}  // namespace llmtrain::train
