// How a model sees each sequence of a micro-batch: which of its tokens this rank holds, and
// attention across the whole sequence from them. A model holds every sequence whole unless a view
// that splits them is attached from outside (Model::attach_sequences: parallel/context_attention.h
// gives each rank of a group two chunks of every sequence and passes keys and values between
// them). Every position-dependent step (learned positions, rotary embeddings, the causal mask)
// reads rows() for its tokens' true positions, and every statistic of the whole micro-batch (a
// MoE router's loads and losses) goes through sum().
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "ops/ops.h"

namespace llmtrain::model {

/// What one layer's attention call works with at (B, Tl) rows of each sequence on this rank: its
/// heads, and the memory the model lends it (Model::attention_room, measured by the layout code).
struct AttentionRoom {
  std::int64_t B = 0, Tl = 0;
  std::int64_t NH = 0, NKV = 0, C = 0;  // query and key/value heads on this rank; C = NH x head size
  DType dqkv = DType::f32;              // the input gradient's dtype
  std::size_t forward_free = 0;         // bytes free during forward's call (the backward scratch)
  std::size_t backward_free = 0;        // and during backward's (the scratch past its gradients)
};

class SequenceView {
 public:
  virtual ~SequenceView() = default;
  /// The ranks each sequence's tokens are shared out over (1: this rank holds them all).
  virtual int parts() const = 0;
  /// The rows this rank holds of a sequence of T tokens, as chunks (T / parts() rows in all).
  virtual ops::Chunks rows(int T) const = 0;
  /// InputError unless sequences of T tokens split into this view's chunks.
  virtual void check_length(int T) const = 0;
  /// out (B, T / parts()) = this rank's tokens of each row of in (B, T), host memory.
  void take_rows(const std::int32_t* in, int B, int T, std::vector<std::int32_t>& out) const;
  /// values = their sum over the ranks holding the micro-batch's tokens (host memory; every one of
  /// them calls it together).
  virtual void sum(std::vector<double>& values) = 0;

  /// Causal attention of this rank's rows against the whole sequence: out (B,Tl,NH HS) and lse
  /// (B,NH,Tl) from qkv (B,Tl,(NH+2NKV)HS), as flash_attention_forward on the whole sequence gives
  /// them for these rows. segments: the whole sequences' (B,T) document mask, or empty. `free`:
  /// memory nothing else uses during this call (the model's dead backward scratch), or empty.
  virtual void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, int NH, int NKV,
                                 const Tensor& segments, const Tensor& free) = 0;
  /// dqkv (B,Tl,(NH+2NKV)HS) = (written, not accumulated) the gradient from dout, as
  /// flash_attention_backward gives it for these rows.
  virtual void attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                                  const Tensor& lse, int NH, int NKV, const Tensor& segments, const Tensor& free) = 0;
};

/// Every sequence whole on this rank: flash attention over it with the model's kernels.
class WholeSequences final : public SequenceView {
 public:
  explicit WholeSequences(ops::AttentionKernels kernels) : kernels_(kernels) {}
  int parts() const override { return 1; }
  ops::Chunks rows(int T) const override { return {T, 0, -1}; }
  void check_length(int) const override {}
  void sum(std::vector<double>&) override {}
  void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, int NH, int NKV,
                         const Tensor& segments, const Tensor& free) override;
  void attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                          const Tensor& lse, int NH, int NKV, const Tensor& segments, const Tensor& free) override;

 private:
  ops::AttentionKernels kernels_;
};

}  // namespace llmtrain::model
