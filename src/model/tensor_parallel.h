// Tensor parallelism inside the model, named as Megatron names it. A TensorParallel holds this
// rank's place in its tensor group and the scratch its layers need; the architectures' layer
// bodies build from it:
//   - the mappings (Megatron's mappings.py): all_reduce, gather_input (the sequence-parallel
//     all-gather before a column-parallel linear), reduce_output (the all-reduce, or with sequence
//     parallelism the reduce-scatter, after a row-parallel linear);
//   - column_parallel_linear / row_parallel_linear (ColumnParallelLinear, RowParallelLinear) and
//     the slices of their weights (column_part, row_part);
//   - vocab_parallel_embedding and vocab_parallel_cross_entropy (VocabParallelEmbedding and the
//     vocabulary-parallel cross-entropy): no rank holds all V rows of the embedding or all V
//     columns of the logits.
// With one rank each is the one-rank computation and communicates nothing.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/tensor.h"
#include "model/flat_layout.h"
#include "model/linears.h"
#include "ops/buffer.h"
#include "ops/ops.h"

namespace llmtrain::model {

/// The collectives a tensor-parallel model makes inside forward and backward, over its tensor
/// group, on tensors in the model's memory (train/ provides them over a dist::Communicator).
class TensorGroup {
 public:
  virtual ~TensorGroup() = default;
  virtual void all_reduce_sum(const Tensor& t) = 0;  // f32 or bf16
  virtual void all_reduce_max(const Tensor& t) = 0;  // f32
  /// Sequence parallelism: full (n R, ...) = every rank's part (R, ...) in rank order.
  virtual void all_gather(const Tensor& part, const Tensor& full) = 0;
  /// part (R, ...) = this rank's rows of the sum over ranks of full (n R, ...).
  virtual void reduce_scatter(const Tensor& full, const Tensor& part) = 0;
};

class TensorParallel {
 public:
  /// This rank's place (`layout`) in a group that splits a model of vocabulary V and width C
  /// whose activations are in `compute`.
  TensorParallel(const Layout& layout, std::int64_t V, std::int64_t C, Device device, DType compute,
                 const Linears& linears);

  /// The group the mappings communicate over (set before the first pass).
  void set_group(TensorGroup* group) { group_ = group; }
  int size() const { return size_; }
  int rank() const { return rank_; }
  /// Sequence parallelism: the residual stream, its norms and the embedding's output hold this
  /// rank's 1/size() of the tokens (rows).
  bool sequence_parallel() const { return sequence_parallel_ && size_ > 1; }
  /// Rows of the residual stream on this rank, of n tokens.
  std::int64_t stream_rows(std::int64_t n) const { return sequence_parallel() ? n / size_ : n; }
  /// InputError unless sequence parallelism can split (B,T) micro-batches' tokens over the group.
  void check_sequence_split(int B, int T) const;

  // The weights' slices.
  /// A slice of `n` indices along `dim` split evenly over the group (rows or columns
  /// r n / N .. (r + 1) n / N); the whole tensor on one rank.
  TensorSlice even_part(int dim, std::int64_t n) const;
  /// A column-parallel linear's weight (n, in) or bias (n,): its output rows split.
  TensorSlice column_part(std::int64_t n) const { return even_part(0, n); }
  /// A row-parallel linear's weight (out, n): its input columns split.
  TensorSlice row_part(std::int64_t n) const { return even_part(1, n); }
  /// This rank's rows [vocab_begin, vocab_end) of the vocabulary (embedding and output head).
  std::int64_t vocab_begin() const { return V_ * rank_ / size_; }
  std::int64_t vocab_end() const { return V_ * (rank_ + 1) / size_; }
  /// The vocabulary rows' slice of the embedding or head (V, C); the whole table on one rank.
  TensorSlice vocab_part() const;
  /// A row-parallel linear's bias, added by rank 0 alone (the outputs are then summed).
  Tensor bias_once(const Tensor& bias) const { return rank_ == 0 ? bias : Tensor(); }

  // The mappings.
  /// Sums t over the group: a row-parallel linear's partial outputs, or the input gradient of a
  /// column-parallel one.
  void all_reduce(const Tensor& t);
  /// The whole (N, C) input of which `part` holds this rank's rows: `part` itself without
  /// sequence parallelism, else all-gathered into `full`.
  Tensor gather_input(const Tensor& part, const Tensor& full);
  /// Sequence parallelism: this rank's rows of `full` (N, C), the whole tokens' values every rank
  /// holds alike (a view: rows r N / size .. (r + 1) N / size); `full` itself without it.
  Tensor own_rows(const Tensor& full) const;
  /// After a row-parallel linear (or the embedding) wrote this rank's partial result into
  /// `partial` (N, C): `out` = the sum over the group, this rank's rows of it with sequence
  /// parallelism (a reduce-scatter), else all of it (an all-reduce; `partial` is `out`).
  void reduce_output(const Tensor& partial, const Tensor& out);
  /// A norm's backward (`run`) whose weight gradients `grads` (flat: a norm's weight and bias are
  /// adjacent) get only this rank's tokens' part under sequence parallelism: that part of this
  /// micro-step is summed over the group.
  template <class F>
  void norm_backward(const Tensor& grads, F&& run) {
    summed_backward(grads, sequence_parallel(), run);
  }
  /// The backward of a norm over each of this rank's heads (model.qk_norm) whose weights every rank
  /// holds whole: each rank's heads add their part of the weight gradients, so this micro-step's
  /// are summed over the group whenever it has more than one rank.
  template <class F>
  void head_norm_backward(const Tensor& grads, F&& run) {
    summed_backward(grads, size_ > 1, run);
  }

  // The layers.
  /// ColumnParallelLinear: out (N, n) = x (N, C) w (n, C)^T + b (this rank's n output columns),
  /// on the whole tokens: x (R, C) is all-gathered into `full` (N, C) with sequence parallelism.
  void column_parallel_linear(const Tensor& out, const Tensor& x, const Tensor& full, const Tensor& w,
                              const Tensor& b);
  /// RowParallelLinear: out (R, C) = the sum over the group of x (N, n) w (C, n)^T (this rank's n
  /// input columns), plus b once; with sequence parallelism the product goes to `partial` (N, C)
  /// and this rank's rows of the sum to `out`.
  void row_parallel_linear(const Tensor& out, const Tensor& partial, const Tensor& x, const Tensor& w,
                           const Tensor& b);
  /// VocabParallelEmbedding: out (B,T,C) = wte[inputs] (+ wpe, when given), each rank looking up
  /// the rows it holds (its wte part), zero for the others; reduce_output then sums them. `inputs`
  /// (B,T) is the host copy of `device_inputs`; `slot` of `slots` the activation slot in use.
  void vocab_parallel_embedding(const Tensor& out, const std::int32_t* inputs, const Tensor& device_inputs,
                                const Tensor& wte, const Tensor& wpe, int slot, int slots);
  /// dwte (this rank's rows) and dwpe (when given) += from dout (B,T,C), after the embedding of
  /// activation slot `slot`.
  void vocab_parallel_embedding_backward(const Tensor& dwte, const Tensor& dwpe, const Tensor& dout,
                                         const Tensor& device_inputs, int slot);
  /// The fused classifier (ops::fused_classifier) on this rank's vocabulary columns of the logits
  /// (N, logits_stride(V)): the row maxima and sums of exponentials are reduced over the group.
  /// Returns the summed loss (0 when `sum` keeps it on the device).
  double vocab_parallel_cross_entropy(const Tensor& logits, const Tensor& losses, const Tensor& targets,
                                      float dlogits_scale, ops::DeviceSum* sum);

 private:
  TensorGroup& group() const;
  Tensor keep(const Tensor& grads);  // a copy of `grads` (flat)
  // run(), with the part it adds to `grads` summed over the group when `summed`.
  template <class F>
  void summed_backward(const Tensor& grads, bool summed, F&& run) {
    if (!summed) {
      run();
      return;
    }
    const Tensor kept = keep(grads);
    ops::zero(grads);
    run();
    all_reduce(grads);
    ops::residual_forward(grads, grads, kept);
  }

  int rank_, size_;
  bool sequence_parallel_;
  std::int64_t V_, C_;
  Device device_;
  DType compute_;
  const Linears& linears_;  // the model's: the split linears' products go through it
  TensorGroup* group_ = nullptr;
  // The embedding with a zero row after this rank's (for tokens other ranks hold), its gradient,
  // the tokens as its row indices (one set per activation slot), the classifier's per-row
  // statistics, and a norm's kept weight gradients.
  ops::Buffer vocab_table_, vocab_table_grad_, vocab_ids_, classifier_stats_, norm_grads_;
  std::vector<std::int32_t> host_ids_;
  ops::Uploader ids_upload_;
};

}  // namespace llmtrain::model
