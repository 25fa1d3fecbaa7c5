// Tensor parallelism, handed to a model as its share of the widths (model/width_share.h), with
// Megatron's names: the ranks of a tensor group each hold 1 / size of every layer's heads and MLP
// columns and of the vocabulary, and the layer bodies' steps communicate over the group:
//   - the mappings (Megatron's mappings.py): all_reduce, gather_input (the sequence-parallel
//     all-gather before a column-parallel linear), reduce_output (the all-reduce, or with sequence
//     parallelism the reduce-scatter, after a row-parallel linear);
//   - column_linear / row_linear (ColumnParallelLinear, RowParallelLinear) on the slices of their
//     weights (column_part, row_part);
//   - embedding and cross_entropy (VocabParallelEmbedding and the vocabulary-parallel
//     cross-entropy): no rank holds all V rows of the embedding or all V columns of the logits.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "config/config.h"
#include "core/tensor.h"
#include "model/width_share.h"
#include "ops/buffer.h"
#include "ops/ops.h"

namespace llmtrain::parallel {

/// The collectives a tensor-parallel model makes inside forward and backward, over its tensor
/// group, on tensors in the model's memory (parallel/tensor_parallel_comm.h provides them over a
/// dist::Communicator).
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

class TensorParallel final : public model::WidthShare {
 public:
  /// Rank `rank` of a group of `size` that splits `model`, whose activations are in `compute` on
  /// `device`; `sequence_parallel`: the residual stream's rows too. InputError unless the model's
  /// heads and MLP columns split over the group (check_widths).
  TensorParallel(int rank, int size, bool sequence_parallel, const config::ModelConfig& model, Device device,
                 DType compute);
  /// InputError unless `size` divides the model's query heads and MLP columns, and divides or is
  /// a multiple of its key/value heads (a replicated key/value head then serves several ranks).
  static void check_widths(const config::ModelConfig& model, int size);

  /// The group the steps communicate over (set before the first pass when size > 1).
  void set_group(TensorGroup* group) { group_ = group; }

  int parts() const override { return size_; }
  int index() const override { return rank_; }
  bool split_rows() const override { return sequence_parallel_ && size_ > 1; }
  void check_rows(int B, int T) const override;

  void all_reduce(const Tensor& t) override;
  Tensor gather_input(const Tensor& part, const Tensor& full) override;
  Tensor own_rows(const Tensor& full) const override;
  void reduce_output(const Tensor& partial, const Tensor& out) override;
  void norm_backward(const Tensor& grads, const std::function<void()>& run) override {
    summed_backward(grads, split_rows(), run);
  }
  void head_norm_backward(const Tensor& grads, const std::function<void()>& run) override {
    summed_backward(grads, size_ > 1, run);
  }

  void column_linear(const model::Linears& linears, const Tensor& out, const Tensor& x, const Tensor& full,
                     const Tensor& w, const Tensor& b) override;
  void row_linear(const model::Linears& linears, const Tensor& out, const Tensor& partial, const Tensor& x,
                  const Tensor& w, const Tensor& b) override;
  void embedding(const Tensor& out, const std::int32_t* inputs, const Tensor& device_inputs, const Tensor& wte,
                 const Tensor& wpe, int slot, int slots) override;
  void embedding_backward(const Tensor& dwte, const Tensor& dwpe, const Tensor& dout, const Tensor& device_inputs,
                          int slot) override;
  double cross_entropy(const Tensor& logits, const Tensor& losses, const Tensor& targets, float dlogits_scale,
                       ops::DeviceSum* sum) override;

 private:
  TensorGroup& group() const;
  Tensor keep(const Tensor& grads);  // a copy of `grads` (flat)
  // run(), with the part it adds to `grads` summed over the group when `summed`.
  void summed_backward(const Tensor& grads, bool summed, const std::function<void()>& run);

  int rank_, size_;
  bool sequence_parallel_;
  std::int64_t C_;
  Device device_;
  DType compute_;
  TensorGroup* group_ = nullptr;
  // The embedding with a zero row after this rank's (for tokens other ranks hold), its gradient,
  // the tokens as its row indices (one set per activation slot), the classifier's per-row
  // statistics, and a norm's kept weight gradients.
  ops::Buffer vocab_table_, vocab_table_grad_, vocab_ids_, classifier_stats_, norm_grads_;
  std::vector<std::int32_t> host_ids_;
  ops::Uploader ids_upload_;
};

}  // namespace llmtrain::parallel
