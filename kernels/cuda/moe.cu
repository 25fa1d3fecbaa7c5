// The Mixture-of-Experts router and token dispatch on the GPU (CPU reference: kernels/cpu/moe.cpp,
// whose arithmetic each kernel follows, double sums included, in the same order).
// - router forward: one thread per token (softmax or sigmoid, top-k by repeated argmax with ties to
//   the lower index, the k weights), then ONE block for the statistics (per-expert counts and mean
//   scores, the z and balance losses), its threads owning experts and walking the tokens in order in
//   chunks, so the sums are the CPU's, in its order.
// - router backward: one thread per token, dp recomputed per expert (no per-token arrays).
// - dispatch plan: one block; thread e counts and ranks its expert's slots in slot order (stable, so
//   capacity drops the latest slots), then the offsets by a prefix sum; no atomics.
// - permute, unpermute and their backward: gathers over the plan, one thread per element (or per
//   slot for the weights' gradient), fp32 arithmetic, bf16 rounded once on each store.
#include "cuda_check.h"
#include "instantiate.cuh"
#include "launch.cuh"
#include "llmtrain/kernels/cuda.h"
#include "vector_io.cuh"

namespace llmtrain::cuda {
namespace {

constexpr int block_threads = 256;

__device__ __forceinline__ bool taken_before(const std::int32_t* et, int j, int e) {
  for (int i = 0; i < j; ++i) {
    if (et[i] == e) return true;
  }
  return false;
}

template <class Elem>
__global__ void router_choose_kernel(float* probs, std::int32_t* experts, float* weights, const Elem* logits,
                                     const Elem* bias, std::int64_t N, int E, int k, bool sigmoid, bool renormalise,
                                     float route_scale) {
  const std::int64_t t = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= N) return;
  const Elem* lt = logits + t * E;
  float* pt = probs + t * E;
  if (sigmoid) {
    for (int e = 0; e < E; ++e) pt[e] = 1.0f / (1.0f + expf(-to_float(lt[e])));
  } else {
    float mx = to_float(lt[0]);
    for (int e = 1; e < E; ++e) mx = fmaxf(mx, to_float(lt[e]));
    double sum = 0.0;
    for (int e = 0; e < E; ++e) {
      pt[e] = expf(to_float(lt[e]) - mx);
      sum += pt[e];
    }
    for (int e = 0; e < E; ++e) pt[e] = float(pt[e] / sum);
  }
  std::int32_t* et = experts + t * k;
  double chosen_sum = 0.0;
  for (int j = 0; j < k; ++j) {
    int best = -1;
    float best_score = 0.0f;
    for (int e = 0; e < E; ++e) {
      if (taken_before(et, j, e)) continue;
      const float s = pt[e] + (bias ? to_float(bias[e]) : 0.0f);
      if (best < 0 || s > best_score) {  // strictly greater: ties go to the lower index
        best = e;
        best_score = s;
      }
    }
    et[j] = best;
    chosen_sum += pt[best];
  }
  for (int j = 0; j < k; ++j) {
    const float p = pt[et[j]];
    weights[t * k + j] = route_scale * (renormalise ? float(p / chosen_sum) : p);
  }
}

// One block: shared doubles pbar[E], count[E], then per chunk token lse (float) and score sums.
template <class Elem>
__global__ void router_stats_kernel(float* counts, float* pbar_out, float* losses, const float* probs, const std::int32_t* experts,
                                    const Elem* logits, std::int64_t N, int E, int k, bool sigmoid) {
  extern __shared__ double shared[];
  double* pbar = shared;
  double* count = shared + E;
  double* score_sum = shared + 2 * E;                                // [blockDim]
  float* lse = reinterpret_cast<float*>(shared + 2 * E + blockDim.x);  // [blockDim]
  for (int e = threadIdx.x; e < E; e += blockDim.x) pbar[e] = count[e] = 0.0;
  double z = 0.0;  // thread 0's
  for (std::int64_t c0 = 0; c0 < N; c0 += blockDim.x) {
    const std::int64_t t = c0 + threadIdx.x;
    if (t < N) {
      const Elem* lt = logits + t * E;
      float mx = to_float(lt[0]);
      for (int e = 1; e < E; ++e) mx = fmaxf(mx, to_float(lt[e]));
      double sum = 0.0;
      for (int e = 0; e < E; ++e) sum += double(expf(to_float(lt[e]) - mx));
      lse[threadIdx.x] = mx + float(log(sum));
      double s = 0.0;
      for (int e = 0; e < E; ++e) s += probs[t * E + e];
      score_sum[threadIdx.x] = s;
    }
    __syncthreads();
    const std::int64_t end = c0 + blockDim.x < N ? c0 + blockDim.x : N;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
      for (std::int64_t u = c0; u < end; ++u) {
        const float p = probs[u * E + e];
        pbar[e] += sigmoid ? p / score_sum[u - c0] : double(p);
        for (int j = 0; j < k; ++j) count[e] += experts[u * k + j] == e ? 1.0 : 0.0;
      }
    }
    if (threadIdx.x == 0) {
      for (std::int64_t u = c0; u < end; ++u) z += double(lse[u - c0]) * lse[u - c0];
    }
    __syncthreads();
  }
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    counts[e] = float(count[e]);
    pbar_out[e] = float(pbar[e] / double(N));
  }
  if (threadIdx.x == 0) {
    double aux = 0.0, most = 0.0;
    for (int e = 0; e < E; ++e) {
      aux += count[e] / double(N) * pbar[e] / double(N);
      most = fmax(most, count[e]);
    }
    losses[0] = float(double(E) / k * aux);
    losses[1] = float(z / double(N));
    losses[2] = float(most / (double(N) * k / E));
  }
}

struct RouterGrad {
  const float* pt;
  const std::int32_t* et;
  const float* dw;
  const float* counts;
  int k;
  bool sigmoid, renormalise;
  float route_scale, aux_scale;
  double S, dot, aux_per_token, score_sum, qdq;
  __device__ double dp(int e) const {
    double d = 0.0;
    for (int j = 0; j < k; ++j) {
      if (et[j] != e) continue;
      d += renormalise ? route_scale * (double(dw[j]) / S - dot / (S * S)) : route_scale * double(dw[j]);
    }
    if (!sigmoid) {
      d += aux_per_token * counts[e];
    } else if (aux_scale != 0.0f) {
      d += (aux_per_token * counts[e] - qdq) / score_sum;
    }
    return d;
  }
};

template <class Elem>
__global__ void router_backward_kernel(Elem* dlogits, const float* dweights, const Elem* logits, const float* probs,
                                       const std::int32_t* experts, const float* counts, std::int64_t N, int E,
                                       int k, bool sigmoid, bool renormalise, float route_scale, float aux_scale,
                                       float z_scale) {
  const std::int64_t t = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= N) return;
  RouterGrad g{probs + t * E, experts + t * k, dweights + t * k, counts, k, sigmoid, renormalise, route_scale,
               aux_scale, 0.0, 0.0, 0.0, 0.0, 0.0};
  g.aux_per_token = double(aux_scale) * double(E) / k / (double(N) * double(N));
  for (int j = 0; j < k; ++j) g.S += g.pt[g.et[j]];
  for (int j = 0; j < k; ++j) g.dot += double(g.dw[j]) * g.pt[g.et[j]];
  if (sigmoid && aux_scale != 0.0f) {
    for (int e = 0; e < E; ++e) g.score_sum += g.pt[e];
    for (int e = 0; e < E; ++e) g.qdq += g.aux_per_token * counts[e] * g.pt[e] / g.score_sum;
  }
  const Elem* lt = logits + t * E;
  float mx = 0.0f;
  double sum = 0.0;
  if (z_scale != 0.0f) {
    mx = to_float(lt[0]);
    for (int e = 1; e < E; ++e) mx = fmaxf(mx, to_float(lt[e]));
    for (int e = 0; e < E; ++e) sum += double(expf(to_float(lt[e]) - mx));
  }
  const float lse = mx + float(log(sum > 0.0 ? sum : 1.0));
  const double zg = 2.0 * double(z_scale) * lse / double(N);
  double pdp = 0.0;
  if (!sigmoid) {
    for (int e = 0; e < E; ++e) pdp += g.pt[e] * g.dp(e);
  }
  Elem* dt = dlogits + t * E;
  for (int e = 0; e < E; ++e) {
    const double p = g.pt[e];
    float d = sigmoid ? float(g.dp(e) * p * (1.0 - p)) : float(p * (g.dp(e) - pdp));
    if (z_scale != 0.0f) d += float(zg * float(double(expf(to_float(lt[e]) - mx)) / sum));
    dt[e] = from_float<Elem>(d);
  }
}

// One block: kept[E] ranks in shared memory, each expert's owned by one thread.
__global__ void dispatch_kernel(std::int32_t* offsets, std::int32_t* row_slot, std::int32_t* slot_row,
                                float* dropped, const std::int32_t* experts, std::int64_t slots, int E,
                                std::int64_t capacity) {
  extern __shared__ std::int32_t kept[];  // [E + 1]: the counts, then their exclusive prefix
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    std::int32_t n = 0;
    for (std::int64_t s = 0; s < slots; ++s) {
      if (experts[s] != e) continue;
      if (capacity > 0 && n >= capacity) {
        slot_row[s] = -1;
        continue;
      }
      slot_row[s] = n++;
    }
    kept[e] = n;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    std::int32_t run = 0;
    for (int e = 0; e < E; ++e) {
      const std::int32_t n = kept[e];
      kept[e] = run;
      offsets[e] = run;
      run += n;
    }
    kept[E] = run;
    offsets[E] = run;
    dropped[0] = float(double(slots - run) / double(slots));
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    for (std::int64_t s = 0; s < slots; ++s) {
      if (experts[s] != e || slot_row[s] < 0) continue;
      slot_row[s] += kept[e];
      row_slot[slot_row[s]] = std::int32_t(s);
    }
  }
  for (std::int64_t r = std::int64_t(kept[E]) + threadIdx.x; r < slots; r += blockDim.x) row_slot[r] = -1;
}

template <class Elem>
__global__ void permute_forward_kernel(Elem* xp, const Elem* x, const std::int32_t* row_slot,
                                       const std::int32_t* offsets, int E, int k, int C) {
  const std::int64_t M = offsets[E];
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < M * C;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t r = i / C, c = i % C;
    xp[i] = x[std::int64_t(row_slot[r] / k) * C + c];
  }
}

template <class Elem>
__global__ void permute_backward_kernel(Elem* dx, const Elem* dxp, const std::int32_t* slot_row, std::int64_t N,
                                        int k, int C, bool accumulate) {
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < N * C;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t t = i / C, c = i % C;
    float d = accumulate ? to_float(dx[i]) : 0.0f;
    for (int j = 0; j < k; ++j) {
      const std::int32_t r = slot_row[t * k + j];
      if (r >= 0) d += to_float(dxp[std::int64_t(r) * C + c]);
    }
    dx[i] = from_float<Elem>(d);
  }
}

template <class Elem>
__global__ void unpermute_forward_kernel(Elem* out, const Elem* y, const float* weights,
                                         const std::int32_t* slot_row, std::int64_t N, int k, int C) {
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < N * C;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t t = i / C, c = i % C;
    float o = 0.0f;
    for (int j = 0; j < k; ++j) {
      const std::int32_t r = slot_row[t * k + j];
      if (r >= 0) o += weights[t * k + j] * to_float(y[std::int64_t(r) * C + c]);
    }
    out[i] = from_float<Elem>(o);
  }
}

template <class Elem>
__global__ void unpermute_dy_kernel(Elem* dy, const Elem* dout, const float* weights, const std::int32_t* row_slot,
                                    const std::int32_t* offsets, int E, int k, int C) {
  const std::int64_t M = offsets[E];
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < M * C;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t r = i / C, c = i % C;
    const std::int32_t s = row_slot[r];
    dy[i] = from_float<Elem>(weights[s] * to_float(dout[std::int64_t(s / k) * C + c]));
  }
}

template <class Elem>
__global__ void unpermute_dweights_kernel(float* dweights, const Elem* dout, const Elem* y,
                                          const std::int32_t* slot_row, std::int64_t slots, int k, int C) {
  const std::int64_t s = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (s >= slots) return;
  const std::int32_t r = slot_row[s];
  double dot = 0.0;
  if (r >= 0) {
    const Elem* g = dout + (s / k) * C;
    const Elem* yr = y + std::int64_t(r) * C;
    for (int c = 0; c < C; ++c) dot += double(to_float(g[c])) * to_float(yr[c]);
  }
  dweights[s] = float(dot);
}

__global__ void bias_update_kernel(float* bias, const float* loads, float mean_load, std::int64_t n, float rate) {
  const std::int64_t e = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= n) return;
  const float gap = mean_load - loads[e];
  bias[e] += gap > 0 ? rate : gap < 0 ? -rate : 0.0f;
}

}  // namespace

template <class Act>
void moe_router_forward(float* probs, std::int32_t* experts, float* weights, float* counts, float* pbar,
                        float* losses, const Act* logits, const Act* bias, std::int64_t N, int E, int k, bool sigmoid,
                        bool normalize, float route_scale, cudaStream_t stream) {
  if (N <= 0) return;
  router_choose_kernel<Act><<<grid_for(N, block_threads, 1 << 30), block_threads, 0, stream>>>(
      probs, experts, weights, logits, bias, N, E, k, sigmoid, sigmoid || normalize, route_scale);
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
  const std::size_t shared = sizeof(double) * (2 * std::size_t(E) + block_threads) + sizeof(float) * block_threads;
  if (shared > 48 * 1024) {
    LLMTRAIN_CUDA_CHECK(cudaFuncSetAttribute(router_stats_kernel<Act>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             int(shared)));
  }
  router_stats_kernel<Act><<<1, block_threads, shared, stream>>>(counts, pbar, losses, probs, experts, logits, N, E, k,
                                                                 sigmoid);
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
}
LLMTRAIN_INSTANTIATE_ACTIVATIONS(moe_router_forward)

template <class Act>
void moe_router_backward(Act* dlogits, const float* dweights, const Act* logits, const float* probs,
                         const std::int32_t* experts, const float* counts, std::int64_t N, int E, int k, bool sigmoid,
                         bool normalize, float route_scale, float aux_scale, float z_scale, cudaStream_t stream) {
  if (N <= 0) return;
  router_backward_kernel<Act><<<grid_for(N, block_threads, 1 << 30), block_threads, 0, stream>>>(
      dlogits, dweights, logits, probs, experts, counts, N, E, k, sigmoid, sigmoid || normalize, route_scale,
      aux_scale, z_scale);
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
}
LLMTRAIN_INSTANTIATE_ACTIVATIONS(moe_router_backward)

void moe_dispatch(std::int32_t* offsets, std::int32_t* row_slot, std::int32_t* slot_row, float* dropped,
                  const std::int32_t* experts, std::int64_t N, int E, int k, std::int64_t capacity,
                  cudaStream_t stream) {
  const std::size_t shared = sizeof(std::int32_t) * (std::size_t(E) + 1);
  if (shared > 48 * 1024) {
    LLMTRAIN_CUDA_CHECK(
        cudaFuncSetAttribute(dispatch_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared)));
  }
  dispatch_kernel<<<1, block_threads, shared, stream>>>(offsets, row_slot, slot_row, dropped, experts, N * k, E,
                                                        capacity);
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
}

template <class Act>
void moe_permute_forward(Act* xp, const Act* x, const std::int32_t* row_slot, const std::int32_t* offsets,
                         std::int64_t N, int E, int k, int C, cudaStream_t stream) {
  if (N <= 0 || C <= 0) return;
  permute_forward_kernel<Act><<<grid_for(N * k * C, block_threads), block_threads, 0, stream>>>(xp, x, row_slot,
                                                                                               offsets, E, k, C);
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
}
LLMTRAIN_INSTANTIATE_ACTIVATIONS(moe_permute_forward)

template <class Act>
void moe_permute_backward(Act* dx, const Act* dxp, const std::int32_t* slot_row, std::int64_t N, int k, int C,
                          bool accumulate, cudaStream_t stream) {
  if (N <= 0 || C <= 0) return;
  permute_backward_kernel<Act><<<grid_for(N * C, block_threads), block_threads, 0, stream>>>(dx, dxp, slot_row, N,
                                                                                            k, C, accumulate);
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
}
LLMTRAIN_INSTANTIATE_ACTIVATIONS(moe_permute_backward)

template <class Act>
void moe_unpermute_forward(Act* out, const Act* y, const float* weights, const std::int32_t* slot_row,
                           std::int64_t N, int k, int C, cudaStream_t stream) {
  if (N <= 0 || C <= 0) return;
  unpermute_forward_kernel<Act><<<grid_for(N * C, block_threads), block_threads, 0, stream>>>(out, y, weights,
                                                                                             slot_row, N, k, C);
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
}
LLMTRAIN_INSTANTIATE_ACTIVATIONS(moe_unpermute_forward)

template <class Act>
void moe_unpermute_backward(Act* dy, float* dweights, const Act* dout, const Act* y, const float* weights,
                            const std::int32_t* row_slot, const std::int32_t* slot_row, const std::int32_t* offsets,
                            std::int64_t N, int E, int k, int C, cudaStream_t stream) {
  if (N <= 0) return;
  if (C > 0) {
    unpermute_dy_kernel<Act><<<grid_for(N * k * C, block_threads), block_threads, 0, stream>>>(
        dy, dout, weights, row_slot, offsets, E, k, C);
    LLMTRAIN_CUDA_CHECK(cudaGetLastError());
  }
  unpermute_dweights_kernel<Act><<<grid_for(N * k, block_threads, 1 << 30), block_threads, 0, stream>>>(
      dweights, dout, y, slot_row, N * k, k, C);
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
}
LLMTRAIN_INSTANTIATE_ACTIVATIONS(moe_unpermute_backward)

void moe_bias_update(float* bias, const float* loads, float mean_load, std::int64_t n, float rate,
                     cudaStream_t stream) {
  if (n <= 0) return;
  bias_update_kernel<<<grid_for(n, block_threads, 1 << 30), block_threads, 0, stream>>>(bias, loads, mean_load, n,
                                                                                        rate);
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
}

}  // namespace llmtrain::cuda
