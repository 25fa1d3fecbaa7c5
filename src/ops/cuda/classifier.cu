// Softmax + cross-entropy over the vocabulary, fused with its gradient. One block of 512
// threads per row (V is tens of thousands): one pass keeps a running (max, sum of exp) per
// thread, the "online softmax", then two block reductions give the row's max and sum; a second
// pass writes (softmax - onehot) * scale over the logits, so the probabilities never exist in
// memory: 2 reads + 1 write of the logits in all. 128-bit accesses when V % 4 == 0 and the
// logits are aligned, scalar otherwise (GPT-2's V = 50257 is odd). The per-row losses are
// summed in double by a deterministic two-pass reduction (reduce.cuh), and the sum is copied to
// the host, which waits for the stream. A NaN logit makes its row's loss NaN, as on the CPU (the
// trainer's NaN guard relies on it); a target outside [0, V) gives a NaN loss instead of a read
// out of bounds. bf16 logits (mixed precision): the same kernel, 8 logits per 128-bit access
// when V % 8 == 0; the softmax, the loss and the gradient in fp32, the gradient rounded once to
// bf16 as it overwrites the logits; the losses stay fp32.
#include <cmath>

#include "cuda_check.h"
#include "launch.cuh"
#include "kernels.h"
#include "reduce.cuh"
#include "vector_io.cuh"

namespace llmtrain::cuda {
namespace {

constexpr int classifier_block = 512;

template <class Elem, int W>
__global__ void __launch_bounds__(classifier_block)
    fused_classifier_kernel(Elem* logits /* (N,V) */, float* losses /* (N) */,
                            const std::int32_t* targets /* (N) */, int V, float dlogits_scale) {
  const std::int64_t row = blockIdx.x;
  Elem* x = logits + row * V;

  // Running max and sum of exp(x - max) over this thread's share of the row.
  float m = -INFINITY, s = 0.0f;
  for (int v = threadIdx.x * W; v < V; v += blockDim.x * W) {
    const Chunk<Elem, W> chunk = load_chunk<W>(x + v);
#pragma unroll
    for (int k = 0; k < W; ++k) {
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

  if (dlogits_scale > 0.0f) {
    const float inv_sum = 1.0f / row_sum;
    for (int v = threadIdx.x * W; v < V; v += blockDim.x * W) {
      Chunk<Elem, W> chunk = load_chunk<W>(x + v);
#pragma unroll
      for (int k = 0; k < W; ++k) {
        const float p = expf(to_float(chunk.e[k]) - row_max) * inv_sum;
        chunk.e[k] = from_float<Elem>((p - (v + k == target ? 1.0f : 0.0f)) * dlogits_scale);
      }
      store_chunk<W>(x + v, chunk);
    }
  }
}

struct Identity {
  __device__ double operator()(float x) const { return double(x); }
};

template <class Elem>
double fused_classifier_dispatch(Elem* logits, float* losses, const std::int32_t* targets, std::int64_t N,
                                 int V, float dlogits_scale, cudaStream_t stream) {
  if (N <= 0) return 0.0;
  if (N > INT32_MAX) throw RuntimeError("cuda::fused_classifier: more than 2^31 - 1 rows");
  if (V % vec_width<Elem> == 0 && aligned16({logits})) {
    fused_classifier_kernel<Elem, vec_width<Elem>>
        <<<unsigned(N), classifier_block, 0, stream>>>(logits, losses, targets, V, dlogits_scale);
  } else {
    fused_classifier_kernel<Elem, 1>
        <<<unsigned(N), classifier_block, 0, stream>>>(logits, losses, targets, V, dlogits_scale);
  }
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
  return sum_to_host(losses, N, Identity{}, stream);
}

}  // namespace

double fused_classifier(float* logits, float* losses, const std::int32_t* targets, std::int64_t N, int V,
                        float dlogits_scale, cudaStream_t stream) {
  return fused_classifier_dispatch(logits, losses, targets, N, V, dlogits_scale, stream);
}

double fused_classifier(bf16* logits, float* losses, const std::int32_t* targets, std::int64_t N, int V,
                        float dlogits_scale, cudaStream_t stream) {
  return fused_classifier_dispatch(logits, losses, targets, N, V, dlogits_scale, stream);
}

}  // namespace llmtrain::cuda
