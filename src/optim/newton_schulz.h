// Newton-Schulz orthogonalisation, as torch.optim.Muon computes it: the matrix divided by its
// Frobenius norm, then steps of the quintic X <- a X + (b A + c A^2) X with A = X X^T, on the
// wide orientation (a tall matrix is transposed first and back after), so that A is the smaller
// Gram matrix. One code path for both backends, on the tensors' device through the ops, and for
// any number of matrices of one shape (a transformer has many: every layer's q, o, gate, up, ...):
// their iterates are stacked, (B, m, n), and each of the quintic's three products is one
// ops::batched_matmul over the stack (matmul_forward per matrix on the CPU, one strided-batched
// cuBLASLt matmul on a GPU): X X^T and A A (A is symmetric) take X and A as they are, the
// polynomial times X takes X untransposed; the quintic's sums are ops::scaled_sum over the whole
// stack. Per matrix, where the matrices lie apart (u and O in the optimizer's arrays): the norm
// (ops::sum_squares into a sum on the device, read there by the normalisation: no host round
// trip), the normalisation into the stack, and the copy of the result out of it.
// With `bf16` the iterate X, A and the polynomial are bf16 tensors: every product takes bf16
// inputs, accumulates in fp32 and is rounded to bf16 once, as are the normalised input and each
// scaled sum (the CPU reference widens, computes in fp32 and rounds at the same points).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "ops/buffer.h"
#include "ops/ops.h"

namespace llmtrain::optim {

struct NewtonSchulz {
  std::int64_t steps = 5;
  double a = 3.4445, b = -4.7750, c = 2.0315;
  double eps = 1e-7;  // the norm is at least this
  bool bf16 = false;  // the iterate and the products in bf16, as bf16 runs compute
  // The work memory one batch may take (at least one matrix). Batching pays for small matrices,
  // whose products alone leave a GPU idle; large ones gain little and would multiply the memory
  // (a 7B Llama's 64 gate and up matrices in one f32 batch: 47 GB).
  std::size_t batch_bytes = std::size_t(256) << 20;
};

/// The memory newton_schulz works in on one device: grown to the largest batch it was given, then
/// reused.
struct NewtonSchulzWork {
  explicit NewtonSchulzWork(Device device = Device::cpu) : squares(device) {}
  ops::Buffer buffer;      // stacks of X, the next X, the polynomial times X, A, A^2 and the polynomial
  ops::DeviceSum squares;  // one input's sum of squares
};

/// outs[i] (rows, cols) = the orthogonalisation of us[i] (rows, cols), for matrices of one shape,
/// all f32 on work's device; outs[i] may be us[i]. The matrices go through in batches of at most
/// p.batch_bytes of work memory.
void newton_schulz(const std::vector<Tensor>& us, const std::vector<Tensor>& outs, const NewtonSchulz& p,
                   NewtonSchulzWork& work);
/// out (rows, cols) = the orthogonalisation of u (rows, cols): a batch of one.
void newton_schulz(const Tensor& u, const Tensor& out, const NewtonSchulz& p, NewtonSchulzWork& work);

}  // namespace llmtrain::optim
