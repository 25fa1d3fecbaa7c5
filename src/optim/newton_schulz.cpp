#include "optim/newton_schulz.h"

#include <algorithm>
#include <string>

#include "core/error.h"
#include "ops/muon_ops.h"

namespace llmtrain::optim {

void newton_schulz(const Tensor& u, const Tensor& out, const NewtonSchulz& p, NewtonSchulzWork& work) {
  if (u.ndim != 2 || u.dtype != DType::f32 || out.dtype != DType::f32 || out.ndim != 2 ||
      out.shape[0] != u.shape[0] || out.shape[1] != u.shape[1] || u.device != work.squares.device() ||
      out.device != u.device) {
    throw RuntimeError("newton_schulz: expected f32 matrices of one shape on the work's device, got " + u.describe() +
                       " -> " + out.describe());
  }
  const std::int64_t rows = u.shape[0], cols = u.shape[1];
  const bool tall = rows > cols;
  const std::int64_t m = std::min(rows, cols), n = std::max(rows, cols);  // X is (m, n), m <= n
  const DType act = p.bf16 ? DType::bf16 : DType::f32;
  const Device device = u.device;
  // Six arrays in one buffer, each starting 256-byte aligned (cuBLASLt's best alignment).
  const auto bytes_of = [&](std::int64_t elements) { return (std::size_t(elements) * dtype_size(act) + 255) / 256 * 256; };
  const std::size_t big = bytes_of(m * n), small = bytes_of(m * m);
  if (work.buffer.bytes() < 3 * big + 3 * small) work.buffer = ops::Buffer(device, 3 * big + 3 * small);
  char* base = static_cast<char*>(work.buffer.data());
  const auto at = [&](std::size_t offset, std::int64_t r, std::int64_t c) { return Tensor(base + offset, act, device, {r, c}); };
  Tensor x = at(0, m, n), other = at(big, m, n);  // X, and X^T or the next X
  const Tensor bx = at(2 * big, m, n), gram = at(3 * big, m, m), gram2 = at(3 * big + small, m, m),
               poly = at(3 * big + 2 * small, m, m);
  const Tensor none;

  ops::zero(Tensor(work.squares.data(), DType::u16, device, {4}));  // the double's 8 bytes
  ops::sum_squares(u.reshape({rows * cols}), &work.squares);
  ops::newton_schulz_normalise(x, u, work.squares, p.eps);
  for (std::int64_t step = 0; step < p.steps; ++step) {
    ops::matmul_forward(gram, x, x, none);        // A = X X^T
    ops::matmul_forward(gram2, gram, gram, none);  // A A^T = A^2
    ops::scaled_sum(poly, gram, gram2, float(p.b), float(p.c));
    const Tensor xt = other.reshape({n, m});
    ops::transpose(xt, x);
    ops::matmul_forward(bx, poly, xt, none);  // poly (X^T)^T
    ops::scaled_sum(other, x, bx, float(p.a), 1.0f);
    std::swap(x, other);
  }
  if (tall) {
    if (act == DType::f32) return ops::transpose(out, x);
    const Tensor xt = other.reshape({n, m});
    ops::transpose(xt, x);
    return ops::convert(out, xt);
  }
  if (act == DType::f32) return ops::copy(out, x);
  ops::convert(out, x.reshape({rows, cols}));
}

}  // namespace llmtrain::optim
