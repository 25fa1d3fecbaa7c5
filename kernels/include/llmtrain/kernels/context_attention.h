// Context parallelism's attention pieces, shared by the CPU and CUDA kernels: which positions of a
// sequence a rank's rows (queries, or a block of keys and values) hold. Under context parallelism
// a sequence of T tokens is cut into 2 CP chunks of T / (2 CP) and rank r holds chunks r and
// 2 CP - 1 - r (head and tail, so that every rank does the same causal work); its local row t is
// at position first * len + t for t < len, else second * len + (t - len).
#pragma once

namespace llmtrain::kernels {

struct Chunks {
  int len = 0;      // rows per chunk
  int first = 0;    // the chunk index of the first len rows
  int second = -1;  // the chunk index of the next len rows; -1: one chunk only
  int count() const { return second >= 0 ? 2 : 1; }
  int rows() const { return len * count(); }
  /// Position (in the whole sequence) of the first row of chunk i (0 or 1).
  int start(int i) const { return (i == 0 ? first : second) * len; }
};

}  // namespace llmtrain::kernels
