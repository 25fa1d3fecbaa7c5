// The tensor-core flash attention backward (bf16, head sizes 64 and 128), after D
// (flash_attention.cu). The design is described below and at the top of flash_attention.cu.
#include "flash_attention_tiles.cuh"

namespace llmtrain::cuda::flash {

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

template void backward_tc_launch<64>(bf16*, float*, const bf16*, const bf16*, const float*, const float*, int, int,
                                       int, int, float, float, cudaStream_t);
template void backward_tc_launch<128>(bf16*, float*, const bf16*, const bf16*, const float*, const float*, int, int,
                                       int, int, float, float, cudaStream_t);

}  // namespace llmtrain::cuda::flash
