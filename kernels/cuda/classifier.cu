// Softmax + cross-entropy over the vocabulary, fused with its gradient. One block of 512
// threads per row (V is tens of thousands): one pass keeps a running (max, sum of exp) per
// thread, the "online softmax", then two block reductions give the row's max and sum; a second
// pass writes (softmax - onehot) * scale over the logits, so the probabilities never exist in
// memory: 2 reads + 1 write of the logits in all. Rows are `ld` >= V elements apart: the model
// pads them (the padded vocabulary, GPT-2's 50257 columns in rows of 50304) so that every row
// starts 16-byte aligned and the 128-bit accesses apply whatever V is; a chunk that straddles V
// masks its columns past V, which are never read (they hold whatever the matmul left there), and
// the gradient pass writes them 0. Scalar accesses where ld or the base pointer is not aligned. The per-row losses are
// summed in double by a deterministic two-pass reduction (reduce.cuh), and the sum is copied to
// the host, which waits for the stream; or, given a device double `loss_sum` (training), added
// into it on the stream, so that a micro-step never waits for the GPU (the trainer reads the
// update's sum once). A NaN logit makes its row's loss NaN, as on the CPU (the
// trainer's NaN guard relies on it); a target outside [0, V) gives a NaN loss instead of a read
// out of bounds. bf16 logits (mixed precision): the same kernel, 8 logits per 128-bit access
// when V % 8 == 0; the softmax, the loss and the gradient in fp32, the gradient rounded once to
// bf16 as it overwrites the logits; the losses stay fp32.
//
// The vocabulary-parallel cross-entropy (tensor parallelism: each rank holds a range of columns
// of every row) splits that kernel at its reductions, which the caller completes across ranks:
// a row-max kernel, a kernel for the local sum of exp(x - global max) and the target's logit,
// and a finish: the losses (one thread per row) and, for the gradient, one block per row
// writing (softmax - onehot) * scale over the local columns. Blocks of 256 threads: a rank's
// share of the vocabulary is a few thousand columns (50257 / 8 = 6283). A NaN logit makes its
// rank's sum, and so the row's loss, NaN; a negative target makes target_logit NaN on every rank
// (no rank can tell a target at or above the full V: the caller's data must not hold one).
#include <cmath>

#include "cuda_check.h"
#include "instantiate.cuh"
#include "launch.cuh"
#include "llmtrain/kernels/cuda.h"
#include "reduce.cuh"
#include "vector_io.cuh"

namespace llmtrain::cuda {
namespace {

constexpr int classifier_block = 512;

/// Whether rows ld elements apart from `logits` can be read in 128-bit chunks.
template <class Elem>
bool vectorized(const Elem* logits, std::int64_t ld) {
  return ld % vec_width<Elem> == 0 && aligned16({logits});
}

/// Overwrites the row x (V columns of a padded row of ld) with its gradient (softmax -
/// onehot(target)) * dlogits_scale, the softmax being exp(x - row_max) * inv_sum, and its padding
/// [V, ld) with 0; the block's threads stride over the row.
template <int W, class Elem>
__device__ __forceinline__ void write_dlogits(Elem* x, int V, std::int64_t ld, float row_max, float inv_sum,
                                              std::int64_t target, float dlogits_scale) {
  for (std::int64_t v = threadIdx.x * W; v < ld; v += blockDim.x * W) {
    Chunk<Elem, W> chunk = load_chunk<W>(x + v);
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const float p = v + k < V ? expf(to_float(chunk.e[k]) - row_max) * inv_sum : 0.0f;
      chunk.e[k] = from_float<Elem>((p - (v + k == target ? 1.0f : 0.0f)) * dlogits_scale);
    }
    store_chunk<W>(x + v, chunk);
  }
}

template <class Elem, int W>
__global__ void __launch_bounds__(classifier_block)
    fused_classifier_kernel(Elem* logits /* (N,ld) */, float* losses /* (N) */,
                            const std::int32_t* targets /* (N) */, int V, std::int64_t ld, float dlogits_scale) {
  const std::int64_t row = blockIdx.x;
  Elem* x = logits + row * ld;

  // Running max and sum of exp(x - max) over this thread's share of the row.
  float m = -INFINITY, s = 0.0f;
  for (int v = threadIdx.x * W; v < V; v += blockDim.x * W) {
    const Chunk<Elem, W> chunk = load_chunk<W>(x + v);
#pragma unroll
    for (int k = 0; k < W; ++k) {
      if (v + k >= V) break;  // the padding
      const float value = to_float(chunk.e[k]);
      if (value > m) {
        s = s * expf(m - value) + 1.0f;  // exp(-inf) = 0 for the first element
        m = value;
      } else {
        s += expf(value - m);  // a NaN value lands here and makes s NaN
      }
    }
  }
  const std::int32_t target = targets[row];
  const bool valid_target = target >= 0 && target < V;
  // Read before any thread overwrites the row (the block reductions below synchronise).
  const float target_logit = valid_target ? to_float(x[target]) : NAN;

  const float row_max = block_reduce(m, MaxOp{}, -INFINITY);
  const float scaled = m == -INFINITY ? 0.0f : s * expf(m - row_max);  // threads with no elements add 0
  const float row_sum = block_reduce(scaled, SumOp{}, 0.0f);
  if (threadIdx.x == 0) losses[row] = logf(row_sum) - (target_logit - row_max);

  if (dlogits_scale > 0.0f) write_dlogits<W>(x, V, ld, row_max, 1.0f / row_sum, target, dlogits_scale);
}

struct Identity {
  __device__ double operator()(float x) const { return double(x); }
};

template <class Elem>
double fused_classifier_dispatch(Elem* logits, float* losses, const std::int32_t* targets, std::int64_t N,
                                 int V, std::int64_t ld, float dlogits_scale, double* loss_sum, cudaStream_t stream) {
  if (N <= 0) return 0.0;
  if (N > INT32_MAX) throw kernels::Error("cuda::fused_classifier: more than 2^31 - 1 rows");
  if (vectorized<Elem>(logits, ld)) {
    fused_classifier_kernel<Elem, vec_width<Elem>>
        <<<unsigned(N), classifier_block, 0, stream>>>(logits, losses, targets, V, ld, dlogits_scale);
  } else {
    fused_classifier_kernel<Elem, 1>
        <<<unsigned(N), classifier_block, 0, stream>>>(logits, losses, targets, V, ld, dlogits_scale);
  }
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
  if (loss_sum) {
    sum_into_device(loss_sum, losses, N, Identity{}, stream);
    return 0.0;
  }
  return sum_to_host(losses, N, Identity{}, stream);
}

// ---- the vocabulary-parallel steps --------------------------------------------------------------

constexpr int parallel_block = 256;

template <class Elem, int W>
__global__ void __launch_bounds__(parallel_block)
    classifier_row_max_kernel(float* row_max /* (N) */, const Elem* logits /* (N,ld) */, int V, std::int64_t ld) {
  const Elem* x = logits + std::int64_t(blockIdx.x) * ld;
  float m = -INFINITY;
  for (int v = threadIdx.x * W; v < V; v += blockDim.x * W) {
    const Chunk<Elem, W> chunk = load_chunk<W>(x + v);
#pragma unroll
    for (int k = 0; k < W; ++k) {
      if (v + k < V) m = fmaxf(m, to_float(chunk.e[k]));  // skips NaN, as the CPU's std::max
    }
  }
  m = block_reduce(m, MaxOp{}, -INFINITY);
  if (threadIdx.x == 0) row_max[blockIdx.x] = m;
}

template <class Elem, int W>
__global__ void __launch_bounds__(parallel_block)
    classifier_row_stats_kernel(float* sum_exp /* (N) */, float* target_logit /* (N) */,
                                const Elem* logits /* (N,ld) */, const float* row_max /* (N) */,
                                const std::int32_t* targets /* (N) */, int V, std::int64_t ld,
                                std::int64_t vocab_begin) {
  const Elem* x = logits + std::int64_t(blockIdx.x) * ld;
  const float m = row_max[blockIdx.x];
  float s = 0.0f;
  for (int v = threadIdx.x * W; v < V; v += blockDim.x * W) {
    const Chunk<Elem, W> chunk = load_chunk<W>(x + v);
#pragma unroll
    for (int k = 0; k < W; ++k) {
      if (v + k < V) s += expf(to_float(chunk.e[k]) - m);
    }
  }
  s = block_reduce(s, SumOp{}, 0.0f);
  if (threadIdx.x == 0) {
    sum_exp[blockIdx.x] = s;
    const std::int32_t target = targets[blockIdx.x];
    const std::int64_t local = std::int64_t(target) - vocab_begin;
    // Another rank's target adds 0 here; a negative one is no rank's: NaN on every rank.
    target_logit[blockIdx.x] = target < 0 ? NAN : local >= 0 && local < V ? to_float(x[local]) : 0.0f;
  }
}

__global__ void classifier_losses_kernel(float* losses /* (N) */, const float* row_max, const float* sum_exp,
                                         const float* target_logit /* (N) each */, std::int64_t N) {
  const std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < N) losses[i] = logf(sum_exp[i]) - (target_logit[i] - row_max[i]);
}

template <class Elem, int W>
__global__ void __launch_bounds__(parallel_block)
    classifier_parallel_dlogits_kernel(Elem* logits /* (N,ld) */, const float* row_max, const float* sum_exp,
                                       const std::int32_t* targets /* (N) each */, int V, std::int64_t ld,
                                       std::int64_t vocab_begin, float dlogits_scale) {
  const std::int64_t local_target = std::int64_t(targets[blockIdx.x]) - vocab_begin;
  write_dlogits<W>(logits + std::int64_t(blockIdx.x) * ld, V, ld, row_max[blockIdx.x], 1.0f / sum_exp[blockIdx.x],
                   local_target, dlogits_scale);
}

template <class Elem>
void classifier_row_max_dispatch(float* row_max, const Elem* logits, std::int64_t N, int V, std::int64_t ld,
                                 cudaStream_t stream) {
  if (N <= 0) return;
  if (N > INT32_MAX) throw kernels::Error("cuda::classifier_row_max: more than 2^31 - 1 rows");
  if (vectorized<Elem>(logits, ld)) {
    classifier_row_max_kernel<Elem, vec_width<Elem>>
        <<<unsigned(N), parallel_block, 0, stream>>>(row_max, logits, V, ld);
  } else {
    classifier_row_max_kernel<Elem, 1><<<unsigned(N), parallel_block, 0, stream>>>(row_max, logits, V, ld);
  }
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
}

template <class Elem>
void classifier_row_stats_dispatch(float* sum_exp, float* target_logit, const Elem* logits, const float* row_max,
                                   const std::int32_t* targets, std::int64_t N, int V, std::int64_t ld,
                                   std::int64_t vocab_begin, cudaStream_t stream) {
  if (N <= 0) return;
  if (N > INT32_MAX) throw kernels::Error("cuda::classifier_row_stats: more than 2^31 - 1 rows");
  if (vectorized<Elem>(logits, ld)) {
    classifier_row_stats_kernel<Elem, vec_width<Elem>><<<unsigned(N), parallel_block, 0, stream>>>(
        sum_exp, target_logit, logits, row_max, targets, V, ld, vocab_begin);
  } else {
    classifier_row_stats_kernel<Elem, 1><<<unsigned(N), parallel_block, 0, stream>>>(
        sum_exp, target_logit, logits, row_max, targets, V, ld, vocab_begin);
  }
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
}

template <class Elem>
double classifier_parallel_finish_dispatch(Elem* logits, float* losses, const float* row_max, const float* sum_exp,
                                           const float* target_logit, const std::int32_t* targets, std::int64_t N,
                                           int V, std::int64_t ld, std::int64_t vocab_begin, float dlogits_scale,
                                           double* loss_sum, cudaStream_t stream) {
  if (N <= 0) return 0.0;
  if (N > INT32_MAX) throw kernels::Error("cuda::classifier_parallel_finish: more than 2^31 - 1 rows");
  constexpr int block = 256;
  classifier_losses_kernel<<<grid_for(N, block, INT32_MAX), block, 0, stream>>>(losses, row_max, sum_exp,
                                                                                 target_logit, N);
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
  if (dlogits_scale > 0.0f) {
    if (vectorized<Elem>(logits, ld)) {
      classifier_parallel_dlogits_kernel<Elem, vec_width<Elem>><<<unsigned(N), parallel_block, 0, stream>>>(
          logits, row_max, sum_exp, targets, V, ld, vocab_begin, dlogits_scale);
    } else {
      classifier_parallel_dlogits_kernel<Elem, 1><<<unsigned(N), parallel_block, 0, stream>>>(
          logits, row_max, sum_exp, targets, V, ld, vocab_begin, dlogits_scale);
    }
    LLMTRAIN_CUDA_CHECK(cudaGetLastError());
  }
  if (loss_sum) {
    sum_into_device(loss_sum, losses, N, Identity{}, stream);
    return 0.0;
  }
  return sum_to_host(losses, N, Identity{}, stream);
}

}  // namespace

template <class Act>
double fused_classifier(Act* logits, float* losses, const std::int32_t* targets, std::int64_t N, int V,
                        std::int64_t ld, float dlogits_scale, double* loss_sum, cudaStream_t stream) {
  return fused_classifier_dispatch(logits, losses, targets, N, V, ld, dlogits_scale, loss_sum, stream);
}
LLMTRAIN_INSTANTIATE_ACTIVATIONS(fused_classifier)

template <class Act>
void classifier_row_max(float* row_max, const Act* logits, std::int64_t N, int V, std::int64_t ld,
                        cudaStream_t stream) {
  classifier_row_max_dispatch(row_max, logits, N, V, ld, stream);
}
LLMTRAIN_INSTANTIATE_ACTIVATIONS(classifier_row_max)

template <class Act>
void classifier_row_stats(float* sum_exp, float* target_logit, const Act* logits, const float* row_max,
                          const std::int32_t* targets, std::int64_t N, int V, std::int64_t ld,
                          std::int64_t vocab_begin, cudaStream_t stream) {
  classifier_row_stats_dispatch(sum_exp, target_logit, logits, row_max, targets, N, V, ld, vocab_begin, stream);
}
LLMTRAIN_INSTANTIATE_ACTIVATIONS(classifier_row_stats)

template <class Act>
double classifier_parallel_finish(Act* logits, float* losses, const float* row_max, const float* sum_exp,
                                  const float* target_logit, const std::int32_t* targets, std::int64_t N, int V,
                                  std::int64_t ld, std::int64_t vocab_begin, float dlogits_scale, double* loss_sum,
                                  cudaStream_t stream) {
  return classifier_parallel_finish_dispatch(logits, losses, row_max, sum_exp, target_logit, targets, N, V, ld,
                                             vocab_begin, dlogits_scale, loss_sum, stream);
}
LLMTRAIN_INSTANTIATE_ACTIVATIONS(classifier_parallel_finish)

}  // namespace llmtrain::cuda
