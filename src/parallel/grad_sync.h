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
#include "model/flat_layout.h"
#include "ops/buffer.h"

namespace llmtrain::parallel {

/// Under tensor or pipeline parallelism, which gradients the global norm counts on this rank
/// (flat ranges of its buffer: a parameter several ranks hold, once) and the other groups to sum
/// it over (the tensor group, the pipeline; host memory); empty without.
struct NormScope {
  bool scoped = false;  // whether `counted` says what counts (a rank may own none); else everything
  std::vector<model::FlatRange> counted;
  std::vector<dist::Communicator*> groups;
  void sum(double& squares) const {
    for (dist::Communicator* group : groups) group->all_reduce_sum(&squares, 1);
  }
};

/// Expert parallelism: the gradients every rank of an expert group holds alike (every parameter
/// but the experts': parallel/expert_parallel_comm.h's expert_shared_ranges) and the group
/// (device memory) they are summed over once the data-parallel (expert-data) reduction is done;
/// empty without.
struct ExpertScope {
  std::vector<model::FlatRange> shared;
  dist::Communicator* group = nullptr;
};

// Owns the data-parallel reduction of the gradients: the buckets (ZeRO 0) or the shards (ZeRO 1/2),
// the stage actually used (a single rank has nothing to shard: 0), and the global gradient norm.
class GradientSync {
 public:
  /// `grads` (P,) f32, the model's flat gradient buffer; `comm` is the data-parallel group over
  /// the memory they live in (NCCL for CUDA), `host_comm` the same ranks over host memory (for
  /// the norm). `zero_stage` as configured.
  GradientSync(dist::Communicator& comm, dist::Communicator& host_comm, const Tensor& grads, double bucket_mb,
               int zero_stage);

  /// The flat-buffer range whose optimizer update this rank makes.
  std::int64_t begin() const { return begin_; }
  std::int64_t end() const { return end_; }
  /// The ZeRO stage in use (0 on a single rank, whatever the config says).
  int zero_stage() const { return zero_stage_; }
  /// Gradients of [begin, end) (end - begin,), summed over ranks (valid after finish()).
  Tensor grads() const;

  /// Backward has finished the first `ready` gradient elements (last micro-step only).
  void on_ready(std::int64_t ready);
  /// Completes the reduction of the whole buffer and returns the global gradient norm. `loss_sum`
  /// (this rank's) is summed over ranks in the same collective as the norm's squares.
  double finish(double& loss_sum);
  /// After this rank updated params [begin, end): gives every rank every updated weight (ZeRO 1/2).
  void gather_params(float* params);
  void set_norm_scope(NormScope scope) { norm_ = std::move(scope); }
  void set_expert_scope(ExpertScope scope) { expert_ = std::move(scope); }
  /// Bytes of the buffers it holds (ZeRO 1/2: the padded gradients and this rank's shard).
  std::size_t state_bytes() const { return padded_buffer_.bytes() + shard_buffer_.bytes(); }

 private:
  dist::Communicator& comm_;
  dist::Communicator& host_comm_;
  float* grads_;
  std::int64_t P_;
  int zero_stage_;
  Device device_;
  std::int64_t begin_ = 0, end_ = 0, shard_size_ = 0;
  std::vector<std::int64_t> bucket_ends_;
  std::size_t next_bucket_ = 0;
  std::vector<std::unique_ptr<dist::Request>> pending_;
  ops::Buffer padded_buffer_, shard_buffer_;  // ZeRO: (W S) and (S,) on the gradients' device
  Tensor padded_, shard_;
  NormScope norm_;
  ExpertScope expert_;
};

/// The ranks whose weight checksum differs from rank 0's (checksums indexed by rank).
std::vector<int> ranks_differing_from_first(const std::vector<std::int64_t>& checksums);

/// The CRC-32 of the bytes of `params` (P,) f32, on the CPU or a device, taken `chunk` elements at
/// a time (8 MiB by default): device weights are copied to the host one chunk at a time, so that
/// no host copy of the model is ever held.
std::uint32_t weights_crc32(const Tensor& params, std::int64_t chunk = std::int64_t(2) << 20);

/// Compares weights_crc32 of the weights across ranks; RuntimeError on every rank naming the ranks
/// whose weights differ from rank 0's.
void check_replicas(dist::Communicator& comm, const Tensor& params, std::int64_t step);

}  // namespace llmtrain::parallel
