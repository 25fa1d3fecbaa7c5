// Causal flash attention in the style of FlashAttention-2. Two families of kernels: bf16 on
// tensor cores for head sizes 64 and 128 (the "tensor cores" sections below: mma.sync, ldmatrix,
// cp.async from mma.cuh), used by the bf16 entry points whenever the tensors are 16-byte aligned;
// and the kernels described next, fp32 on CUDA cores, element type a
// template parameter (loads and stores convert to fp32; all arithmetic is fp32). CPU reference:
// src/ops/cpu/flash_attention.cpp. Instantiated for float and for bf16 (mixed precision: bf16
// qkv, out, dout, dqkv; fp32 lse, D and shared-memory tiles, so the same kernels, tiles and
// shared memory; each bf16 output element is rounded once, dqkv after its fp32 += ).
//
// Forward: a block owns BR query rows of one (b, h) and streams the key/value tiles 0..causal
// limit through shared memory, keeping a running max and sum per row (online softmax, in log2
// units so that exp2f does the work); it writes out and lse = max + log(sum) (natural log).
// Backward, three kernels, no atomics, deterministic (the tensor-core backward's non-default
// single pass, chosen by set_flash_attention_deterministic(false), is described in its section):
//   1. D = rowsum(dout * out) per (b, h, t), into a stream-ordered scratch;
//   2. dK, dV: a block owns a key tile of one (b, kv head) and loops over the query heads of the
//      group and over the query tiles at or after it, recomputing P = exp(S - lse) and
//      dS = P (dP - D); the group's sum stays in registers, in a fixed order;
//   3. dQ: a block owns a query tile of one (b, h) and loops over the key tiles up to the diagonal.
// Every kernel runs 256 threads as a 16 x 16 grid (tx = threadIdx.x % 16 is the lane within a
// half-warp). A thread owns the rows ty + 16 i of the block's own tile and, of a product with
// the streamed tile, the columns tx + 16 j (scores) or the head dimensions tx + 16 j
// (accumulators). The 16 threads of a row are one half-warp, so row max and sum are 4 shuffles.
// Shared memory rows are padded by 4 floats: the float4 reads of the streamed tile (16 lanes, row
// stride HS + 4) then hit distinct banks in each quarter-warp, and rows stay 16-byte aligned.
#include "flash_attention.h"

#include <atomic>
#include <cstdint>
#include <string>
#include <type_traits>

#include "core/error.h"
#include "cuda_check.h"
#include "launch.cuh"
#include "mma.cuh"
#include "vector_io.cuh"

namespace llmtrain::cuda {
namespace {

constexpr int kThreads = 256;  // a 16 x 16 grid of threads
constexpr int kPad = 4;        // floats of padding per shared-memory row
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Tile sizes, chosen here only: rows a block owns and rows it streams per step, per head size.
// Shared memory is 24-75 KB per block for every HS and kernel, so 2 blocks fit an SM on sm_80
// (164 KB) and 3 on sm_90 (228 KB), matching __launch_bounds__(256, 2), which caps registers at
// 128 per thread (ptxas, sm_90: every kernel at or under 128, no spills). Larger tiles would
// raise the flops per shared-memory load, but with fp32 on CUDA cores they run out of registers
// first (HS 128: 32 accumulators per thread per owned tile of 64 rows), and 64-query steps in the
// backward spilled at HS 16 and 32.
template <int HS>
struct Tiles {
  static_assert(HS == 16 || HS == 32 || HS == 64 || HS == 128, "flash attention: HS must be 16, 32, 64 or 128");
  static constexpr int fwd_rows = 64;                                 // query rows per block
  static constexpr int fwd_cols = HS <= 64 ? 64 : 32;                 // keys per step
  static constexpr int dkv_rows = HS <= 64 ? 64 : 32;                 // keys per block
  static constexpr int dkv_cols = 32;                                 // queries per step
  static constexpr int dq_rows = HS <= 64 ? 64 : 32;                  // query rows per block
  static constexpr int dq_cols = 32;                                  // keys per step
};

// fp32 conversion of the element type; all arithmetic is fp32.
template <class scalar_t>
struct Element {
  static __device__ __forceinline__ float load(scalar_t x) { return static_cast<float>(x); }
  static __device__ __forceinline__ scalar_t store(float x) { return static_cast<scalar_t>(x); }
};
// bf16: exact widening; stores round to nearest even.
template <>
struct Element<__nv_bfloat16> {
  static __device__ __forceinline__ float load(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 store(float x) { return __float2bfloat16_rn(x); }
};

// Rows [row0, row0 + ROWS) of one head's HS-wide slice (rows `stride` elements apart) into the
// shared tile (ROWS, HS + kPad) as fp32; rows at or past T are zero. Consecutive threads read
// consecutive elements of a row (coalesced).
template <int ROWS, int HS, class scalar_t>
__device__ __forceinline__ void load_tile(float* tile, const scalar_t* head, std::int64_t stride, int row0, int T) {
  for (int i = threadIdx.x; i < ROWS * HS; i += kThreads) {
    const int r = i / HS, d = i % HS;
    const int t = row0 + r;
    tile[r * (HS + kPad) + d] = t < T ? Element<scalar_t>::load(head[std::int64_t(t) * stride + d]) : 0.0f;
  }
}

__device__ __forceinline__ float component(const float4& v, int k) {
  return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w;
}

// acc[i][j] += a[ty + 16 i] . b[tx + 16 j] over HS: a and b are shared tiles with row stride
// HS + kPad. The a rows are broadcast within each half-warp; the b rows are the padded reads.
template <int HS, int RI, int CJ>
__device__ __forceinline__ void dot_rows(float (&acc)[RI][CJ], const float* a, const float* b, int ty, int tx) {
  constexpr int S = HS + kPad;
#pragma unroll 4
  for (int d = 0; d < HS; d += 4) {
    float4 av[RI], bv[CJ];
#pragma unroll
    for (int i = 0; i < RI; ++i) av[i] = *reinterpret_cast<const float4*>(a + (ty + 16 * i) * S + d);
#pragma unroll
    for (int j = 0; j < CJ; ++j) bv[j] = *reinterpret_cast<const float4*>(b + (tx + 16 * j) * S + d);
#pragma unroll
    for (int i = 0; i < RI; ++i) {
#pragma unroll
      for (int j = 0; j < CJ; ++j) {
        acc[i][j] = fmaf(av[i].x, bv[j].x, acc[i][j]);
        acc[i][j] = fmaf(av[i].y, bv[j].y, acc[i][j]);
        acc[i][j] = fmaf(av[i].z, bv[j].z, acc[i][j]);
        acc[i][j] = fmaf(av[i].w, bv[j].w, acc[i][j]);
      }
    }
  }
}

// acc[i][j] += sum over c < NC of p[ty + 16 i][c] * v[c][tx + 16 j]: p a shared (rows, NC + kPad)
// tile of weights, v a shared (NC, HS + kPad) tile; acc covers head dimensions tx + 16 j.
template <int HS, int NC, int RI>
__device__ __forceinline__ void weighted_rows(float (&acc)[RI][HS / 16], const float* p, const float* v, int ty,
                                              int tx) {
  constexpr int PS = NC + kPad, VS = HS + kPad, DJ = HS / 16;
#pragma unroll 2
  for (int c = 0; c < NC; c += 4) {
    float4 pv[RI];
#pragma unroll
    for (int i = 0; i < RI; ++i) pv[i] = *reinterpret_cast<const float4*>(p + (ty + 16 * i) * PS + c);
#pragma unroll
    for (int cc = 0; cc < 4; ++cc) {
#pragma unroll
      for (int j = 0; j < DJ; ++j) {
        const float vv = v[(c + cc) * VS + tx + 16 * j];
#pragma unroll
        for (int i = 0; i < RI; ++i) acc[i][j] = fmaf(component(pv[i], cc), vv, acc[i][j]);
      }
    }
  }
}

// Max and sum over the 16 lanes of a half-warp (one row); every lane gets the result.
__device__ __forceinline__ float half_warp_max(float x) {
#pragma unroll
  for (int offset = 8; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}
__device__ __forceinline__ float half_warp_sum(float x) {
#pragma unroll
  for (int offset = 8; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// ---- forward ---------------------------------------------------------------------------------

// Grid (query tiles, NH, B); the last query tiles (most keys) are scheduled first.
// score_scale = log2(e) / sqrt(HS): scores in log2 units.
template <class scalar_t, int HS, int BR, int BC>
__global__ void __launch_bounds__(kThreads, 2)
    flash_forward_kernel(scalar_t* out, float* lse, const scalar_t* qkv, int T, int NH, int NKV, float score_scale) {
  static_assert(BR % 16 == 0 && BC % 16 == 0 && HS % 16 == 0, "tiles are multiples of the 16 x 16 thread grid");
  constexpr int RI = BR / 16, CJ = BC / 16, DJ = HS / 16;
  constexpr int RS = HS + kPad, PS = BC + kPad;
  extern __shared__ float4 smem[];
  float* q_s = reinterpret_cast<float*>(smem);  // (BR, RS)
  float* k_s = q_s + BR * RS;                    // (BC, RS)
  float* v_s = k_s + BC * RS;                    // (BC, RS)
  float* p_s = v_s + BC * RS;                    // (BR, PS) probabilities of this step

  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int q0 = int(gridDim.x - 1 - blockIdx.x) * BR;
  const int h = blockIdx.y, b = blockIdx.z, kvh = h / (NH / NKV);
  const int C = NH * HS;
  const std::int64_t C3 = std::int64_t(NH + 2 * NKV) * HS;
  const scalar_t* seq = qkv + std::int64_t(b) * T * C3;
  const scalar_t* k_head = seq + C + std::int64_t(kvh) * HS;
  const scalar_t* v_head = seq + C + std::int64_t(NKV + kvh) * HS;

  load_tile<BR, HS>(q_s, seq + std::int64_t(h) * HS, C3, q0, T);

  float o[RI][DJ] = {};
  float m[RI], l[RI];  // running max (log2 units) and sum of each row
#pragma unroll
  for (int i = 0; i < RI; ++i) {
    m[i] = -INFINITY;
    l[i] = 0.0f;
  }

  const int q_end = min(q0 + BR, T);
  const int n_steps = (q_end - 1) / BC + 1;  // key tiles up to the causal limit of the last row
  for (int step = 0; step < n_steps; ++step) {
    const int k0 = step * BC;
    __syncthreads();  // the previous step is done with k_s, v_s and p_s
    load_tile<BC, HS>(k_s, k_head, C3, k0, T);
    load_tile<BC, HS>(v_s, v_head, C3, k0, T);
    __syncthreads();  // q_s (first step), k_s, v_s loaded

    float s[RI][CJ] = {};
    dot_rows<HS>(s, q_s, k_s, ty, tx);

#pragma unroll
    for (int i = 0; i < RI; ++i) {
      const int q = q0 + ty + 16 * i;
      float row_max = -INFINITY;
#pragma unroll
      for (int j = 0; j < CJ; ++j) {
        const int k = k0 + tx + 16 * j;
        s[i][j] = (k <= q && k < T) ? s[i][j] * score_scale : -INFINITY;
        row_max = fmaxf(row_max, s[i][j]);
      }
      const float m_new = fmaxf(m[i], half_warp_max(row_max));
      // A row with every key so far masked keeps m = -inf; exponentiate against 0 then, so that
      // exp2(-inf - base) is 0 rather than NaN. (Row q always has key 0 in step 0, so this only
      // guards rows past T.)
      const float base = m_new == -INFINITY ? 0.0f : m_new;
      const float correction = exp2f(m[i] - base);
      float row_sum = 0.0f;
#pragma unroll
      for (int j = 0; j < CJ; ++j) {
        const float p = exp2f(s[i][j] - base);
        p_s[(ty + 16 * i) * PS + tx + 16 * j] = p;
        row_sum += p;
      }
      l[i] = l[i] * correction + half_warp_sum(row_sum);
      m[i] = m_new;
#pragma unroll
      for (int j = 0; j < DJ; ++j) o[i][j] *= correction;
    }
    __syncthreads();  // p_s complete
    weighted_rows<HS, BC>(o, p_s, v_s, ty, tx);
  }

#pragma unroll
  for (int i = 0; i < RI; ++i) {
    const int q = q0 + ty + 16 * i;
    if (q >= T) continue;
    const float inv_l = 1.0f / l[i];
    scalar_t* o_row = out + (std::int64_t(b) * T + q) * C + std::int64_t(h) * HS;
#pragma unroll
    for (int j = 0; j < DJ; ++j) o_row[tx + 16 * j] = Element<scalar_t>::store(o[i][j] * inv_l);
    if (tx == 0) lse[(std::int64_t(b) * NH + h) * T + q] = (m[i] + log2f(l[i])) * kLn2;
  }
}

// ---- backward --------------------------------------------------------------------------------

// D (B,NH,T) = rowsum(dout * out): one warp per (b, t, h) row of HS elements, rows in the
// memory order of dout (B,T,NH,HS).
template <class scalar_t, int HS>
__global__ void flash_backward_dot_kernel(float* D, const scalar_t* dout, const scalar_t* out, std::int64_t rows,
                                          int T, int NH) {
  const std::int64_t row = (std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;  // whole warps only: row is uniform across a warp
  float sum = 0.0f;
  for (int d = lane; d < HS; d += 32) {
    sum += Element<scalar_t>::load(dout[row * HS + d]) * Element<scalar_t>::load(out[row * HS + d]);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (lane == 0) {
    const int h = int(row % NH);
    const std::int64_t bt = row / NH;
    D[(bt / T * NH + h) * T + bt % T] = sum;
  }
}

// dK, dV of one key tile of one (b, kv head). Grid (key tiles, NKV, B); key tile 0 (the most
// query tiles) first. score_scale = log2(e) / sqrt(HS); scale = 1 / sqrt(HS).
template <class scalar_t, int HS, int BK, int BQ>
__global__ void __launch_bounds__(kThreads, 2)
    flash_backward_dkdv_kernel(scalar_t* dqkv, const scalar_t* dout, const scalar_t* qkv, const float* lse,
                               const float* D, int T, int NH, int NKV, float score_scale, float scale) {
  static_assert(BK % 16 == 0 && BQ % 16 == 0 && HS % 16 == 0, "tiles are multiples of the 16 x 16 thread grid");
  constexpr int KI = BK / 16, QJ = BQ / 16, DJ = HS / 16;
  constexpr int RS = HS + kPad, PS = BQ + kPad;
  extern __shared__ float4 smem[];
  float* k_s = reinterpret_cast<float*>(smem);  // (BK, RS)
  float* v_s = k_s + BK * RS;                    // (BK, RS)
  float* q_s = v_s + BK * RS;                    // (BQ, RS)
  float* do_s = q_s + BQ * RS;                   // (BQ, RS)
  float* p_s = do_s + BQ * RS;                   // (BK, PS) P transposed
  float* ds_s = p_s + BK * PS;                   // (BK, PS) dS transposed
  float* lse_s = ds_s + BK * PS;                 // (BQ) lse in log2 units
  float* d_s = lse_s + BQ;                       // (BQ)

  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int k0 = blockIdx.x * BK;
  const int kvh = blockIdx.y, b = blockIdx.z, group = NH / NKV;
  const int C = NH * HS;
  const std::int64_t C3 = std::int64_t(NH + 2 * NKV) * HS;
  const scalar_t* seq = qkv + std::int64_t(b) * T * C3;
  const scalar_t* dout_seq = dout + std::int64_t(b) * T * C;

  load_tile<BK, HS>(k_s, seq + C + std::int64_t(kvh) * HS, C3, k0, T);
  load_tile<BK, HS>(v_s, seq + C + std::int64_t(NKV + kvh) * HS, C3, k0, T);

  float dk[KI][DJ] = {}, dv[KI][DJ] = {};
  const int first_q_tile = k0 / BQ;  // the tile holding query k0: earlier queries see no key here
  const int n_q_tiles = (T + BQ - 1) / BQ;
  for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
    const float* lse_row = lse + (std::int64_t(b) * NH + h) * T;
    const float* d_row = D + (std::int64_t(b) * NH + h) * T;
    for (int q_tile = first_q_tile; q_tile < n_q_tiles; ++q_tile) {
      const int q0 = q_tile * BQ;
      __syncthreads();  // the previous step is done with q_s, do_s, p_s, ds_s, lse_s, d_s
      load_tile<BQ, HS>(q_s, seq + std::int64_t(h) * HS, C3, q0, T);
      load_tile<BQ, HS>(do_s, dout_seq + std::int64_t(h) * HS, C, q0, T);
      for (int r = threadIdx.x; r < BQ; r += kThreads) {
        const int q = q0 + r;
        lse_s[r] = q < T ? lse_row[q] * kLog2e : 0.0f;
        d_s[r] = q < T ? d_row[q] : 0.0f;
      }
      __syncthreads();  // k_s, v_s (first step), q_s, do_s, lse_s, d_s loaded

      float s[KI][QJ] = {}, dp[KI][QJ] = {};
      dot_rows<HS>(s, k_s, q_s, ty, tx);   // S^T: keys x queries
      dot_rows<HS>(dp, v_s, do_s, ty, tx);  // dP^T = V dO^T
#pragma unroll
      for (int i = 0; i < KI; ++i) {
        const int k = k0 + ty + 16 * i;
#pragma unroll
        for (int j = 0; j < QJ; ++j) {
          const int r = tx + 16 * j, q = q0 + r;
          // k <= q < T also keeps out padded keys (k >= T) and padded queries.
          const bool visible = k <= q && q < T;
          const float p = visible ? exp2f(s[i][j] * score_scale - lse_s[r]) : 0.0f;
          p_s[(ty + 16 * i) * PS + r] = p;
          ds_s[(ty + 16 * i) * PS + r] = visible ? p * (dp[i][j] - d_s[r]) : 0.0f;
        }
      }
      __syncthreads();  // p_s, ds_s complete
      weighted_rows<HS, BQ>(dv, p_s, do_s, ty, tx);  // dV += P^T dO
      weighted_rows<HS, BQ>(dk, ds_s, q_s, ty, tx);  // dK += dS^T Q (scale applied at the end)
    }
  }

#pragma unroll
  for (int i = 0; i < KI; ++i) {
    const int k = k0 + ty + 16 * i;
    if (k >= T) continue;
    scalar_t* row = dqkv + (std::int64_t(b) * T + k) * C3;
    scalar_t* dk_row = row + C + std::int64_t(kvh) * HS;
    scalar_t* dv_row = row + C + std::int64_t(NKV + kvh) * HS;
#pragma unroll
    for (int j = 0; j < DJ; ++j) {
      const int d = tx + 16 * j;
      dk_row[d] = Element<scalar_t>::store(Element<scalar_t>::load(dk_row[d]) + dk[i][j] * scale);
      dv_row[d] = Element<scalar_t>::store(Element<scalar_t>::load(dv_row[d]) + dv[i][j]);
    }
  }
}

// dQ of one query tile of one (b, h). Grid (query tiles, NH, B); the last tiles first.
template <class scalar_t, int HS, int BQ, int BK>
__global__ void __launch_bounds__(kThreads, 2)
    flash_backward_dq_kernel(scalar_t* dqkv, const scalar_t* dout, const scalar_t* qkv, const float* lse,
                             const float* D, int T, int NH, int NKV, float score_scale, float scale) {
  static_assert(BK % 16 == 0 && BQ % 16 == 0 && HS % 16 == 0, "tiles are multiples of the 16 x 16 thread grid");
  constexpr int QI = BQ / 16, KJ = BK / 16, DJ = HS / 16;
  constexpr int RS = HS + kPad, PS = BK + kPad;
  extern __shared__ float4 smem[];
  float* q_s = reinterpret_cast<float*>(smem);  // (BQ, RS)
  float* do_s = q_s + BQ * RS;                   // (BQ, RS)
  float* k_s = do_s + BQ * RS;                   // (BK, RS)
  float* v_s = k_s + BK * RS;                    // (BK, RS)
  float* ds_s = v_s + BK * RS;                   // (BQ, PS)

  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int q0 = int(gridDim.x - 1 - blockIdx.x) * BQ;
  const int h = blockIdx.y, b = blockIdx.z, kvh = h / (NH / NKV);
  const int C = NH * HS;
  const std::int64_t C3 = std::int64_t(NH + 2 * NKV) * HS;
  const scalar_t* seq = qkv + std::int64_t(b) * T * C3;
  const scalar_t* k_head = seq + C + std::int64_t(kvh) * HS;
  const scalar_t* v_head = seq + C + std::int64_t(NKV + kvh) * HS;

  load_tile<BQ, HS>(q_s, seq + std::int64_t(h) * HS, C3, q0, T);
  load_tile<BQ, HS>(do_s, dout + std::int64_t(b) * T * C + std::int64_t(h) * HS, C, q0, T);
  float row_lse[QI], row_d[QI];  // per owned row: lse in log2 units, D
#pragma unroll
  for (int i = 0; i < QI; ++i) {
    const int q = q0 + ty + 16 * i;
    const std::int64_t at = (std::int64_t(b) * NH + h) * T + q;
    row_lse[i] = q < T ? lse[at] * kLog2e : 0.0f;
    row_d[i] = q < T ? D[at] : 0.0f;
  }

  float dq[QI][DJ] = {};
  const int q_end = min(q0 + BQ, T);
  const int n_steps = (q_end - 1) / BK + 1;
  for (int step = 0; step < n_steps; ++step) {
    const int k0 = step * BK;
    __syncthreads();  // the previous step is done with k_s, v_s, ds_s
    load_tile<BK, HS>(k_s, k_head, C3, k0, T);
    load_tile<BK, HS>(v_s, v_head, C3, k0, T);
    __syncthreads();  // q_s, do_s (first step), k_s, v_s loaded

    float s[QI][KJ] = {}, dp[QI][KJ] = {};
    dot_rows<HS>(s, q_s, k_s, ty, tx);
    dot_rows<HS>(dp, do_s, v_s, ty, tx);
#pragma unroll
    for (int i = 0; i < QI; ++i) {
      const int q = q0 + ty + 16 * i;
#pragma unroll
      for (int j = 0; j < KJ; ++j) {
        const int k = k0 + tx + 16 * j;
        const bool visible = k <= q && q < T;
        const float p = visible ? exp2f(s[i][j] * score_scale - row_lse[i]) : 0.0f;
        ds_s[(ty + 16 * i) * PS + tx + 16 * j] = visible ? p * (dp[i][j] - row_d[i]) : 0.0f;
      }
    }
    __syncthreads();  // ds_s complete
    weighted_rows<HS, BK>(dq, ds_s, k_s, ty, tx);  // dQ += dS K
  }

#pragma unroll
  for (int i = 0; i < QI; ++i) {
    const int q = q0 + ty + 16 * i;
    if (q >= T) continue;
    scalar_t* dq_row = dqkv + (std::int64_t(b) * T + q) * C3 + std::int64_t(h) * HS;
#pragma unroll
    for (int j = 0; j < DJ; ++j) {
      const int d = tx + 16 * j;
      dq_row[d] = Element<scalar_t>::store(Element<scalar_t>::load(dq_row[d]) + dq[i][j] * scale);
    }
  }
}

// ---- tensor cores (bf16, head sizes 64 and 128) ----------------------------------------------
//
// FlashAttention-2 on mma.sync m16n8k16 (bf16 inputs, fp32 accumulation; src/ops/cuda/mma.cuh).
// A block of 4 warps owns kTcRows = 64 query rows of one (b, h), 16 per warp; tiles are bf16 in
// shared memory with rows padded by 8 elements (16 bytes), so that the 8 rows of each ldmatrix
// phase fall on distinct banks and every row stays 16-byte aligned. Global tiles arrive by
// 16-byte cp.async. A thread holds, of its warp's 16 rows, rows g and g + 8 (g = lane / 4) and
// of a 16 x 8 product tile the columns 2t, 2t + 1 (t = lane % 4): row max and sum are 2 shuffles
// within the quad of a row.

constexpr int kTcThreads = 128;  // 4 warps
constexpr int kTcRows = 64;      // query rows per forward block (16 per warp)
constexpr int kTcCols = 64;      // keys per forward step
constexpr int kTcPad = 8;        // bf16 elements of padding per shared row

// Rows [row0, row0 + ROWS) of one head's HS-wide bf16 slice (rows `stride` elements apart, 16-byte
// aligned) into the shared tile (ROWS, HS + kTcPad) by cp.async; rows at or past T are zero.
template <int ROWS, int HS>
__device__ __forceinline__ void tc_load_tile(bf16* tile, const bf16* head, std::int64_t stride, int row0, int T) {
  constexpr int chunks = HS / 8;  // 16-byte pieces per row
  for (int i = threadIdx.x; i < ROWS * chunks; i += kTcThreads) {
    const int r = i / chunks, c = i % chunks;
    bf16* dst = tile + r * (HS + kTcPad) + c * 8;
    const int t = row0 + r;
    if (t < T) {
      tc::cp_async_16(dst, head + std::int64_t(t) * stride + c * 8);
    } else {
      *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
    }
  }
}

// The A fragment (16 x 16) of rows [row0, row0 + 16), columns [16 kk, 16 kk + 16) of a shared
// tile with row stride S.
template <int S>
__device__ __forceinline__ void tc_a_fragment(std::uint32_t (&a)[4], const bf16* tile, int row0, int kk) {
  const int lane = int(threadIdx.x) % 32;
  tc::ldmatrix<4, false>(a, tile + (row0 + (lane / 8 % 2) * 8 + lane % 8) * S + kk * 16 + lane / 16 * 8);
}

// acc (16 x N) += a X^T for one 16-wide k step kk: a the A fragment of those 16 columns, X a
// shared (N, S) tile whose rows are the output columns (keys or queries); so acc = A X^T after
// all k steps.
template <int N, int S>
__device__ __forceinline__ void tc_product_transposed(float (&acc)[N / 8][4], const std::uint32_t (&a)[4],
                                                      const bf16* x, int kk) {
  const int lane = int(threadIdx.x) % 32;
#pragma unroll
  for (int jp = 0; jp < N / 16; ++jp) {
    std::uint32_t f[4];  // B fragments of column tiles 2 jp (f[0], f[1]) and 2 jp + 1
    tc::ldmatrix<4, false>(f, x + (jp * 16 + lane / 16 * 8 + lane % 8) * S + kk * 16 + (lane / 8 % 2) * 8);
    tc::mma_bf16(acc[2 * jp], a, f[0], f[1], acc[2 * jp]);
    tc::mma_bf16(acc[2 * jp + 1], a, f[2], f[3], acc[2 * jp + 1]);
  }
}

// acc (16 x N) += a Y[16 kc .. 16 kc + 16)[col0 .. col0 + N) for one 16-wide k step kc: a the A
// fragment of those 16 columns of the left operand, Y a shared (rows, S) tile read transposed by
// ldmatrix (col0 a multiple of 8).
template <int N, int S>
__device__ __forceinline__ void tc_product(float (&acc)[N / 8][4], const std::uint32_t (&a)[4], const bf16* y, int kc,
                                           int col0) {
  const int lane = int(threadIdx.x) % 32;
#pragma unroll
  for (int dp = 0; dp < N / 16; ++dp) {
    std::uint32_t f[4];  // B fragments of column tiles 2 dp (f[0], f[1]) and 2 dp + 1
    tc::ldmatrix<4, true>(f, y + (kc * 16 + (lane / 8 % 2) * 8 + lane % 8) * S + col0 + dp * 16 + lane / 16 * 8);
    tc::mma_bf16(acc[2 * dp], a, f[0], f[1], acc[2 * dp]);
    tc::mma_bf16(acc[2 * dp + 1], a, f[2], f[3], acc[2 * dp + 1]);
  }
}

// acc (16 x HS) += P Y: P (16 x N) fp32 C fragments, rounded to bf16 in registers as A
// fragments (the C layout of two 16 x 8 tiles is the A layout of one 16 x 16 tile); Y a shared
// (N, S) tile read transposed by ldmatrix.
template <int HS, int N, int S>
__device__ __forceinline__ void tc_accumulate_product(float (&acc)[HS / 8][4], const float (&p)[N / 8][4],
                                                      const bf16* y) {
#pragma unroll
  for (int kc = 0; kc < N / 16; ++kc) {
    const std::uint32_t a[4] = {tc::pack_bf16(p[2 * kc][0], p[2 * kc][1]), tc::pack_bf16(p[2 * kc][2], p[2 * kc][3]),
                                tc::pack_bf16(p[2 * kc + 1][0], p[2 * kc + 1][1]),
                                tc::pack_bf16(p[2 * kc + 1][2], p[2 * kc + 1][3])};
    tc_product<HS, S>(acc, a, y, kc, 0);
  }
}

// Max and sum over the 4 lanes of a quad (the threads of one fragment row).
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Grid (query tiles, NH, B), the last query tiles (most keys) first: the block's rows of one
// (sequence, query head), the key and value heads they read, and the key tiles of BK that the
// causal limit of its last row reaches. Shared by the forward and the dQ kernels.
template <int HS>
struct TcQueryBlock {
  int q0, h, b;
  int C;              // NH HS: width of out, dout
  std::int64_t C3;    // (NH + 2 NKV) HS: width of qkv
  const bf16* seq;    // this sequence's qkv rows
  const bf16* k_head;
  const bf16* v_head;
  int n_steps;
};

template <int HS, int ROWS, int BK>
__device__ __forceinline__ TcQueryBlock<HS> tc_query_block(const bf16* qkv, int T, int NH, int NKV) {
  TcQueryBlock<HS> blk;
  blk.q0 = int(gridDim.x - 1 - blockIdx.x) * ROWS;
  blk.h = blockIdx.y;
  blk.b = blockIdx.z;
  const int kvh = blk.h / (NH / NKV);
  blk.C = NH * HS;
  blk.C3 = std::int64_t(NH + 2 * NKV) * HS;
  blk.seq = qkv + std::int64_t(blk.b) * T * blk.C3;
  blk.k_head = blk.seq + blk.C + std::int64_t(kvh) * HS;
  blk.v_head = blk.seq + blk.C + std::int64_t(NKV + kvh) * HS;
  blk.n_steps = (min(blk.q0 + ROWS, T) - 1) / BK + 1;
  return blk;
}

// Double-buffered K and V (k_s, v_s: 2 x (BK, HS + kTcPad) each), step `step` of blk.n_steps:
// starts the copy of step + 1's tiles into the other buffers, waits until this step's tiles (and
// everything committed before them) have landed, and returns the index of this step's buffers.
template <int HS, int BK>
__device__ __forceinline__ int tc_next_kv(bf16* k_s, bf16* v_s, const TcQueryBlock<HS>& blk, int step, int T) {
  constexpr int S = HS + kTcPad;
  if (step + 1 < blk.n_steps) {
    const int next = (step + 1) % 2, k_next = (step + 1) * BK;
    tc_load_tile<BK, HS>(k_s + next * BK * S, blk.k_head, blk.C3, k_next, T);
    tc_load_tile<BK, HS>(v_s + next * BK * S, blk.v_head, blk.C3, k_next, T);
  }
  tc::cp_async_commit();   // (possibly empty: keeps the group count uniform)
  tc::cp_async_wait<1>();  // every group but the newest
  __syncthreads();
  return step % 2;
}

// Grid (query tiles, NH, B), as TcQueryBlock. Q fragments stay in
// registers for the whole loop; K and V tiles are double-buffered: the copy of step + 1 is in
// flight while step is computed. S = Q K^T (fp32 fragments), masked and scaled to log2 units,
// online softmax in registers; P is rounded to bf16 in registers and is directly the A operand
// of O += P V (the C layout of two 16 x 8 score tiles is the A layout of one 16 x 16 tile).
template <int HS>
__global__ void __launch_bounds__(kTcThreads)
    flash_forward_tc_kernel(bf16* out, float* lse, const bf16* qkv, int T, int NH, int NKV, float score_scale) {
  constexpr int BR = kTcRows, BC = kTcCols, S = HS + kTcPad;
  constexpr int KD = HS / 16;  // k steps of Q K^T
  constexpr int NT = BC / 8;   // 8-key tiles of S per warp row block
  constexpr int DT = HS / 8;   // 8-wide tiles of O
  extern __shared__ float4 smem[];
  bf16* q_s = reinterpret_cast<bf16*>(smem);  // (BR, S)
  bf16* k_s = q_s + BR * S;                    // 2 x (BC, S)
  bf16* v_s = k_s + 2 * BC * S;                // 2 x (BC, S)

  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, g = lane / 4, t = lane % 4;
  const TcQueryBlock<HS> blk = tc_query_block<HS, BR, BC>(qkv, T, NH, NKV);
  const int q0 = blk.q0, h = blk.h, b = blk.b, C = blk.C;
  tc_load_tile<BR, HS>(q_s, blk.seq + std::int64_t(h) * HS, blk.C3, q0, T);
  tc_load_tile<BC, HS>(k_s, blk.k_head, blk.C3, 0, T);
  tc_load_tile<BC, HS>(v_s, blk.v_head, blk.C3, 0, T);
  tc::cp_async_commit();

  const int row_lo = q0 + warp * 16 + g;  // this thread's rows: row_lo and row_lo + 8
  std::uint32_t qf[KD][4];
  float o[DT][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // l: this thread's part of the row sum

  for (int step = 0; step < blk.n_steps; ++step) {
    const int k0 = step * BC;
    const int buffer = tc_next_kv<HS, BC>(k_s, v_s, blk, step, T);  // this step's K, V (and Q) landed
    const bf16* kb = k_s + buffer * BC * S;
    const bf16* vb = v_s + buffer * BC * S;
    if (step == 0) {
#pragma unroll
      for (int kk = 0; kk < KD; ++kk) tc_a_fragment<S>(qf[kk], q_s, warp * 16, kk);
    }

    float s[NT][4] = {};
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) tc_product_transposed<BC, S>(s, qf[kk], kb, kk);

    // Keys past the causal limit of a row or past T are -inf; only tiles reaching past the
    // warp's first row or past T need the test.
    const bool masked = k0 + BC - 1 > q0 + warp * 16 || k0 + BC > T;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int q = row_lo + 8 * hh;
      float row_max = -INFINITY;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int k = k0 + j * 8 + 2 * t + e;
          float& x = s[j][2 * hh + e];
          x = (!masked || (k <= q && k < T)) ? x * score_scale : -INFINITY;
          row_max = fmaxf(row_max, x);
        }
      }
      const float m_new = fmaxf(m[hh], quad_max(row_max));
      // A row with every key so far masked keeps m = -inf: exponentiate against 0 then (only rows
      // past T; row q always sees key 0).
      const float base = m_new == -INFINITY ? 0.0f : m_new;
      const float correction = exp2f(m[hh] - base);
      float row_sum = 0.0f;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[j][2 * hh + e];
          x = exp2f(x - base);
          row_sum += x;
        }
      }
      l[hh] = l[hh] * correction + row_sum;
      m[hh] = m_new;
#pragma unroll
      for (int d = 0; d < DT; ++d) {
        o[d][2 * hh] *= correction;
        o[d][2 * hh + 1] *= correction;
      }
    }

    tc_accumulate_product<HS, BC, S>(o, s, vb);  // O += P V
    __syncthreads();  // every warp is done with this step's buffers before step + 2 refills them
  }

#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int q = row_lo + 8 * hh;
    const float row_l = quad_sum(l[hh]);
    if (q >= T) continue;
    const float inv_l = 1.0f / row_l;
    bf16* o_row = out + (std::int64_t(b) * T + q) * C + std::int64_t(h) * HS;
#pragma unroll
    for (int d = 0; d < DT; ++d) {
      *reinterpret_cast<__nv_bfloat162*>(o_row + d * 8 + 2 * t) =
          __floats2bfloat162_rn(o[d][2 * hh] * inv_l, o[d][2 * hh + 1] * inv_l);
    }
    if (t == 0) lse[(std::int64_t(b) * NH + h) * T + q] = (m[hh] + log2f(row_l)) * kLn2;
  }
}

// ---- tensor-core backward --------------------------------------------------------------------
//
// By default two kernels after D = rowsum(dO O) (flash_backward_dot_kernel), no atomics,
// deterministic:
//   dK, dV: a block owns 64 keys of one (b, kv head), 16 per warp, and streams the query tiles of
//     every query head of the group (double-buffered cp.async of Q, dO, lse and D). Per tile a
//     warp computes S^T = K Q^T and dP^T = V dO^T on tensor cores, P^T = exp2(S^T - lse) and
//     dS^T = P^T (dP^T - D) in registers, then dV += P^T dO and dK += dS^T Q with P^T and dS^T
//     rounded to bf16 in registers as the A operands.
//   dQ: a block owns 64 queries of one (b, h), 16 per warp, and streams the key tiles up to the
//     diagonal; it recomputes S and dP (the price of a deterministic dQ without atomics or a
//     per-key-block scratch of partial dQ) and accumulates dQ += dS K.
// Single pass, after set_flash_attention_deterministic(false) (train.deterministic false): the
// dK/dV kernel with its DQ flag on computes S and dP once. Each warp also stores its dS (bf16,
// the operand dK uses) into a shared (queries x 64 keys) tile; after a barrier the 4 warps split
// the tile's dQ += dS K (16 query rows x 64 head dimensions each, the block's 64 keys as the k
// dimension, K from the block's own key tile) and add it by atomicAdd (result unused) into
// an fp32 (B, T, NH HS) accumulator, zeroed before; flash_backward_add_dq_kernel then adds
// scale times it into dqkv's query columns, rounding once. The key blocks' additions to a dQ
// element arrive in an order that varies run to run, so dQ's fp32 sums (and, rarely, its bf16
// rounding) do too; dK and dV stay deterministic.
// Keys per dK/dV block and queries per dQ block: 64; streamed rows per step: 64 at HS 64 and 32
// at HS 128 (registers: the HS 128 accumulators alone are 2 x 64 floats per thread in dK/dV).

template <int HS>
struct TcBackwardTiles {
  static constexpr int cols = HS == 128 ? 32 : 64;  // streamed rows per step
};

// Copies (fp32, 16 bytes of 4) of `rows` values of a row of lse (times log2 e) or D into shared
// memory for rows [q0, q0 + rows); past T: 0.
template <int ROWS>
__device__ __forceinline__ void tc_load_row_values(float* lse_s, float* d_s, const float* lse_row, const float* d_row,
                                                   int q0, int T) {
  for (int r = threadIdx.x; r < ROWS; r += kTcThreads) {
    const int q = q0 + r;
    lse_s[r] = q < T ? lse_row[q] * kLog2e : 0.0f;
    d_s[r] = q < T ? d_row[q] : 0.0f;
  }
}

// Adds `scale` times a 16 x HS fp32 accumulator (C fragments, rows row_lo and row_lo + 8 of this
// thread) into bf16 rows of dqkv at `base` (row r at base + r * C3), rows at or past T skipped.
template <int HS>
__device__ __forceinline__ void tc_add_rows(bf16* base, std::int64_t C3, const float (&acc)[HS / 8][4], int row_lo,
                                            int T, float scale) {
  const int t = int(threadIdx.x) % 4;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int r = row_lo + 8 * hh;
    if (r >= T) continue;
    bf16* row = base + std::int64_t(r) * C3;
#pragma unroll
    for (int d = 0; d < HS / 8; ++d) {
      auto* at = reinterpret_cast<__nv_bfloat162*>(row + d * 8 + 2 * t);
      const float2 old = __bfloat1622float2(*at);
      *at = __floats2bfloat162_rn(old.x + acc[d][2 * hh] * scale, old.y + acc[d][2 * hh + 1] * scale);
    }
  }
}

// dS (BQ queries x kTcRows keys, row stride kTcRows + kTcPad) into shared memory as bf16, from this
// warp's dS^T C fragments (its 16 keys from warp_key0 x BQ queries): the A operand of dQ += dS K.
// The lanes of one store hit 4 rows 2 apart (row stride 36 words) and 4 consecutive words each:
// distinct banks.
template <int BQ>
__device__ __forceinline__ void tc_store_ds(bf16* ds_s, const float (&dst)[BQ / 8][4], int warp_key0) {
  constexpr int DS = kTcRows + kTcPad;
  const int lane = int(threadIdx.x) % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int j = 0; j < BQ / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      ds_s[(j * 8 + 2 * t + e % 2) * DS + warp_key0 + g + 8 * (e / 2)] = __float2bfloat16_rn(dst[j][e]);
    }
  }
}

// dQ rows [q0, q0 + BQ) of one (b, h) += dS K, added by atomicAdd into the fp32 accumulator dq
// (query q's row at dq + q * C; rows at or past T skipped): ds_s the shared dS tile of
// tc_store_ds, k_s the block's (kTcRows, HS + kTcPad) key tile. The 4 warps split the product:
// 16 query rows and HS BQ / 64 head dimensions each (BQ 64 at HS 64, 32 at HS 128: 64 either
// way), in passes of 32 head dimensions, with the A fragments of the warp's dS rows held across.
template <int HS, int BQ>
__device__ __forceinline__ void tc_atomic_add_dq(float* dq, int C, const bf16* ds_s, const bf16* k_s, int q0, int T) {
  constexpr int DS = kTcRows + kTcPad, S = HS + kTcPad, KC = kTcRows / 16;
  constexpr int warps = kTcThreads / 32, row_blocks = BQ / 16, col_groups = warps / row_blocks;
  constexpr int cols = HS / col_groups, pass = 32;  // head dimensions per warp, per pass
  static_assert(warps % row_blocks == 0 && cols % pass == 0, "tc_atomic_add_dq: the warps must tile the product");
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, g = lane / 4, t = lane % 4;
  const int r0 = warp % row_blocks * 16, c0 = warp / row_blocks * cols;
  std::uint32_t a[KC][4];  // dS rows [r0, r0 + 16), keys in steps of 16
#pragma unroll
  for (int kc = 0; kc < KC; ++kc) tc_a_fragment<DS>(a[kc], ds_s, r0, kc);
#pragma unroll
  for (int col = c0; col < c0 + cols; col += pass) {
    float acc[pass / 8][4] = {};
#pragma unroll
    for (int kc = 0; kc < KC; ++kc) tc_product<pass, S>(acc, a[kc], k_s, kc, col);
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int q = q0 + r0 + g + 8 * hh;
      if (q >= T) continue;
      float* row = dq + std::int64_t(q) * C + col + 2 * t;
#pragma unroll
      for (int d = 0; d < pass / 8; ++d) {
        atomicAdd(row + d * 8, acc[d][2 * hh]);
        atomicAdd(row + d * 8 + 1, acc[d][2 * hh + 1]);
      }
    }
  }
}

// Grid (key tiles, NKV, B); key tile 0 (the most query tiles) first. DQ: the single pass, which
// also adds dQ (unscaled) into dq_accum (B, T, NH HS) fp32 by atomics; else dq_accum is unused.
template <int HS, int BQ, bool DQ>
__global__ void __launch_bounds__(kTcThreads)
    flash_backward_dkdv_tc_kernel(bf16* dqkv, float* dq_accum, const bf16* dout, const bf16* qkv, const float* lse,
                                  const float* D, int T, int NH, int NKV, float score_scale, float scale) {
  constexpr int BK = kTcRows, S = HS + kTcPad, KD = HS / 16, NT = BQ / 8, DT = HS / 8;
  extern __shared__ float4 smem[];
  bf16* k_s = reinterpret_cast<bf16*>(smem);  // (BK, S)
  bf16* v_s = k_s + BK * S;                    // (BK, S)
  bf16* q_s = v_s + BK * S;                    // 2 x (BQ, S)
  bf16* do_s = q_s + 2 * BQ * S;               // 2 x (BQ, S)
  float* lse_s = reinterpret_cast<float*>(do_s + 2 * BQ * S);  // 2 x BQ, log2 units
  float* d_s = lse_s + 2 * BQ;                                 // 2 x BQ
  [[maybe_unused]] bf16* ds_s = reinterpret_cast<bf16*>(d_s + 2 * BQ);  // DQ only: (BQ, BK + kTcPad), dS

  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, g = lane / 4, t = lane % 4;
  const int k0 = blockIdx.x * BK;
  const int kvh = blockIdx.y, b = blockIdx.z, group = NH / NKV;
  const int C = NH * HS;
  const std::int64_t C3 = std::int64_t(NH + 2 * NKV) * HS;
  const bf16* seq = qkv + std::int64_t(b) * T * C3;
  const bf16* dout_seq = dout + std::int64_t(b) * T * C;

  const int first_q_tile = k0 / BQ;  // earlier queries see no key of this block
  const int per_head = (T + BQ - 1) / BQ - first_q_tile;
  const int n_iter = group * per_head;
  // Iteration i: query head kvh group + i / per_head, query tile first_q_tile + i % per_head.
  const auto load = [&](int i, int buffer) {
    const int h = kvh * group + i / per_head, q0 = (first_q_tile + i % per_head) * BQ;
    tc_load_tile<BQ, HS>(q_s + buffer * BQ * S, seq + std::int64_t(h) * HS, C3, q0, T);
    tc_load_tile<BQ, HS>(do_s + buffer * BQ * S, dout_seq + std::int64_t(h) * HS, C, q0, T);
    const std::int64_t at = (std::int64_t(b) * NH + h) * T;
    tc_load_row_values<BQ>(lse_s + buffer * BQ, d_s + buffer * BQ, lse + at, D + at, q0, T);
  };
  tc_load_tile<BK, HS>(k_s, seq + C + std::int64_t(kvh) * HS, C3, k0, T);
  tc_load_tile<BK, HS>(v_s, seq + C + std::int64_t(NKV + kvh) * HS, C3, k0, T);
  load(0, 0);
  tc::cp_async_commit();

  const int key_lo = k0 + warp * 16 + g;  // this thread's keys: key_lo and key_lo + 8
  float dk[DT][4] = {}, dv[DT][4] = {};
  for (int i = 0; i < n_iter; ++i) {
    if (i + 1 < n_iter) load(i + 1, (i + 1) % 2);
    tc::cp_async_commit();
    tc::cp_async_wait<1>();
    __syncthreads();  // this iteration's tiles and row values are in place
    const int q0 = (first_q_tile + i % per_head) * BQ;
    const bf16* qb = q_s + (i % 2) * BQ * S;
    const bf16* dob = do_s + (i % 2) * BQ * S;
    const float* lse_b = lse_s + (i % 2) * BQ;
    const float* d_b = d_s + (i % 2) * BQ;

    float st[NT][4] = {}, dpt[NT][4] = {};  // S^T and dP^T: this warp's 16 keys x BQ queries
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) {
      std::uint32_t ka[4], va[4];
      tc_a_fragment<S>(ka, k_s, warp * 16, kk);
      tc_a_fragment<S>(va, v_s, warp * 16, kk);
      tc_product_transposed<BQ, S>(st, ka, qb, kk);   // S^T = K Q^T
      tc_product_transposed<BQ, S>(dpt, va, dob, kk);  // dP^T = V dO^T
    }
    // P^T and dS^T in place; k <= q < T also keeps out padded keys and queries.
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int k = key_lo + 8 * (e / 2), c = j * 8 + 2 * t + e % 2, q = q0 + c;
        const bool visible = k <= q && q < T;
        const float p = visible ? exp2f(st[j][e] * score_scale - lse_b[c]) : 0.0f;
        dpt[j][e] = visible ? p * (dpt[j][e] - d_b[c]) : 0.0f;
        st[j][e] = p;
      }
    }
    if constexpr (DQ) tc_store_ds<BQ>(ds_s, dpt, warp * 16);
    tc_accumulate_product<HS, BQ, S>(dv, st, dob);  // dV += P^T dO
    tc_accumulate_product<HS, BQ, S>(dk, dpt, qb);  // dK += dS^T Q (scale applied at the end)
    if constexpr (DQ) {
      __syncthreads();  // ds_s complete
      const int h = kvh * group + i / per_head;
      tc_atomic_add_dq<HS, BQ>(dq_accum + std::int64_t(b) * T * C + std::int64_t(h) * HS, C, ds_s, k_s, q0, T);
    }
    __syncthreads();  // every warp is done with this buffer before iteration i + 2 refills it
  }

  bf16* dseq = dqkv + std::int64_t(b) * T * C3;
  tc_add_rows<HS>(dseq + C + std::int64_t(kvh) * HS, C3, dk, key_lo, T, scale);
  tc_add_rows<HS>(dseq + C + std::int64_t(NKV + kvh) * HS, C3, dv, key_lo, T, 1.0f);
}

// dqkv's query columns += scale dq, dq (B, T, C) the single pass's fp32 accumulator: 8 elements
// per thread and access (C is a multiple of 64; dqkv is 16-byte aligned, and so are its rows).
__global__ void flash_backward_add_dq_kernel(bf16* dqkv, const float* dq, std::int64_t n8, int C, std::int64_t C3,
                                             float scale) {
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n8;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t e = i * 8, bt = e / C;
    bf16* at = dqkv + bt * C3 + e % C;
    float sum[8], add[8];
    load_floats<8>(at, sum);
    load_floats<8>(dq + e, add);
#pragma unroll
    for (int k = 0; k < 8; ++k) sum[k] += add[k] * scale;
    store_floats<8>(at, sum);
  }
}

// Grid (query tiles, NH, B), as TcQueryBlock.
template <int HS, int BK>
__global__ void __launch_bounds__(kTcThreads)
    flash_backward_dq_tc_kernel(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse, const float* D,
                                int T, int NH, int NKV, float score_scale, float scale) {
  constexpr int BQ = kTcRows, S = HS + kTcPad, KD = HS / 16, NT = BK / 8, DT = HS / 8;
  extern __shared__ float4 smem[];
  bf16* q_s = reinterpret_cast<bf16*>(smem);  // (BQ, S)
  bf16* do_s = q_s + BQ * S;                   // (BQ, S)
  bf16* k_s = do_s + BQ * S;                   // 2 x (BK, S)
  bf16* v_s = k_s + 2 * BK * S;                // 2 x (BK, S)

  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, g = lane / 4, t = lane % 4;
  const TcQueryBlock<HS> blk = tc_query_block<HS, BQ, BK>(qkv, T, NH, NKV);
  const int q0 = blk.q0, h = blk.h, b = blk.b, C = blk.C;
  tc_load_tile<BQ, HS>(q_s, blk.seq + std::int64_t(h) * HS, blk.C3, q0, T);
  tc_load_tile<BQ, HS>(do_s, dout + std::int64_t(b) * T * C + std::int64_t(h) * HS, C, q0, T);
  tc_load_tile<BK, HS>(k_s, blk.k_head, blk.C3, 0, T);
  tc_load_tile<BK, HS>(v_s, blk.v_head, blk.C3, 0, T);
  tc::cp_async_commit();

  const int row_lo = q0 + warp * 16 + g;
  float row_lse[2], row_d[2];  // lse in log2 units and D of rows row_lo, row_lo + 8
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int q = row_lo + 8 * hh;
    const std::int64_t at = (std::int64_t(b) * NH + h) * T + q;
    row_lse[hh] = q < T ? lse[at] * kLog2e : 0.0f;
    row_d[hh] = q < T ? D[at] : 0.0f;
  }

  float dq[DT][4] = {};
  for (int step = 0; step < blk.n_steps; ++step) {
    const int k0 = step * BK;
    const int buffer = tc_next_kv<HS, BK>(k_s, v_s, blk, step, T);
    const bf16* kb = k_s + buffer * BK * S;
    const bf16* vb = v_s + buffer * BK * S;

    float s[NT][4] = {}, dp[NT][4] = {};
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) {
      std::uint32_t qa[4], doa[4];
      tc_a_fragment<S>(qa, q_s, warp * 16, kk);
      tc_a_fragment<S>(doa, do_s, warp * 16, kk);
      tc_product_transposed<BK, S>(s, qa, kb, kk);    // S = Q K^T
      tc_product_transposed<BK, S>(dp, doa, vb, kk);  // dP = dO V^T
    }
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int hh = e / 2, q = row_lo + 8 * hh, k = k0 + j * 8 + 2 * t + e % 2;
        const bool visible = k <= q && q < T;
        const float p = visible ? exp2f(s[j][e] * score_scale - row_lse[hh]) : 0.0f;
        dp[j][e] = visible ? p * (dp[j][e] - row_d[hh]) : 0.0f;
      }
    }
    tc_accumulate_product<HS, BK, S>(dq, dp, kb);  // dQ += dS K (scale applied at the end)
    __syncthreads();
  }
  tc_add_rows<HS>(dqkv + std::int64_t(b) * T * blk.C3 + std::int64_t(h) * HS, blk.C3, dq, row_lo, T, scale);
}

// ---- launchers -------------------------------------------------------------------------------

// set_flash_attention_deterministic: false selects the single-pass tensor-core backward.
std::atomic<bool> deterministic_backward{true};

constexpr std::size_t tile_bytes(int rows, int width) { return std::size_t(rows) * (width + kPad) * sizeof(float); }

// Dynamic shared memory above 48 KB needs an opt-in per kernel.
constexpr std::size_t max_shared_bytes = 99 * 1024;  // the per-block limit of sm_86/89; 2 blocks per sm_80 SM
template <class Kernel>
void allow_shared_memory(Kernel* kernel, std::size_t bytes) {
  LLMTRAIN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
}

int n_tiles(int T, int rows) { return (T + rows - 1) / rows; }

constexpr std::size_t tc_tile_bytes(int rows, int hs) { return std::size_t(rows) * (hs + kTcPad) * sizeof(bf16); }

bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

template <int HS>
void forward_tc_launch(bf16* out, float* lse, const bf16* qkv, int B, int T, int NH, int NKV, cudaStream_t stream) {
  constexpr std::size_t smem = tc_tile_bytes(kTcRows, HS) + 4 * tc_tile_bytes(kTcCols, HS);
  static_assert(smem <= max_shared_bytes, "tensor-core flash forward: tiles too large for shared memory");
  auto* kernel = flash_forward_tc_kernel<HS>;
  allow_shared_memory(kernel, smem);
  const float score_scale = kLog2e / sqrtf(float(HS));
  kernel<<<dim3(n_tiles(T, kTcRows), NH, B), kTcThreads, smem, stream>>>(out, lse, qkv, T, NH, NKV, score_scale);
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
}

template <class scalar_t, int HS>
void forward_launch(scalar_t* out, float* lse, const scalar_t* qkv, int B, int T, int NH, int NKV,
                    cudaStream_t stream) {
  constexpr int BR = Tiles<HS>::fwd_rows, BC = Tiles<HS>::fwd_cols;
  constexpr std::size_t smem = tile_bytes(BR, HS) + 2 * tile_bytes(BC, HS) + tile_bytes(BR, BC);
  static_assert(smem <= max_shared_bytes, "flash forward: tiles too large for shared memory");
  auto* kernel = flash_forward_kernel<scalar_t, HS, BR, BC>;
  allow_shared_memory(kernel, smem);
  const float score_scale = kLog2e / sqrtf(float(HS));
  kernel<<<dim3(n_tiles(T, BR), NH, B), kThreads, smem, stream>>>(out, lse, qkv, T, NH, NKV, score_scale);
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
}

// dq_accum: null for the deterministic two kernels; else the single pass's fp32 (B, T, NH HS)
// accumulator (scratch, zeroed here).
template <int HS>
void backward_tc_launch(bf16* dqkv, float* dq_accum, const bf16* dout, const bf16* qkv, const float* lse,
                        const float* D, int B, int T, int NH, int NKV, float score_scale, float scale,
                        cudaStream_t stream) {
  constexpr int cols = TcBackwardTiles<HS>::cols;
  constexpr std::size_t dkdv_smem =
      2 * tc_tile_bytes(kTcRows, HS) + 4 * tc_tile_bytes(cols, HS) + 4 * cols * sizeof(float);
  static_assert(dkdv_smem <= max_shared_bytes, "tensor-core flash backward dK/dV: tiles too large for shared memory");
  const dim3 dkdv_grid(n_tiles(T, kTcRows), NKV, B);
  if (dq_accum != nullptr) {
    constexpr std::size_t smem = dkdv_smem + std::size_t(cols) * (kTcRows + kTcPad) * sizeof(bf16);  // + dS
    static_assert(smem <= max_shared_bytes,
                  "tensor-core flash backward, single pass: tiles too large for shared memory");
    const std::int64_t n = std::int64_t(B) * T * NH * HS;
    LLMTRAIN_CUDA_CHECK(cudaMemsetAsync(dq_accum, 0, std::size_t(n) * sizeof(float), stream));
    auto* kernel = flash_backward_dkdv_tc_kernel<HS, cols, true>;
    allow_shared_memory(kernel, smem);
    kernel<<<dkdv_grid, kTcThreads, smem, stream>>>(dqkv, dq_accum, dout, qkv, lse, D, T, NH, NKV, score_scale, scale);
    LLMTRAIN_CUDA_CHECK(cudaGetLastError());
    constexpr int block = 256;
    flash_backward_add_dq_kernel<<<grid_for(n / 8, block), block, 0, stream>>>(
        dqkv, dq_accum, n / 8, NH * HS, std::int64_t(NH + 2 * NKV) * HS, scale);
    LLMTRAIN_CUDA_CHECK(cudaGetLastError());
    return;
  }
  {
    auto* kernel = flash_backward_dkdv_tc_kernel<HS, cols, false>;
    allow_shared_memory(kernel, dkdv_smem);
    kernel<<<dkdv_grid, kTcThreads, dkdv_smem, stream>>>(dqkv, nullptr, dout, qkv, lse, D, T, NH, NKV, score_scale,
                                                        scale);
    LLMTRAIN_CUDA_CHECK(cudaGetLastError());
  }
  {
    constexpr std::size_t smem = 2 * tc_tile_bytes(kTcRows, HS) + 4 * tc_tile_bytes(cols, HS);
    static_assert(smem <= max_shared_bytes, "tensor-core flash backward dQ: tiles too large for shared memory");
    auto* kernel = flash_backward_dq_tc_kernel<HS, cols>;
    allow_shared_memory(kernel, smem);
    kernel<<<dim3(n_tiles(T, kTcRows), NH, B), kTcThreads, smem, stream>>>(dqkv, dout, qkv, lse, D, T, NH, NKV,
                                                                          score_scale, scale);
    LLMTRAIN_CUDA_CHECK(cudaGetLastError());
  }
}

template <class scalar_t, int HS>
void backward_launch(scalar_t* dqkv, const scalar_t* dout, const scalar_t* qkv, const scalar_t* out,
                     const float* lse, int B, int T, int NH, int NKV, cudaStream_t stream) {
  const float scale = 1.0f / sqrtf(float(HS)), score_scale = kLog2e * scale;
  const std::int64_t rows = std::int64_t(B) * T * NH;
  constexpr bool has_tc = std::is_same_v<scalar_t, bf16> && (HS == 64 || HS == 128);
  const bool tensor_cores =
      has_tc && flash_attention_uses_tensor_cores(HS, qkv, out) && aligned16(dout) && aligned16(dqkv);
  const bool single_pass = tensor_cores && !flash_attention_deterministic();
  // D (B,NH,T); for the single pass then the dQ accumulator (B,T,NH HS).
  const std::size_t d_bytes = std::size_t(rows) * sizeof(float);
  const std::size_t dq_bytes = single_pass ? std::size_t(rows) * HS * sizeof(float) : 0;
  const StreamScratch scratch(single_pass ? round_up_256(d_bytes) + dq_bytes : d_bytes, stream);
  float* D = scratch.at<float>();

  constexpr int dot_block = 256;  // 8 warps, one row each
  const unsigned dot_blocks = unsigned((rows * warp_size + dot_block - 1) / dot_block);
  flash_backward_dot_kernel<scalar_t, HS><<<dot_blocks, dot_block, 0, stream>>>(D, dout, out, rows, T, NH);
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());

  if constexpr (has_tc) {
    if (tensor_cores) {
      float* dq_accum = single_pass ? scratch.at<float>(round_up_256(d_bytes)) : nullptr;
      return backward_tc_launch<HS>(dqkv, dq_accum, dout, qkv, lse, D, B, T, NH, NKV, score_scale, scale, stream);
    }
  }
  {
    constexpr int BK = Tiles<HS>::dkv_rows, BQ = Tiles<HS>::dkv_cols;
    constexpr std::size_t smem =
        2 * tile_bytes(BK, HS) + 2 * tile_bytes(BQ, HS) + 2 * tile_bytes(BK, BQ) + 2 * BQ * sizeof(float);
    static_assert(smem <= max_shared_bytes, "flash backward dK/dV: tiles too large for shared memory");
    auto* kernel = flash_backward_dkdv_kernel<scalar_t, HS, BK, BQ>;
    allow_shared_memory(kernel, smem);
    kernel<<<dim3(n_tiles(T, BK), NKV, B), kThreads, smem, stream>>>(dqkv, dout, qkv, lse, D, T, NH, NKV,
                                                                  score_scale, scale);
    LLMTRAIN_CUDA_CHECK(cudaGetLastError());
  }
  {
    constexpr int BQ = Tiles<HS>::dq_rows, BK = Tiles<HS>::dq_cols;
    constexpr std::size_t smem = 2 * tile_bytes(BQ, HS) + 2 * tile_bytes(BK, HS) + tile_bytes(BQ, BK);
    static_assert(smem <= max_shared_bytes, "flash backward dQ: tiles too large for shared memory");
    auto* kernel = flash_backward_dq_kernel<scalar_t, HS, BQ, BK>;
    allow_shared_memory(kernel, smem);
    kernel<<<dim3(n_tiles(T, BQ), NH, B), kThreads, smem, stream>>>(dqkv, dout, qkv, lse, D, T, NH, NKV,
                                                                score_scale, scale);
    LLMTRAIN_CUDA_CHECK(cudaGetLastError());
  }
}

// Shapes the kernels assume; the ops layer checks tensor shapes, this checks what it cannot.
void check_shape(const char* op, int B, int T, int C, int NH, int NKV) {
  if (B < 0 || T < 0 || NH <= 0 || NKV <= 0 || C % NH != 0 || NH % NKV != 0) {
    throw RuntimeError(std::string("cuda::") + op + ": NH must divide C and NKV must divide NH");
  }
  const int HS = C / NH;
  if (HS != 16 && HS != 32 && HS != 64 && HS != 128) {
    throw RuntimeError(std::string("cuda::") + op + ": head size " + std::to_string(HS) +
                       " is not supported (16, 32, 64 or 128)");
  }
  if (NH > 65535 || B > 65535) {
    throw RuntimeError(std::string("cuda::") + op + ": B and NH must be at most 65535 (grid dimensions)");
  }
}

template <class scalar_t>
void forward_dispatch(scalar_t* out, float* lse, const scalar_t* qkv, int B, int T, int C, int NH, int NKV,
                      cudaStream_t stream) {
  check_shape("flash_attention_forward", B, T, C, NH, NKV);
  if (B == 0 || T == 0) return;
  if constexpr (std::is_same_v<scalar_t, bf16>) {
    if (flash_attention_uses_tensor_cores(C / NH, qkv, out)) {
      if (C / NH == 64) return forward_tc_launch<64>(out, lse, qkv, B, T, NH, NKV, stream);
      return forward_tc_launch<128>(out, lse, qkv, B, T, NH, NKV, stream);
    }
  }
  switch (C / NH) {
    case 16: return forward_launch<scalar_t, 16>(out, lse, qkv, B, T, NH, NKV, stream);
    case 32: return forward_launch<scalar_t, 32>(out, lse, qkv, B, T, NH, NKV, stream);
    case 64: return forward_launch<scalar_t, 64>(out, lse, qkv, B, T, NH, NKV, stream);
    default: return forward_launch<scalar_t, 128>(out, lse, qkv, B, T, NH, NKV, stream);
  }
}

template <class scalar_t>
void backward_dispatch(scalar_t* dqkv, const scalar_t* dout, const scalar_t* qkv, const scalar_t* out,
                       const float* lse, int B, int T, int C, int NH, int NKV, bool accumulate,
                       cudaStream_t stream) {
  check_shape("flash_attention_backward", B, T, C, NH, NKV);
  if (B == 0 || T == 0) return;
  // The kernels add into dqkv; as its first writer they add into zeros.
  if (!accumulate) {
    const std::size_t n = std::size_t(B) * std::size_t(T) * std::size_t(NH + 2 * NKV) * std::size_t(C / NH);
    LLMTRAIN_CUDA_CHECK(cudaMemsetAsync(dqkv, 0, n * sizeof(scalar_t), stream));
  }
  switch (C / NH) {
    case 16: return backward_launch<scalar_t, 16>(dqkv, dout, qkv, out, lse, B, T, NH, NKV, stream);
    case 32: return backward_launch<scalar_t, 32>(dqkv, dout, qkv, out, lse, B, T, NH, NKV, stream);
    case 64: return backward_launch<scalar_t, 64>(dqkv, dout, qkv, out, lse, B, T, NH, NKV, stream);
    default: return backward_launch<scalar_t, 128>(dqkv, dout, qkv, out, lse, B, T, NH, NKV, stream);
  }
}

}  // namespace

void set_flash_attention_deterministic(bool deterministic) {
  deterministic_backward.store(deterministic, std::memory_order_relaxed);
}

bool flash_attention_deterministic() { return deterministic_backward.load(std::memory_order_relaxed); }

bool flash_attention_uses_tensor_cores(int head_size, const void* qkv, const void* out) {
  return (head_size == 64 || head_size == 128) && aligned16(qkv) && aligned16(out);
}

void flash_attention_forward(float* out, float* lse, const float* qkv, int B, int T, int C, int NH, int NKV,
                             cudaStream_t stream) {
  forward_dispatch(out, lse, qkv, B, T, C, NH, NKV, stream);
}

void flash_attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out,
                              const float* lse, int B, int T, int C, int NH, int NKV, bool accumulate,
                              cudaStream_t stream) {
  backward_dispatch(dqkv, dout, qkv, out, lse, B, T, C, NH, NKV, accumulate, stream);
}

void flash_attention_forward(bf16* out, float* lse, const bf16* qkv, int B, int T, int C, int NH, int NKV,
                             cudaStream_t stream) {
  forward_dispatch(out, lse, qkv, B, T, C, NH, NKV, stream);
}

void flash_attention_backward(bf16* dqkv, const bf16* dout, const bf16* qkv, const bf16* out,
                              const float* lse, int B, int T, int C, int NH, int NKV, bool accumulate,
                              cudaStream_t stream) {
  backward_dispatch(dqkv, dout, qkv, out, lse, B, T, C, NH, NKV, accumulate, stream);
}

}  // namespace llmtrain::cuda
