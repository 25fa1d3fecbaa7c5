// Newton-Schulz orthogonalisation, as torch.optim.Muon computes it: the matrix divided by its
// Frobenius norm, then steps of the quintic X <- a X + (b A + c A^2) X with A = X X^T, on the
// wide orientation (a tall matrix is transposed first and back after), so that A is the smaller
// Gram matrix. The products run through ops::matmul_forward (OpenBLAS's sgemm on the CPU).
#pragma once

#include <cstdint>
#include <vector>

namespace llmtrain::optim {

struct NewtonSchulz {
  std::int64_t steps = 5;
  double a = 3.4445, b = -4.7750, c = 2.0315;
  double eps = 1e-7;  // the norm is at least this
  bool bf16 = false;  // round every product (and the normalised input) to bf16, as bf16 runs compute
};

/// out (rows, cols) = the orthogonalisation of u (rows, cols), row-major f32 host arrays; out may
/// be u. `scratch` is reused between calls.
void newton_schulz(const float* u, float* out, std::int64_t rows, std::int64_t cols, const NewtonSchulz& p,
                   std::vector<float>& scratch);

}  // namespace llmtrain::optim
