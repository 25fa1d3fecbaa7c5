// What the flash attention kernels share (flash_attention*.cu; the design is described at the top
// of flash_attention.cu): the CUDA-core kernels' tile sizes, shared-memory loads, products and
// half-warp reductions; the tensor-core kernels' fragments and query-block walk; the launch
// helpers; and the launchers, each family defined and instantiated in its own file.
#pragma once

#include <cstdint>

#include "llmtrain/kernels/cuda.h"
#include "cuda_check.h"
#include "launch.cuh"
#include "mma.cuh"
#include "vector_io.cuh"

namespace llmtrain::cuda::flash {

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

// ---- tensor cores (bf16, head sizes 64 and 128) ----------------------------------------------
//
// FlashAttention-2 on mma.sync m16n8k16 (bf16 inputs, fp32 accumulation; kernels/cuda/mma.cuh).
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

// ---- launch helpers ------------------------------------------------------------------------------

constexpr std::size_t tile_bytes(int rows, int width) { return std::size_t(rows) * (width + kPad) * sizeof(float); }

// Dynamic shared memory above 48 KB needs an opt-in per kernel.
constexpr std::size_t max_shared_bytes = 99 * 1024;  // the per-block limit of sm_86/89; 2 blocks per sm_80 SM
template <class Kernel>
void allow_shared_memory(Kernel* kernel, std::size_t bytes) {
  LLMTRAIN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
}

inline int n_tiles(int T, int rows) { return (T + rows - 1) / rows; }

constexpr std::size_t tc_tile_bytes(int rows, int hs) { return std::size_t(rows) * (hs + kTcPad) * sizeof(bf16); }

inline bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

// ---- the launchers, one family per file (each instantiated there for the types and head sizes
// the dispatch in flash_attention.cu uses) ----------------------------------------------------------

// flash_attention_simt.cu: the CUDA-core forward, and the dK/dV and dQ kernels after D.
template <class scalar_t, int HS>
void forward_launch(scalar_t* out, float* lse, const scalar_t* qkv, int B, int T, int NH, int NKV,
                    cudaStream_t stream);
template <class scalar_t, int HS>
void backward_simt_launch(scalar_t* dqkv, const scalar_t* dout, const scalar_t* qkv, const float* lse,
                          const float* D, int B, int T, int NH, int NKV, float score_scale, float scale,
                          cudaStream_t stream);
// flash_attention_tc_forward.cu (HS 64 and 128).
template <int HS>
void forward_tc_launch(bf16* out, float* lse, const bf16* qkv, int B, int T, int NH, int NKV, cudaStream_t stream);
// flash_attention_tc_backward.cu (HS 64 and 128); dq_accum null: the deterministic two kernels.
template <int HS>
void backward_tc_launch(bf16* dqkv, float* dq_accum, const bf16* dout, const bf16* qkv, const float* lse,
                        const float* D, int B, int T, int NH, int NKV, float score_scale, float scale,
                        cudaStream_t stream);

// context_attention_tc.cu (HS 64 and 128): context parallelism's block attention, queries against
// one block of keys at their true positions (kernels/cuda/context_attention.cu dispatches).
struct BlockShape {
  int Tq, Tk, NH, NKV;
  std::int64_t QKV, ld, k_col, v_col;  // qkv's and kv's row widths; kv's key and value columns
  kernels::Chunks q_at, k_at;
  float score_scale, scale;   // log2 e / sqrt(HS) and 1 / sqrt(HS)
  const std::int32_t* seg;    // (B,T) the whole sequences' segment ids: a document mask; null: none
  int T;                      // the whole sequence's length (seg's row width)
};
template <int HS>
void block_forward_tc_launch(float* out, float* lse, const bf16* qkv, const bf16* kv, int B, const BlockShape& s,
                             cudaStream_t stream);
template <int HS>
void block_backward_tc_launch(float* dq, float* dkv, const bf16* dout, const bf16* qkv, const bf16* out,
                              const float* lse, const bf16* kv, int B, const BlockShape& s, cudaStream_t stream);

}  // namespace llmtrain::cuda::flash
