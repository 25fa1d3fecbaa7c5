// The one place a model's linear layers reach the matrix-product ops (ops::matmul_*,
// ops::grouped_matmul_*): their forward, and their backward whole or split into the input
// gradient and the weight gradients. What is policy about a linear attaches here rather than in
// the layer bodies: its precision (today the compute dtype its tensors carry, f32 or bf16; a
// quantised format and its scaling state would be applied here) and when its weight gradients are
// computed (at once, or, for a zero-bubble pipeline schedule, later: deferred per activation slot).
#pragma once

#include <vector>

#include "core/tensor.h"
#include "ops/buffer.h"
#include "ops/ops.h"

namespace llmtrain::model {

class Linears {
 public:
  explicit Linears(Device device) : device_(device) {}

  /// out = inp weight^T + bias (ops::matmul_forward).
  void forward(const Tensor& out, const Tensor& inp, const Tensor& weight, const Tensor& bias) const;
  /// pre = inp weight^T + bias, out = GELU(pre) (ops::matmul_gelu_forward).
  void forward_gelu(const Tensor& out, const Tensor& pre, const Tensor& inp, const Tensor& weight,
                    const Tensor& bias) const;
  /// The experts' rows through their own weights (ops::grouped_matmul_forward).
  void grouped_forward(const Tensor& out, const Tensor& inp, const Tensor& weight, const Tensor& offsets) const;

  /// Where a deferred weight gradient finds its output gradient: a copy taken now (the shared
  /// backward scratch, the residual stream's gradient: both move on), or the tensor itself (the
  /// activation slot's own, unchanged until the slot's weight gradients run).
  enum class Dout { copied, kept };
  /// ops::matmul_backward: dinp now; the weight part (dweight, dbias) now, or while deferred
  /// recorded for run_deferred.
  void backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dbias, const Tensor& dout, const Tensor& inp,
                const Tensor& weight, ops::Accumulate dinp_mode = ops::Accumulate::yes, Dout where = Dout::copied);
  /// ops::matmul_backward_dgelu likewise (dpre and dpre_bias now).
  void backward_dgelu(const Tensor& dpre, const Tensor& dweight, const Tensor& dbias, const Tensor& dpre_bias,
                      const Tensor& dout, const Tensor& inp, const Tensor& pre, const Tensor& weight);
  /// ops::matmul_backward at once whatever the deferral: for a weight gradient whose order of
  /// sums another part of the same backward shares (a head tied to the embedding the model holds,
  /// key/value heads shared over a tensor group).
  void backward_whole(const Tensor& dinp, const Tensor& dweight, const Tensor& dbias, const Tensor& dout,
                      const Tensor& inp, const Tensor& weight, ops::Accumulate dinp_mode = ops::Accumulate::yes) const;
  /// ops::grouped_matmul_backward likewise: dinp now, dweight now or deferred (dout copied; the
  /// expert offsets are the slot's own, kept until its weight gradients run).
  void grouped_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dout, const Tensor& inp,
                        const Tensor& weight, const Tensor& offsets, ops::Accumulate dinp_mode = ops::Accumulate::yes);

  /// While deferred, backward() leaves the weight part of each call to run_deferred() of the same
  /// activation slot, which adds them in the order they were met, with the arithmetic of the whole
  /// call: the gradients are its bits.
  void set_deferred(bool deferred) { deferred_ = deferred; }
  bool deferred() const { return deferred_; }
  /// The activation slot backward and run_deferred work for.
  void use_slot(int slot) { slot_ = slot; }
  /// The weight gradients the slot's last backward left.
  void run_deferred();

 private:
  struct Pending {
    Tensor dweight, dbias, dout, inp, weight;
    Tensor offsets;  // a grouped product's (the experts' row ranges); none for a plain one
  };
  struct Slot {
    std::vector<Pending> pending;
    std::vector<ops::Buffer> dout_copies;  // one per entry, kept from update to update
  };
  void defer(const Tensor& dweight, const Tensor& dbias, const Tensor& dout, const Tensor& inp, const Tensor& weight,
             Dout where, const Tensor& offsets = Tensor());

  Device device_;
  bool deferred_ = false;
  int slot_ = 0;
  std::vector<Slot> slots_;
};

}  // namespace llmtrain::model
