#include "optim/newton_schulz.h"

#include <algorithm>
#include <string>
#include <utility>

#include "core/error.h"
#include "ops/muon_ops.h"

namespace llmtrain::optim {

void newton_schulz(const std::vector<Tensor>& us, const std::vector<Tensor>& outs, const NewtonSchulz& p,
                   NewtonSchulzWork& work) {
  if (us.size() != outs.size()) {
    throw RuntimeError("newton_schulz: " + std::to_string(us.size()) + " matrices in, " +
                       std::to_string(outs.size()) + " out");
  }
  if (us.empty()) return;
  const Tensor& first = us.front();
  for (std::size_t i = 0; i < us.size(); ++i) {
    const Tensor &u = us[i], &out = outs[i];
    if (u.ndim != 2 || u.dtype != DType::f32 || out.dtype != DType::f32 || out.ndim != 2 ||
        u.shape[0] != first.shape[0] || u.shape[1] != first.shape[1] || out.shape[0] != u.shape[0] ||
        out.shape[1] != u.shape[1] || u.device != work.squares.device() || out.device != u.device) {
      throw RuntimeError("newton_schulz: expected f32 matrices of one shape on the work's device, got " +
                         u.describe() + " -> " + out.describe() + " (matrix " + std::to_string(i) + " of " +
                         std::to_string(us.size()) + ", the first " + first.describe() + ")");
    }
  }
  const std::int64_t rows = first.shape[0], cols = first.shape[1];
  if (rows == 0 || cols == 0) return;
  const bool tall = rows > cols;
  const std::int64_t m = std::min(rows, cols), n = std::max(rows, cols);  // X is (m, n), m <= n
  const DType act = p.bf16 ? DType::bf16 : DType::f32;
  const Device device = first.device;
  const std::int64_t B = std::int64_t(us.size());
  // Six stacks of `batch` matrices in one buffer, each stack starting 256-byte aligned (cuBLASLt's
  // best alignment): X, the next X and the polynomial times X (m, n); A, A^2 and the polynomial (m, m).
  const std::size_t per_matrix = std::size_t(3 * m * n + 3 * m * m) * dtype_size(act);
  const std::int64_t batch = std::clamp<std::int64_t>(std::int64_t(p.batch_bytes / per_matrix), 1, B);
  const auto bytes_of = [&](std::int64_t elements) { return (std::size_t(elements) * dtype_size(act) + 255) / 256 * 256; };
  const std::size_t big = bytes_of(batch * m * n), small = bytes_of(batch * m * m);
  if (work.buffer.bytes() < 3 * big + 3 * small) work.buffer = ops::Buffer(device, 3 * big + 3 * small);
  char* base = static_cast<char*>(work.buffer.data());
  const auto stack = [&](std::size_t offset, std::int64_t count, std::int64_t r, std::int64_t c) {
    return Tensor(base + offset, act, device, {count, r, c});
  };
  const auto matrix = [&](const Tensor& s, std::int64_t b) {  // matrix b of a stack
    const std::size_t at = std::size_t(b * s.shape[1] * s.shape[2]) * dtype_size(act);
    return Tensor(static_cast<char*>(s.data) + at, act, device, {s.shape[1], s.shape[2]});
  };

  for (std::int64_t begin = 0; begin < B; begin += batch) {
    const std::int64_t count = std::min(batch, B - begin);
    Tensor x = stack(0, count, m, n), other = stack(big, count, m, n);  // X, and the next X
    const Tensor px = stack(2 * big, count, m, n), gram = stack(3 * big, count, m, m),
                 gram2 = stack(3 * big + small, count, m, m), poly = stack(3 * big + 2 * small, count, m, m);
    for (std::int64_t b = 0; b < count; ++b) {  // each u over its norm, into the stack
      const Tensor& u = us[std::size_t(begin + b)];
      ops::zero(Tensor(work.squares.data(), DType::u16, device, {4}));  // the double's 8 bytes
      ops::sum_squares(u.reshape({rows * cols}), &work.squares);
      ops::newton_schulz_normalise(matrix(x, b), u, work.squares, p.eps);
    }
    for (std::int64_t step = 0; step < p.steps; ++step) {
      ops::batched_matmul(gram, x, x);         // A = X X^T
      ops::batched_matmul(gram2, gram, gram);  // A A^T = A^2
      ops::scaled_sum(poly, gram, gram2, float(p.b), float(p.c));
      ops::batched_matmul(px, poly, x, /*transpose_weight=*/false);  // poly X
      ops::scaled_sum(other, x, px, float(p.a), 1.0f);
      std::swap(x, other);
    }
    for (std::int64_t b = 0; b < count; ++b) {  // out of the stack, a tall matrix transposed back
      const Tensor& out = outs[std::size_t(begin + b)];
      const Tensor xb = matrix(x, b);
      if (tall && act == DType::f32) {
        ops::transpose(out, xb);
      } else if (tall) {
        const Tensor xt = matrix(other, b).reshape({n, m});  // the last step's X, no longer needed
        ops::transpose(xt, xb);
        ops::convert(out, xt);
      } else if (act == DType::f32) {
        ops::copy(out, xb);
      } else {
        ops::convert(out, xb);
      }
    }
  }
}

void newton_schulz(const Tensor& u, const Tensor& out, const NewtonSchulz& p, NewtonSchulzWork& work) {
  newton_schulz(std::vector<Tensor>{u}, std::vector<Tensor>{out}, p, work);
}

}  // namespace llmtrain::optim
