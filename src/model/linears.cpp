#include "model/linears.h"

#include "ops/moe_ops.h"

namespace llmtrain::model {

void Linears::forward(const Tensor& out, const Tensor& inp, const Tensor& weight, const Tensor& bias) const {
  ops::matmul_forward(out, inp, weight, bias);
}

void Linears::forward_gelu(const Tensor& out, const Tensor& pre, const Tensor& inp, const Tensor& weight,
                           const Tensor& bias) const {
  ops::matmul_gelu_forward(out, pre, inp, weight, bias);
}

void Linears::grouped_forward(const Tensor& out, const Tensor& inp, const Tensor& weight, const Tensor& offsets) const {
  ops::grouped_matmul_forward(out, inp, weight, offsets);
}

void Linears::backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dbias, const Tensor& dout,
                       const Tensor& inp, const Tensor& weight, ops::Accumulate dinp_mode, Dout where) {
  if (!deferred_) return ops::matmul_backward(dinp, dweight, dbias, dout, inp, weight, dinp_mode);
  ops::matmul_backward(dinp, Tensor(), Tensor(), dout, inp, weight, dinp_mode);
  defer(dweight, dbias, dout, inp, weight, where);
}

void Linears::backward_dgelu(const Tensor& dpre, const Tensor& dweight, const Tensor& dbias, const Tensor& dpre_bias,
                             const Tensor& dout, const Tensor& inp, const Tensor& pre, const Tensor& weight) {
  if (!deferred_) return ops::matmul_backward_dgelu(dpre, dweight, dbias, dpre_bias, dout, inp, pre, weight);
  ops::matmul_backward_dgelu(dpre, Tensor(), Tensor(), dpre_bias, dout, inp, pre, weight);
  defer(dweight, dbias, dout, inp, weight, Dout::copied);
}

void Linears::backward_whole(const Tensor& dinp, const Tensor& dweight, const Tensor& dbias, const Tensor& dout,
                             const Tensor& inp, const Tensor& weight, ops::Accumulate dinp_mode) const {
  ops::matmul_backward(dinp, dweight, dbias, dout, inp, weight, dinp_mode);
}

void Linears::grouped_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dout, const Tensor& inp,
                               const Tensor& weight, const Tensor& offsets, ops::Accumulate dinp_mode) {
  if (!deferred_) return ops::grouped_matmul_backward(dinp, dweight, dout, inp, weight, offsets, dinp_mode);
  ops::grouped_matmul_backward(dinp, Tensor(), dout, inp, weight, offsets, dinp_mode);
  defer(dweight, Tensor(), dout, inp, weight, Dout::copied, offsets);
}

void Linears::defer(const Tensor& dweight, const Tensor& dbias, const Tensor& dout, const Tensor& inp,
                    const Tensor& weight, Dout where, const Tensor& offsets) {
  if (slots_.size() <= std::size_t(slot_)) slots_.resize(std::size_t(slot_) + 1);
  Slot& slot = slots_[std::size_t(slot_)];
  Tensor kept = dout;
  if (where == Dout::copied) {
    const std::size_t n = slot.pending.size();
    if (slot.dout_copies.size() <= n) slot.dout_copies.resize(n + 1);
    ops::Buffer& copy = slot.dout_copies[n];
    if (copy.bytes() < dout.bytes()) copy = ops::Buffer(device_, dout.bytes());
    kept.data = copy.data();
    ops::copy(kept, dout);
  }
  slot.pending.push_back({dweight, dbias, kept, inp, weight, offsets});
}

void Linears::run_deferred() {
  if (slots_.size() <= std::size_t(slot_)) return;
  Slot& slot = slots_[std::size_t(slot_)];
  for (const Pending& p : slot.pending) {
    if (p.offsets.data) {
      ops::grouped_matmul_backward(Tensor(), p.dweight, p.dout, p.inp, p.weight, p.offsets);
    } else {
      ops::matmul_backward(Tensor(), p.dweight, p.dbias, p.dout, p.inp, p.weight);
    }
  }
  slot.pending.clear();
}

}  // namespace llmtrain::model
