// Attention of one new position against the KV cache (text generation, batch 1), with grouped
// query heads (query head h reads cached head h / (NH / NKV)). One block per query head, 8
// warps; warp w takes keys w, w+8, ...: the lanes split the head's HS channels for the q.k dot
// product (a warp reduction gives every lane the score) and keep an online softmax, a running
// max and sum and the weighted sum of values rescaled whenever the max grows, so no (pos+1)-long
// score row is stored and the cache is read once. The warps' (max, sum, HS accumulators) are
// then merged in shared memory in warp order (deterministic). Accumulators live in shared
// memory, (warps + 1) * HS floats with q, so any head size up to a few thousand fits; the warp
// count shrinks for very large heads. Scalar loads (lanes read consecutive channels, coalesced):
// latency-bound by design (NH blocks); the full-sequence attention used in training is
// elsewhere (flash attention). bf16 (mixed precision): the same kernel reading bf16 q and caches
// into fp32 (q staged in shared memory as fp32), the output rounded once.
#include <cmath>
#include <string>

#include "cuda_check.h"
#include "instantiate.cuh"
#include "launch.cuh"
#include "llmtrain/kernels/cuda.h"
#include "reduce.cuh"
#include "vector_io.cuh"

namespace llmtrain::cuda {
namespace {

constexpr int max_decode_warps = 8;
// Dynamic shared memory: 48 KiB (the most without an opt-in attribute) less room for the static part.
constexpr std::size_t max_dynamic_shared = 47 * 1024;

template <class Elem>
__global__ void attention_decode_kernel(Elem* out /* (C) */, const Elem* q /* (C) */,
                                        const Elem* k_cache /* (maxT,NKV HS) */,
                                        const Elem* v_cache /* (maxT,NKV HS) */, int pos, int HS, int NKV,
                                        int group, float scale) {
  extern __shared__ float shared[];  // q (HS), then each warp's accumulators (warps, HS)
  __shared__ float warp_max[max_decode_warps], warp_sum[max_decode_warps];
  const int h = blockIdx.x;
  const std::int64_t kv_row = std::int64_t(NKV) * HS, kv_head = std::int64_t(h / group) * HS;
  const int lane = threadIdx.x % warp_size, warp = threadIdx.x / warp_size, warps = blockDim.x / warp_size;
  float* q_head = shared;
  float* acc = shared + std::size_t(1 + warp) * HS;

  for (int i = threadIdx.x; i < HS; i += blockDim.x) q_head[i] = to_float(q[std::int64_t(h) * HS + i]);
  for (int i = lane; i < HS; i += warp_size) acc[i] = 0.0f;
  __syncthreads();

  float m = -INFINITY, l = 0.0f;
  for (int t = warp; t <= pos; t += warps) {
    const Elem* k = k_cache + t * kv_row + kv_head;
    float dot = 0.0f;
    for (int i = lane; i < HS; i += warp_size) dot += q_head[i] * to_float(k[i]);
    const float score = warp_reduce(dot, SumOp{}) * scale;  // the same in every lane
    const float m_new = fmaxf(m, score);
    const float correction = expf(m - m_new);  // 0 for the first key (m = -inf)
    const float p = expf(score - m_new);
    l = l * correction + p;
    const Elem* v = v_cache + t * kv_row + kv_head;
    for (int i = lane; i < HS; i += warp_size) acc[i] = acc[i] * correction + p * to_float(v[i]);
    m = m_new;
  }
  if (lane == 0) {
    warp_max[warp] = m;
    warp_sum[warp] = l;
  }
  __syncthreads();

  // Merge: warps that saw no key have max -inf, weight exp(-inf) = 0 (warp 0 always saw key 0).
  float row_max = -INFINITY;
  for (int w = 0; w < warps; ++w) row_max = fmaxf(row_max, warp_max[w]);
  float total = 0.0f;
  for (int w = 0; w < warps; ++w) total += warp_sum[w] * expf(warp_max[w] - row_max);
  const float inv_total = 1.0f / total;
  for (int i = threadIdx.x; i < HS; i += blockDim.x) {
    float o = 0.0f;
    for (int w = 0; w < warps; ++w) o += shared[std::size_t(1 + w) * HS + i] * expf(warp_max[w] - row_max);
    out[std::int64_t(h) * HS + i] = from_float<Elem>(o * inv_total);
  }
}

template <class Elem>
void attention_decode_dispatch(Elem* out, const Elem* q, const Elem* k_cache, const Elem* v_cache, int pos,
                               int C, int NH, int NKV, cudaStream_t stream) {
  if (NH <= 0 || C % NH != 0 || NKV <= 0 || NH % NKV != 0 || pos < 0) {
    throw kernels::Error("cuda::attention_decode: NH must divide C, NKV must divide NH, and pos must be >= 0");
  }
  const int HS = C / NH;
  if (HS == 0) return;
  int warps = max_decode_warps;
  while (warps > 1 && std::size_t(warps + 1) * HS * sizeof(float) > max_dynamic_shared) --warps;
  const std::size_t shared_bytes = std::size_t(warps + 1) * HS * sizeof(float);
  if (shared_bytes > max_dynamic_shared) {
    throw kernels::Error("cuda::attention_decode: head size " + std::to_string(HS) + " is too large");
  }
  const float scale = 1.0f / std::sqrt(float(HS));
  attention_decode_kernel<Elem><<<unsigned(NH), unsigned(warps * warp_size), shared_bytes, stream>>>(
      out, q, k_cache, v_cache, pos, HS, NKV, NH / NKV, scale);
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

template <class Act>
void attention_decode(Act* out, const Act* q, const Act* k_cache, const Act* v_cache, int pos, int C, int NH, int NKV,
                      cudaStream_t stream) {
  attention_decode_dispatch(out, q, k_cache, v_cache, pos, C, NH, NKV, stream);
}
LLMTRAIN_INSTANTIATE_ACTIVATIONS(attention_decode)

}  // namespace llmtrain::cuda
