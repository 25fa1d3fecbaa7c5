// Context parallelism's attention pieces on the GPU (the CPU twins: cpu/context_attention.cpp):
// queries against one block of keys and values at their true positions in the sequence, the
// backward of that block against the merged softmax, the log-sum-exp merge of two blocks'
// results, and the packing of key/value columns. bf16 with head sizes 64 and 128 and 16-byte
// aligned tensors on a GPU of compute capability 9.0 or newer run on tensor cores (context_attention_tc.cu: the flash-attention kernels with
// positions, tiled, fully masked tiles skipped, deterministic). Everything else (fp32, other head
// sizes, unaligned tensors) runs the straightforward kernels here, one warp per query row
// (forward, dQ) or per key (dK, dV: every query row that sees the key, in order, so the sums are
// deterministic without atomics); the lanes split the head's channels, and an online softmax
// keeps no score row.
#include <cmath>
#include <string>
#include <type_traits>

#include "cuda_check.h"
#include "flash_attention_tiles.cuh"
#include "instantiate.cuh"
#include "launch.cuh"
#include "llmtrain/kernels/cuda.h"
#include "reduce.cuh"
#include "vector_io.cuh"

namespace llmtrain::cuda {
namespace {

constexpr int max_per_lane = 8;  // head sizes up to 256
constexpr int warps_per_block = 4;

// Position of local row t of a rank holding chunks `at`.
__device__ __forceinline__ int position(const kernels::Chunks& at, int t) {
  return t < at.len ? at.first * at.len + t : at.second * at.len + (t - at.len);
}
// The keys of chunk i of `at` that position p sees.
__device__ __forceinline__ int seen_in_chunk(const kernels::Chunks& at, int i, int p) {
  const int start = (i == 0 ? at.first : at.second) * at.len;
  return max(0, min(at.len, p - start + 1));
}
__device__ __forceinline__ int chunk_count(const kernels::Chunks& at) { return at.second >= 0 ? 2 : 1; }
__device__ __forceinline__ int chunk_start(const kernels::Chunks& at, int i) {
  return (i == 0 ? at.first : at.second) * at.len;
}

struct Shape {
  int B, Tq, Tk, NH, HS, group;
  std::int64_t QKV, ld, k_col, v_col;
  float scale;
};

// The document mask: seg (B,T) the whole sequences' segment ids (null: none); a key is seen only
// by the queries of its document.
struct Doc {
  const std::int32_t* seg;
  int T;
  __device__ __forceinline__ bool apart(int b, int qp, int kp) const {
    return seg != nullptr && seg[std::int64_t(b) * T + qp] != seg[std::int64_t(b) * T + kp];
  }
};

template <class Elem>
__global__ void block_forward_kernel(float* out, float* lse, const Elem* qkv, const Elem* kv, Shape s,
                                     kernels::Chunks q_at, kernels::Chunks k_at, Doc doc) {
  const int lane = threadIdx.x % warp_size, per = (s.HS + warp_size - 1) / warp_size;
  const std::int64_t rows = std::int64_t(s.B) * s.NH * s.Tq, C = std::int64_t(s.NH) * s.HS;
  for (std::int64_t row = std::int64_t(blockIdx.x) * warps_per_block + threadIdx.x / warp_size; row < rows;
       row += std::int64_t(gridDim.x) * warps_per_block) {
    const int t = int(row % s.Tq), h = int((row / s.Tq) % s.NH), b = int(row / (std::int64_t(s.Tq) * s.NH));
    const int p = position(q_at, t);
    const Elem* q = qkv + (std::int64_t(b) * s.Tq + t) * s.QKV + std::int64_t(h) * s.HS;
    float qv[max_per_lane], acc[max_per_lane];
    for (int c = 0; c < per; ++c) {
      const int i = lane + c * warp_size;
      qv[c] = i < s.HS ? to_float(q[i]) : 0.0f;
      acc[c] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    for (int ci = 0; ci < chunk_count(k_at); ++ci) {
      const int seen = seen_in_chunk(k_at, ci, p);
      for (int j = 0; j < seen; ++j) {
        if (doc.apart(b, p, chunk_start(k_at, ci) + j)) continue;
        const std::int64_t key = (std::int64_t(b) * s.Tk + std::int64_t(ci) * k_at.len + j) * s.ld +
                                 std::int64_t(h / s.group) * s.HS;
        float dot = 0.0f;
        for (int c = 0; c < per; ++c) {
          const int i = lane + c * warp_size;
          if (i < s.HS) dot += qv[c] * to_float(kv[key + s.k_col + i]);
        }
        const float score = warp_reduce(dot, SumOp{}) * s.scale;
        const float m_new = fmaxf(m, score), correction = expf(m - m_new), e = expf(score - m_new);
        l = l * correction + e;
        for (int c = 0; c < per; ++c) {
          const int i = lane + c * warp_size;
          if (i < s.HS) acc[c] = acc[c] * correction + e * to_float(kv[key + s.v_col + i]);
        }
        m = m_new;
      }
    }
    float* o = out + (std::int64_t(b) * s.Tq + t) * C + std::int64_t(h) * s.HS;
    for (int c = 0; c < per; ++c) {
      const int i = lane + c * warp_size;
      if (i < s.HS) o[i] = l > 0.0f ? acc[c] / l : 0.0f;
    }
    if (lane == 0) lse[(std::int64_t(b) * s.NH + h) * s.Tq + t] = l > 0.0f ? m + logf(l) : -INFINITY;
  }
}

// dQ: one warp per query row, over the keys it sees.
template <class Elem>
__global__ void block_backward_dq_kernel(float* dq, const Elem* dout, const Elem* qkv, const Elem* out,
                                         const float* lse, const Elem* kv, Shape s, kernels::Chunks q_at,
                                         kernels::Chunks k_at, Doc doc) {
  const int lane = threadIdx.x % warp_size, per = (s.HS + warp_size - 1) / warp_size;
  const std::int64_t rows = std::int64_t(s.B) * s.NH * s.Tq, C = std::int64_t(s.NH) * s.HS;
  for (std::int64_t row = std::int64_t(blockIdx.x) * warps_per_block + threadIdx.x / warp_size; row < rows;
       row += std::int64_t(gridDim.x) * warps_per_block) {
    const int t = int(row % s.Tq), h = int((row / s.Tq) % s.NH), b = int(row / (std::int64_t(s.Tq) * s.NH));
    const int p = position(q_at, t);
    const std::int64_t r = std::int64_t(b) * s.Tq + t;
    const Elem* q = qkv + r * s.QKV + std::int64_t(h) * s.HS;
    const Elem* dy = dout + r * C + std::int64_t(h) * s.HS;
    const Elem* y = out + r * C + std::int64_t(h) * s.HS;
    float qv[max_per_lane], dyv[max_per_lane], dqv[max_per_lane];
    float D = 0.0f;
    for (int c = 0; c < per; ++c) {
      const int i = lane + c * warp_size;
      qv[c] = i < s.HS ? to_float(q[i]) : 0.0f;
      dyv[c] = i < s.HS ? to_float(dy[i]) : 0.0f;
      dqv[c] = 0.0f;
      if (i < s.HS) D += dyv[c] * to_float(y[i]);
    }
    D = warp_reduce(D, SumOp{});
    const float row_lse = lse[(std::int64_t(b) * s.NH + h) * s.Tq + t];
    for (int ci = 0; ci < chunk_count(k_at); ++ci) {
      const int seen = seen_in_chunk(k_at, ci, p);
      for (int j = 0; j < seen; ++j) {
        if (doc.apart(b, p, chunk_start(k_at, ci) + j)) continue;
        const std::int64_t key = (std::int64_t(b) * s.Tk + std::int64_t(ci) * k_at.len + j) * s.ld +
                                 std::int64_t(h / s.group) * s.HS;
        float dot = 0.0f, dp = 0.0f;
        for (int c = 0; c < per; ++c) {
          const int i = lane + c * warp_size;
          if (i < s.HS) {
            dot += qv[c] * to_float(kv[key + s.k_col + i]);
            dp += dyv[c] * to_float(kv[key + s.v_col + i]);
          }
        }
        const float prob = expf(warp_reduce(dot, SumOp{}) * s.scale - row_lse);
        const float ds = prob * (warp_reduce(dp, SumOp{}) - D) * s.scale;
        for (int c = 0; c < per; ++c) {
          const int i = lane + c * warp_size;
          if (i < s.HS) dqv[c] += ds * to_float(kv[key + s.k_col + i]);
        }
      }
    }
    float* dqh = dq + r * s.QKV + std::int64_t(h) * s.HS;
    for (int c = 0; c < per; ++c) {
      const int i = lane + c * warp_size;
      if (i < s.HS) dqh[i] += dqv[c];
    }
  }
}

// dK, dV: one warp per (batch, key/value head, key), over the query rows of its group that see it.
template <class Elem>
__global__ void block_backward_dkv_kernel(float* dkv, const Elem* dout, const Elem* qkv, const Elem* out,
                                          const float* lse, const Elem* kv, Shape s, kernels::Chunks q_at,
                                          kernels::Chunks k_at, Doc doc) {
  const int lane = threadIdx.x % warp_size, per = (s.HS + warp_size - 1) / warp_size;
  const int NKV = s.NH / s.group;
  const std::int64_t keys = std::int64_t(s.B) * NKV * s.Tk, C = std::int64_t(s.NH) * s.HS;
  for (std::int64_t item = std::int64_t(blockIdx.x) * warps_per_block + threadIdx.x / warp_size; item < keys;
       item += std::int64_t(gridDim.x) * warps_per_block) {
    const int j = int(item % s.Tk), kvh = int((item / s.Tk) % NKV), b = int(item / (std::int64_t(s.Tk) * NKV));
    const int kp = position(k_at, j);
    const std::int64_t key = (std::int64_t(b) * s.Tk + j) * s.ld + std::int64_t(kvh) * s.HS;
    float kvk[max_per_lane], kvv[max_per_lane], dk[max_per_lane], dv[max_per_lane];
    for (int c = 0; c < per; ++c) {
      const int i = lane + c * warp_size;
      kvk[c] = i < s.HS ? to_float(kv[key + s.k_col + i]) : 0.0f;
      kvv[c] = i < s.HS ? to_float(kv[key + s.v_col + i]) : 0.0f;
      dk[c] = dv[c] = 0.0f;
    }
    for (int h = kvh * s.group; h < (kvh + 1) * s.group; ++h) {
      for (int ci = 0; ci < chunk_count(q_at); ++ci) {
        const int start = (ci == 0 ? q_at.first : q_at.second) * q_at.len;
        for (int tt = max(0, kp - start); tt < q_at.len; ++tt) {
          if (doc.apart(b, start + tt, kp)) continue;
          const int t = ci * q_at.len + tt;
          const std::int64_t r = std::int64_t(b) * s.Tq + t;
          const Elem* q = qkv + r * s.QKV + std::int64_t(h) * s.HS;
          const Elem* dy = dout + r * C + std::int64_t(h) * s.HS;
          const Elem* y = out + r * C + std::int64_t(h) * s.HS;
          float dot = 0.0f, dp = 0.0f, D = 0.0f;
          for (int c = 0; c < per; ++c) {
            const int i = lane + c * warp_size;
            if (i < s.HS) {
              const float dyi = to_float(dy[i]);
              dot += to_float(q[i]) * kvk[c];
              dp += dyi * kvv[c];
              D += dyi * to_float(y[i]);
            }
          }
          const float prob = expf(warp_reduce(dot, SumOp{}) * s.scale - lse[(std::int64_t(b) * s.NH + h) * s.Tq + t]);
          const float ds = prob * (warp_reduce(dp, SumOp{}) - warp_reduce(D, SumOp{})) * s.scale;
          for (int c = 0; c < per; ++c) {
            const int i = lane + c * warp_size;
            if (i < s.HS) {
              dk[c] += ds * to_float(q[i]);
              dv[c] += prob * to_float(dy[i]);
            }
          }
        }
      }
    }
    for (int c = 0; c < per; ++c) {
      const int i = lane + c * warp_size;
      if (i < s.HS) {
        dkv[key + s.k_col + i] += dk[c];
        dkv[key + s.v_col + i] += dv[c];
      }
    }
  }
}

__global__ void lse_merge_kernel(float* out, float* lse, const float* block_out, const float* block_lse, int B, int T,
                                 int NH, int HS) {
  const std::int64_t rows = std::int64_t(B) * NH * T;
  for (std::int64_t row = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; row < rows;
       row += std::int64_t(gridDim.x) * blockDim.x) {
    const float lb = block_lse[row];
    if (lb == -INFINITY) continue;
    const int t = int(row % T), h = int((row / T) % NH), b = int(row / (std::int64_t(T) * NH));
    const float la = lse[row], m = fmaxf(la, lb), merged = m + logf(expf(la - m) + expf(lb - m));
    const float wa = expf(la - merged), wb = expf(lb - merged);
    const std::int64_t at = (std::int64_t(b) * T + t) * NH * HS + std::int64_t(h) * HS;
    for (int i = 0; i < HS; ++i) out[at + i] = wa * out[at + i] + wb * block_out[at + i];
    lse[row] = merged;
  }
}

template <class Elem>
__global__ void kv_pack_kernel(Elem* kv, const Elem* qkv, std::int64_t N, int C, int KVC) {
  const std::int64_t W = 2 * std::int64_t(KVC), total = N * W;
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    kv[i] = qkv[(i / W) * (C + W) + C + i % W];
  }
}

template <class Elem>
__global__ void qkv_join_kernel(Elem* dqkv, const float* dq, const float* dkv, std::int64_t N, int C, int KVC) {
  const std::int64_t W = C + 2 * std::int64_t(KVC), total = N * W;
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t n = i / W, c = i % W;
    dqkv[i] = from_float<Elem>(c < C ? dq[i] : dkv[n * 2 * KVC + (c - C)]);
  }
}

Shape shape_of(int B, int Tq, int Tk, int C, int NH, int NKV, int kv_width, const char* what) {
  if (NH <= 0 || C % NH != 0 || NKV <= 0 || NH % NKV != 0) {
    throw kernels::Error(std::string("cuda::") + what + ": NH must divide C and NKV must divide NH");
  }
  const int HS = C / NH, KVC = NKV * HS;
  if (HS > max_per_lane * warp_size) {
    throw kernels::Error(std::string("cuda::") + what + ": head size " + std::to_string(HS) + " above " +
                         std::to_string(max_per_lane * warp_size));
  }
  const std::int64_t k_col = kv_width - 2 * std::int64_t(KVC);
  return {B, Tq, Tk, NH, HS, NH / NKV, std::int64_t(C) + 2 * KVC, kv_width, k_col, k_col + KVC,
          1.0f / std::sqrt(float(HS))};
}

// Whether the current GPU is of compute capability 9.0 or newer, the architectures the
// tensor-core block kernels are compiled for (context_attention_tc.cu).
bool block_kernels_built_for_device() {
  int device = 0, major = 0;
  LLMTRAIN_CUDA_CHECK(cudaGetDevice(&device));
  LLMTRAIN_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  return major >= 9;
}

// The tensor-core kernels: bf16 (checked by the callers), head sizes 64 and 128, 16-byte aligned
// rows (every width is a multiple of HS), grid dimensions in range, on a GPU of compute
// capability 9.0 or newer.
bool on_tensor_cores(const Shape& s, const void* qkv, const void* kv, int B) {
  return (s.HS == 64 || s.HS == 128) && flash::aligned16(qkv) && flash::aligned16(kv) && s.NH <= 65535 &&
         B <= 65535 && block_kernels_built_for_device();
}

flash::BlockShape block_shape(const Shape& s, kernels::Chunks q_at, kernels::Chunks k_at, const std::int32_t* seg,
                              int T) {
  return {s.Tq, s.Tk, s.NH, s.NH / s.group, s.QKV, s.ld, s.k_col, s.v_col, q_at, k_at,
          flash::kLog2e * s.scale, s.scale, seg, T};
}

template <class Elem>
void forward(float* out, float* lse, const Elem* qkv, const Elem* kv, int B, int Tq, int Tk, int C, int NH, int NKV,
             int kv_width, kernels::Chunks q_at, kernels::Chunks k_at, Doc doc, cudaStream_t stream) {
  const Shape s = shape_of(B, Tq, Tk, C, NH, NKV, kv_width, "attention_block_forward");
  const std::int64_t rows = std::int64_t(B) * NH * Tq;
  if (rows == 0) return;
  if constexpr (std::is_same_v<Elem, bf16>) {
    if (on_tensor_cores(s, qkv, kv, B)) {
      const flash::BlockShape bs = block_shape(s, q_at, k_at, doc.seg, doc.T);
      if (s.HS == 64) return flash::block_forward_tc_launch<64>(out, lse, qkv, kv, B, bs, stream);
      return flash::block_forward_tc_launch<128>(out, lse, qkv, kv, B, bs, stream);
    }
  }
  block_forward_kernel<Elem><<<grid_for(rows, warps_per_block), warps_per_block * warp_size, 0, stream>>>(
      out, lse, qkv, kv, s, q_at, k_at, doc);
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
}

template <class Elem>
void backward(float* dq, float* dkv, const Elem* dout, const Elem* qkv, const Elem* out, const float* lse,
              const Elem* kv, int B, int Tq, int Tk, int C, int NH, int NKV, int kv_width, kernels::Chunks q_at,
              kernels::Chunks k_at, Doc doc, cudaStream_t stream) {
  const Shape s = shape_of(B, Tq, Tk, C, NH, NKV, kv_width, "attention_block_backward");
  const std::int64_t rows = std::int64_t(B) * NH * Tq, keys = std::int64_t(B) * NKV * Tk;
  if (rows == 0 || keys == 0) return;
  if constexpr (std::is_same_v<Elem, bf16>) {
    if (on_tensor_cores(s, qkv, kv, B) && flash::aligned16(dout) && flash::aligned16(out)) {
      const flash::BlockShape bs = block_shape(s, q_at, k_at, doc.seg, doc.T);
      if (s.HS == 64) return flash::block_backward_tc_launch<64>(dq, dkv, dout, qkv, out, lse, kv, B, bs, stream);
      return flash::block_backward_tc_launch<128>(dq, dkv, dout, qkv, out, lse, kv, B, bs, stream);
    }
  }
  block_backward_dq_kernel<Elem><<<grid_for(rows, warps_per_block), warps_per_block * warp_size, 0, stream>>>(
      dq, dout, qkv, out, lse, kv, s, q_at, k_at, doc);
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
  block_backward_dkv_kernel<Elem><<<grid_for(keys, warps_per_block), warps_per_block * warp_size, 0, stream>>>(
      dkv, dout, qkv, out, lse, kv, s, q_at, k_at, doc);
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

template <class Act>
void attention_block_forward(float* out, float* lse, const Act* qkv, const Act* kv, int B, int Tq, int Tk, int C,
                             int NH, int NKV, int kv_width, kernels::Chunks q_at, kernels::Chunks k_at,
                             const std::int32_t* seg, int T, cudaStream_t stream) {
  forward(out, lse, qkv, kv, B, Tq, Tk, C, NH, NKV, kv_width, q_at, k_at, Doc{seg, T}, stream);
}
LLMTRAIN_INSTANTIATE_ACTIVATIONS(attention_block_forward)

template <class Act>
void attention_block_backward(float* dq, float* dkv, const Act* dout, const Act* qkv, const Act* out,
                              const float* lse, const Act* kv, int B, int Tq, int Tk, int C, int NH, int NKV,
                              int kv_width, kernels::Chunks q_at, kernels::Chunks k_at, const std::int32_t* seg,
                              int T, cudaStream_t stream) {
  backward(dq, dkv, dout, qkv, out, lse, kv, B, Tq, Tk, C, NH, NKV, kv_width, q_at, k_at, Doc{seg, T}, stream);
}
LLMTRAIN_INSTANTIATE_ACTIVATIONS(attention_block_backward)

void attention_lse_merge(float* out, float* lse, const float* block_out, const float* block_lse, int B, int T, int C,
                         int NH, cudaStream_t stream) {
  if (NH <= 0 || C % NH != 0) throw kernels::Error("cuda::attention_lse_merge: NH must divide C");
  const std::int64_t rows = std::int64_t(B) * NH * T;
  if (rows == 0) return;
  lse_merge_kernel<<<grid_for(rows, 256), 256, 0, stream>>>(out, lse, block_out, block_lse, B, T, NH, C / NH);
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
}

template <class Act>
void kv_pack(Act* kv, const Act* qkv, std::int64_t N, int C, int KVC, cudaStream_t stream) {
  if (N * KVC == 0) return;
  kv_pack_kernel<<<grid_for(N * 2 * KVC, 256), 256, 0, stream>>>(kv, qkv, N, C, KVC);
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
}
LLMTRAIN_INSTANTIATE_ACTIVATIONS(kv_pack)

template <class Act>
void qkv_join(Act* dqkv, const float* dq, const float* dkv, std::int64_t N, int C, int KVC, cudaStream_t stream) {
  if (N == 0) return;
  qkv_join_kernel<<<grid_for(N * (C + 2 * KVC), 256), 256, 0, stream>>>(dqkv, dq, dkv, N, C, KVC);
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
}
LLMTRAIN_INSTANTIATE_ACTIVATIONS(qkv_join)

}  // namespace llmtrain::cuda
