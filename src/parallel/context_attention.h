// Context parallelism, attached to a model from outside as its view of the sequences
// (model/sequence_view.h): the ranks of a context group split every sequence. A
// sequence of T tokens is cut into 2 CP chunks and rank r holds chunks r and 2 CP - 1 - r (head
// and tail), so that under the causal mask every rank does the same work; the rows of its
// activations are its T / CP tokens, in that order, and every position-dependent step (learned
// positions, rotary embeddings, the causal mask) uses each token's true position.
//
// Attention is the only step that needs the other ranks' tokens: each rank keeps its queries and
// sees every rank's keys and values, either passed around the group in a ring (the default: the
// next block is in flight while this one computes, and the partial results merge by their
// log-sum-exp), or all-gathered at once ("allgather": simpler, CP blocks held together). Backward
// passes the blocks again, with their key/value gradients accumulated by each rank in turn and
// returned to their owner (ring), or reduce-scattered (allgather). Grouped-query attention moves
// only the key/value heads.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <vector>

#include "core/tensor.h"
#include "model/sequence_view.h"
#include "ops/buffer.h"
#include "ops/ops.h"

namespace llmtrain::parallel {

/// The transfers a context-parallel model makes inside forward and backward, over its context
/// group, on tensors in the model's memory (parallel/context_parallel_comm.h provides them over a
/// dist::Communicator).
class ContextGroup {
 public:
  /// A started exchange; wait() or queue_wait() finishes it (its buffers stay untouched until then).
  class Pending {
   public:
    virtual ~Pending() = default;
    /// Finished on the host: the host may read the received block.
    virtual void wait() = 0;
    /// Finished in stream order: the model's later device work sees the received block and may
    /// overwrite both buffers; the host need not wait (on a GPU it does not).
    virtual void queue_wait() { wait(); }
  };
  virtual ~ContextGroup() = default;
  /// Sends `send` to rank `send_to` and receives `recv` (same size and dtype) from `recv_from`,
  /// both under way together, after the model's device work given before the call (which wrote
  /// `send`, or still reads `recv`).
  virtual std::unique_ptr<Pending> start_exchange(const Tensor& send, const Tensor& recv, int send_to,
                                                  int recv_from) = 0;
  /// full (n x part) = every rank's part, in rank order (f32 or bf16).
  virtual void all_gather(const Tensor& part, const Tensor& full) = 0;
  /// part = this rank's share of the sum over ranks of full (n x part), f32.
  virtual void reduce_scatter(const Tensor& full, const Tensor& part) = 0;
  /// values = their sum over the group (host memory).
  virtual void sum(std::vector<double>& values) = 0;
};

/// The sequences as a context group's rank sees them: its chunks of each, attention over the whole
/// sequence through the group.
class ContextAttention final : public model::SequenceView {
 public:
  /// Rank `rank` of a context group of `size`; `ring` false: the all-gather variant.
  ContextAttention(int rank, int size, bool ring, Device device, DType compute)
      : rank_(rank), size_(size), ring_(ring), device_(device), compute_(compute) {}

  /// The group the blocks travel over (set before the first pass when size > 1).
  void set_group(ContextGroup* group) { group_ = group; }
  int rank() const { return rank_; }
  int parts() const override { return size_; }
  bool ring() const { return ring_; }

  /// The rows a rank holds of a sequence of T tokens (T / size of them): chunks r and 2 size - 1 - r
  /// of T / (2 size); with one rank, all of it as one chunk.
  ops::Chunks chunks(int rank, int T) const;
  ops::Chunks rows(int T) const override { return chunks(rank_, T); }
  void check_length(int T) const override;
  void sum(std::vector<double>& values) override;

  /// The memory `free` serves the call's work buffers when they all fit in it, else the view's own
  /// buffer does.
  void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, int NH, int NKV,
                         const Tensor& segments, const Tensor& free) override;
  void attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                          const Tensor& lse, int NH, int NKV, const Tensor& segments, const Tensor& free) override;

  /// Bytes one layer's attention call sends per rank of a group of `size` (as dist::Traffic counts
  /// a send), ring or all-gather alike: forward (size - 1) key/value blocks of the room's B Tl 2 NKV
  /// HS elements of `element` bytes (the compute dtype); backward as many again and (size - 1) f32
  /// blocks of their gradients.
  static double sent_bytes(const model::AttentionRoom& room, int size, std::size_t element, bool backward);

  /// The work buffers (shapes and dtypes, no data) attention_forward and attention_backward carve,
  /// for (B, Tl) rows of NH query and NKV key/value heads of width C / NH; `out` and `dqkv` the
  /// dtypes of the attention's output and input gradient.
  static std::vector<Tensor> forward_work(int size, bool ring, DType compute, DType out, std::int64_t B,
                                          std::int64_t Tl, std::int64_t NH, std::int64_t NKV, std::int64_t C);
  static std::vector<Tensor> backward_work(int size, bool ring, DType compute, DType dqkv, std::int64_t B,
                                           std::int64_t Tl, std::int64_t NH, std::int64_t NKV, std::int64_t C);
  /// Bytes a call needs for those buffers together (each 256-byte aligned).
  static std::size_t work_bytes(const std::vector<Tensor>& shapes);
  /// Bytes of the view's own work buffer on a rank of a group of `size` whose model offers `room`
  /// (Model::attention_room): none when every call's buffers fit in the memory it lends.
  static std::size_t own_work_bytes(const model::AttentionRoom& room, int size, bool ring, DType compute);

 private:
  ContextGroup& group() const;
  /// One call's work buffers, in the order asked for: carved from `free` when they fit, else from
  /// work_ (grown to the largest call's).
  std::vector<Tensor> work(const std::vector<Tensor>& shapes, const Tensor& free);

  int rank_, size_;
  bool ring_;
  Device device_;
  DType compute_;
  ContextGroup* group_ = nullptr;
  // Forward: the key/value blocks (ring: the two in flight, this rank's own sent from the second;
  // all-gather: this rank's and all of them), one block's f32 result and log-sum-exp, and the f32
  // running result unless the output is f32 itself. Backward: the blocks again, the f32 key/value
  // gradients (ring: the two travelling accumulators; all-gather: all of them and this rank's
  // share), and the f32 query gradients unless the input gradient is f32 itself.
  ops::Buffer work_;
};

}  // namespace llmtrain::parallel
