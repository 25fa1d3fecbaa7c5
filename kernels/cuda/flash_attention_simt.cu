// The CUDA-core flash attention kernels (fp32 arithmetic, element type a template parameter):
// the forward, and the backward's dK/dV and dQ kernels after D (flash_attention.cu). The design is
// described at the top of flash_attention.cu.
#include "flash_attention_tiles.cuh"

namespace llmtrain::cuda::flash {

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

// ---- launchers -----------------------------------------------------------------------------------

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
void backward_simt_launch(scalar_t* dqkv, const scalar_t* dout, const scalar_t* qkv, const float* lse,
                          const float* D, int B, int T, int NH, int NKV, float score_scale, float scale,
                          cudaStream_t stream) {
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

// The instantiations flash_attention.cu dispatches to: both element types, every head size.
#define LLMTRAIN_FLASH_SIMT_LAUNCHERS(scalar_t, HS)                                                          \
  template void forward_launch<scalar_t, HS>(scalar_t*, float*, const scalar_t*, int, int, int, int,         \
                                             cudaStream_t);                                                   \
  template void backward_simt_launch<scalar_t, HS>(scalar_t*, const scalar_t*, const scalar_t*, const float*, \
                                                   const float*, int, int, int, int, float, float, cudaStream_t);
LLMTRAIN_FLASH_SIMT_LAUNCHERS(float, 16)
LLMTRAIN_FLASH_SIMT_LAUNCHERS(float, 32)
LLMTRAIN_FLASH_SIMT_LAUNCHERS(float, 64)
LLMTRAIN_FLASH_SIMT_LAUNCHERS(float, 128)
LLMTRAIN_FLASH_SIMT_LAUNCHERS(bf16, 16)
LLMTRAIN_FLASH_SIMT_LAUNCHERS(bf16, 32)
LLMTRAIN_FLASH_SIMT_LAUNCHERS(bf16, 64)
LLMTRAIN_FLASH_SIMT_LAUNCHERS(bf16, 128)
#undef LLMTRAIN_FLASH_SIMT_LAUNCHERS

}  // namespace llmtrain::cuda::flash
