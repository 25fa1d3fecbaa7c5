// The tensor-core flash attention forward (bf16, head sizes 64 and 128). The design is described
// at the top of flash_attention.cu, the fragments in flash_attention_tiles.cuh.
#include "flash_attention_tiles.cuh"

namespace llmtrain::cuda::flash {

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

template void forward_tc_launch<64>(bf16*, float*, const bf16*, int, int, int, int, cudaStream_t);
template void forward_tc_launch<128>(bf16*, float*, const bf16*, int, int, int, int, cudaStream_t);

}  // namespace llmtrain::cuda::flash
