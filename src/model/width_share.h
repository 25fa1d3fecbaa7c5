// This rank's share of the model's widths: which part of the heads, the MLP columns and the
// vocabulary it holds, and how a layer body crosses between the activations every rank holds alike
// and those split over ranks (Megatron's mappings and parallel layers). WidthShare itself is the
// whole model on one rank, where each step is its one-rank computation and communicates nothing; a
// share that splits the widths over a group of ranks (tensor parallelism, built in src/parallel/)
// is handed to make_model in its Layout (Layout::widths) and overrides the steps with its
// communication. The layer bodies
// reach the split only through these calls.
#pragma once

#include <cstdint>
#include <functional>

#include "core/tensor.h"
#include "model/flat_layout.h"
#include "model/linears.h"
#include "ops/ops.h"

namespace llmtrain::model {

class WidthShare {
 public:
  /// The share of a model of vocabulary V.
  explicit WidthShare(std::int64_t V) : V_(V) {}
  virtual ~WidthShare() = default;
  WidthShare(const WidthShare&) = delete;
  WidthShare& operator=(const WidthShare&) = delete;

  // The share.
  /// The ranks the widths are split over (1: whole), and this rank's place among them.
  virtual int parts() const { return 1; }
  virtual int index() const { return 0; }
  /// Whether the residual stream, its norms and the embedding's output hold only this rank's
  /// 1 / parts() of the tokens (rows) as well (sequence parallelism).
  virtual bool split_rows() const { return false; }
  /// Rows of the residual stream on this rank, of n tokens.
  std::int64_t stream_rows(std::int64_t n) const { return split_rows() ? n / parts() : n; }
  /// InputError unless (B,T) micro-batches' tokens split over the parts (when split_rows()).
  virtual void check_rows(int B, int T) const;

  // The parameters' parts.
  /// `n` indices along `dim` split evenly (part r: r n / parts .. (r + 1) n / parts); the whole
  /// tensor on one rank.
  TensorSlice even_part(int dim, std::int64_t n) const;
  /// A column-parallel linear's weight (n, in) or bias (n,): its output rows split.
  TensorSlice column_part(std::int64_t n) const { return even_part(0, n); }
  /// A row-parallel linear's weight (out, n): its input columns split.
  TensorSlice row_part(std::int64_t n) const { return even_part(1, n); }
  /// This rank's rows [vocab_begin, vocab_end) of the vocabulary (embedding and output head).
  std::int64_t vocab_begin() const { return V_ * index() / parts(); }
  std::int64_t vocab_end() const { return V_ * (index() + 1) / parts(); }
  /// The vocabulary rows' slice of the embedding or head (V, C); the whole table on one rank.
  TensorSlice vocab_part() const;
  /// A row-parallel linear's bias, added by part 0 alone (the outputs are then summed).
  Tensor bias_once(const Tensor& bias) const { return index() == 0 ? bias : Tensor(); }

  // The mappings.
  /// Sums t over the parts: a row-parallel linear's partial outputs, or the input gradient of a
  /// column-parallel one.
  virtual void all_reduce(const Tensor& t);
  /// The whole (N, C) input of which `part` holds this rank's rows: `part` itself unless the rows
  /// are split, else gathered into `full`.
  virtual Tensor gather_input(const Tensor& part, const Tensor& full);
  /// With split rows, this rank's rows of `full` (N, C), the whole tokens' values every rank holds
  /// alike (a view); `full` itself otherwise.
  virtual Tensor own_rows(const Tensor& full) const;
  /// After a row-parallel linear (or the embedding) wrote this rank's partial result into
  /// `partial` (N, C): `out` = the sum over the parts, this rank's rows of it when the rows are
  /// split, else all of it (`partial` is then `out`).
  virtual void reduce_output(const Tensor& partial, const Tensor& out);
  /// A norm's backward (`run`) whose weight gradients `grads` (flat: a norm's weight and bias are
  /// adjacent) get only this rank's tokens' part when the rows are split: that part of this
  /// micro-step is summed over the parts.
  virtual void norm_backward(const Tensor& grads, const std::function<void()>& run);
  /// The backward of a norm over each of this rank's heads (model.qk_norm) whose weights every
  /// rank holds whole: each rank's heads add their part of the weight gradients, summed over the
  /// parts.
  virtual void head_norm_backward(const Tensor& grads, const std::function<void()>& run);

  // The layers.
  /// ColumnParallelLinear: out (N, n) = x (N, C) w (n, C)^T + b (this rank's n output columns), on
  /// the whole tokens (x's rows gathered into `full` (N, C) when split).
  virtual void column_linear(const Linears& linears, const Tensor& out, const Tensor& x, const Tensor& full,
                             const Tensor& w, const Tensor& b);
  /// RowParallelLinear: out (R, C) = the sum over the parts of x (N, n) w (C, n)^T (this rank's n
  /// input columns), plus b once; with split rows the product goes to `partial` (N, C) and this
  /// rank's rows of the sum to `out`.
  virtual void row_linear(const Linears& linears, const Tensor& out, const Tensor& partial, const Tensor& x,
                          const Tensor& w, const Tensor& b);
  /// VocabParallelEmbedding: out (B,T,C) = wte[inputs] (+ wpe, when given), of this rank's rows of
  /// the table (reduce_output then sums them). `inputs` (B,T) is the host copy of
  /// `device_inputs`; `slot` of `slots` the activation slot in use.
  virtual void embedding(const Tensor& out, const std::int32_t* inputs, const Tensor& device_inputs, const Tensor& wte,
                         const Tensor& wpe, int slot, int slots);
  /// dwte (this rank's rows) and dwpe (when given) += from dout (B,T,C), after the embedding of
  /// activation slot `slot`.
  virtual void embedding_backward(const Tensor& dwte, const Tensor& dwpe, const Tensor& dout,
                                  const Tensor& device_inputs, int slot);
  /// The fused classifier (ops::fused_classifier) on this rank's vocabulary columns of the logits
  /// (N, logits_stride(columns)), the row statistics taken over all the parts. Returns the summed
  /// loss (0 when `sum` keeps it on the device).
  virtual double cross_entropy(const Tensor& logits, const Tensor& losses, const Tensor& targets, float dlogits_scale,
                               ops::DeviceSum* sum);

 private:
  std::int64_t V_;
};

}  // namespace llmtrain::model
