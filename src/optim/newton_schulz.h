// Newton-Schulz orthogonalisation, as torch.optim.Muon computes it: the matrix divided by its
// Frobenius norm, then steps of the quintic X <- a X + (b A + c A^2) X with A = X X^T, on the
// wide orientation (a tall matrix is transposed first and back after), so that A is the smaller
// Gram matrix. One code path for both backends, on the tensors' device through the ops: the
// products are ops::matmul_forward (OpenBLAS's sgemm on the CPU, cuBLASLt on a GPU), which computes
// inp weight^T, so X X^T and A A (A is symmetric) take X and A as they are and A' X takes X^T,
// transposed once per step; the norm is ops::sum_squares into a sum on the device, read there by
// the normalisation (no host round trip); the sums of the quintic are ops::scaled_sum. One matrix
// per call: matmul_forward has no batch dimension to take several matrices of one shape at once.
// With `bf16` the iterate X, A and the polynomial are bf16 tensors: every product takes bf16
// inputs, accumulates in fp32 and is rounded to bf16 once, as are the normalised input and each
// scaled sum (the CPU reference widens, computes in fp32 and rounds at the same points).
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "ops/buffer.h"
#include "ops/ops.h"

namespace llmtrain::optim {

struct NewtonSchulz {
  std::int64_t steps = 5;
  double a = 3.4445, b = -4.7750, c = 2.0315;
  double eps = 1e-7;  // the norm is at least this
  bool bf16 = false;  // the iterate and the products in bf16, as bf16 runs compute
};

/// The memory newton_schulz works in on one device: grown to the largest matrix it was given,
/// then reused.
struct NewtonSchulzWork {
  explicit NewtonSchulzWork(Device device = Device::cpu) : squares(device) {}
  ops::Buffer buffer;     // X, X^T, A, A^2, the polynomial and its product with X
  ops::DeviceSum squares;  // the input's sum of squares
};

/// out (rows, cols) = the orthogonalisation of u (rows, cols), both f32 on work's device; out may
/// be u.
void newton_schulz(const Tensor& u, const Tensor& out, const NewtonSchulz& p, NewtonSchulzWork& work);

}  // namespace llmtrain::optim
