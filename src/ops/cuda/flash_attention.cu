// Causal flash attention in the style of FlashAttention-2, fp32 on CUDA cores, element type a
// template parameter (loads and stores convert to fp32; all arithmetic is fp32). CPU reference:
// src/ops/cpu/flash_attention.cpp. Instantiated for float and for bf16 (mixed precision: bf16
// qkv, out, dout, dqkv; fp32 lse, D and shared-memory tiles, so the same kernels, tiles and
// shared memory; each bf16 output element is rounded once, dqkv after its fp32 += ).
//
// Forward: a block owns BR query rows of one (b, h) and streams the key/value tiles 0..causal
// limit through shared memory, keeping a running max and sum per row (online softmax, in log2
// units so that exp2f does the work); it writes out and lse = max + log(sum) (natural log).
// Backward, three kernels, no atomics, deterministic:
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

#include <cstdint>
#include <string>

#include "core/error.h"
#include "cuda_check.h"
#include "launch.cuh"

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

// ---- launchers -------------------------------------------------------------------------------

constexpr std::size_t tile_bytes(int rows, int width) { return std::size_t(rows) * (width + kPad) * sizeof(float); }

// Dynamic shared memory above 48 KB needs an opt-in per kernel.
constexpr std::size_t max_shared_bytes = 99 * 1024;  // the per-block limit of sm_86/89; 2 blocks per sm_80 SM
template <class Kernel>
void allow_shared_memory(Kernel* kernel, std::size_t bytes) {
  LLMTRAIN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
}

int n_tiles(int T, int rows) { return (T + rows - 1) / rows; }

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

template <class scalar_t, int HS>
void backward_launch(scalar_t* dqkv, const scalar_t* dout, const scalar_t* qkv, const scalar_t* out,
                     const float* lse, int B, int T, int NH, int NKV, cudaStream_t stream) {
  const float scale = 1.0f / sqrtf(float(HS)), score_scale = kLog2e * scale;
  const std::int64_t rows = std::int64_t(B) * T * NH;
  const StreamScratch scratch(std::size_t(rows) * sizeof(float), stream);
  float* D = scratch.at<float>();  // (B,NH,T)

  constexpr int dot_block = 256;  // 8 warps, one row each
  const unsigned dot_blocks = unsigned((rows * warp_size + dot_block - 1) / dot_block);
  flash_backward_dot_kernel<scalar_t, HS><<<dot_blocks, dot_block, 0, stream>>>(D, dout, out, rows, T, NH);
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());

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
  switch (C / NH) {
    case 16: return forward_launch<scalar_t, 16>(out, lse, qkv, B, T, NH, NKV, stream);
    case 32: return forward_launch<scalar_t, 32>(out, lse, qkv, B, T, NH, NKV, stream);
    case 64: return forward_launch<scalar_t, 64>(out, lse, qkv, B, T, NH, NKV, stream);
    default: return forward_launch<scalar_t, 128>(out, lse, qkv, B, T, NH, NKV, stream);
  }
}

template <class scalar_t>
void backward_dispatch(scalar_t* dqkv, const scalar_t* dout, const scalar_t* qkv, const scalar_t* out,
                       const float* lse, int B, int T, int C, int NH, int NKV, cudaStream_t stream) {
  check_shape("flash_attention_backward", B, T, C, NH, NKV);
  if (B == 0 || T == 0) return;
  switch (C / NH) {
    case 16: return backward_launch<scalar_t, 16>(dqkv, dout, qkv, out, lse, B, T, NH, NKV, stream);
    case 32: return backward_launch<scalar_t, 32>(dqkv, dout, qkv, out, lse, B, T, NH, NKV, stream);
    case 64: return backward_launch<scalar_t, 64>(dqkv, dout, qkv, out, lse, B, T, NH, NKV, stream);
    default: return backward_launch<scalar_t, 128>(dqkv, dout, qkv, out, lse, B, T, NH, NKV, stream);
  }
}

}  // namespace

void flash_attention_forward(float* out, float* lse, const float* qkv, int B, int T, int C, int NH, int NKV,
                             cudaStream_t stream) {
  forward_dispatch(out, lse, qkv, B, T, C, NH, NKV, stream);
}

void flash_attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out,
                              const float* lse, int B, int T, int C, int NH, int NKV, cudaStream_t stream) {
  backward_dispatch(dqkv, dout, qkv, out, lse, B, T, C, NH, NKV, stream);
}

void flash_attention_forward(bf16* out, float* lse, const bf16* qkv, int B, int T, int C, int NH, int NKV,
                             cudaStream_t stream) {
  forward_dispatch(out, lse, qkv, B, T, C, NH, NKV, stream);
}

void flash_attention_backward(bf16* dqkv, const bf16* dout, const bf16* qkv, const bf16* out,
                              const float* lse, int B, int T, int C, int NH, int NKV, cudaStream_t stream) {
  backward_dispatch(dqkv, dout, qkv, out, lse, B, T, C, NH, NKV, stream);
}

}  // namespace llmtrain::cuda
