// Context parallelism's block attention on tensor cores (bf16, head sizes 64 and 128): the
// queries of a rank against one block of keys and values at their true positions in the sequence
// (llmtrain/kernels/context_attention.h), forward, dQ and dK/dV. The kernels are those of
// flash_attention_tc_forward.cu and flash_attention_tc_backward.cu (mma.sync, ldmatrix, cp.async
// from mma.cuh; fragments and tiles from flash_attention_tiles.cuh) with the causal limit taken
// from positions instead of row indices:
//   - rows come in up to 2 chunks of len contiguous positions (head and tail); a tile of queries
//     or keys lies inside one chunk (tiles per chunk: len / 64 rounded up; rows past the chunk's
//     end are zero and masked), and a key at position kp is seen by a query at position qp when
//     kp <= qp;
//   - a query tile streams, in each key chunk, only the key tiles its last row reaches, and a key
//     tile only the query tiles (of every head of its group) whose last row reaches its first key:
//     fully masked tiles are never loaded;
//   - results are fp32: out (B,Tq,C) and the block's own lse (B,NH,Tq) for the log-sum-exp merge
//     (rows that see no key of the block: out 0, lse -inf); dq (B,Tq,QKV) and dkv (B,Tk,ld) +=,
//     each element added once by the one block that owns its row: deterministic, no atomics.
// Document masks (seg, the whole sequences' nondecreasing segment ids): a key is seen only by the
// queries of its own document; the key tiles before the document of a query tile's first row, and
// the query tiles after the document of a key tile's last key, are skipped as well.
// The backward first computes D = rowsum(dout out) into a stream-ordered scratch, as the flash
// backward does, then dK/dV (grid over key tiles) and dQ (grid over query tiles), which both
// recompute P and dS.
// Compiled for sm_90 and newer only (an older architecture's build holds empty kernels, which
// ptxas would otherwise make spill on sm_80): context_attention.cu calls them on such GPUs alone
// and runs its straightforward kernels elsewhere.
#include <climits>

#include "flash_attention_tiles.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#pragma nv_diag_suppress 177  // the helpers only the sm_90 kernel bodies use: "declared but never referenced"
#endif

namespace llmtrain::cuda::flash {

namespace {

// Position of the first row of chunk i of `at`.
__device__ __forceinline__ int chunk_start(const kernels::Chunks& at, int i) {
  return (i == 0 ? at.first : at.second) * at.len;
}
__device__ __forceinline__ int chunk_count(const kernels::Chunks& at) {
  return at.second >= 0 ? 2 : 1;
}
__device__ __forceinline__ int tiles_of(int len, int rows) {
  return (len + rows - 1) / rows;
}
// The keys of chunk i of `at` that position p sees (a prefix of the chunk).
__device__ __forceinline__ int seen_keys(const kernels::Chunks& at, int i, int p) {
  return max(0, min(at.len, p - chunk_start(at, i) + 1));
}

// The segment id of position p of sequence b; the first and the last position of its document
// (binary searches: the ids are nondecreasing).
__device__ __forceinline__ int seg_at(const BlockShape& s, int b, int p) {
  return s.seg[std::int64_t(b) * s.T + p];
}
__device__ __forceinline__ int doc_first(const BlockShape& s, int b, int p) {
  const std::int32_t* row = s.seg + std::int64_t(b) * s.T;
  const int v = row[p];
  int lo = 0, hi = p;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (row[mid] < v)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}
__device__ __forceinline__ int doc_last(const BlockShape& s, int b, int p) {
  const std::int32_t* row = s.seg + std::int64_t(b) * s.T;
  const int v = row[p];
  int lo = p, hi = s.T - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (row[mid] > v)
      hi = mid - 1;
    else
      lo = mid;
  }
  return lo;
}

// A tile of ROWS query rows inside one chunk of q_at, from a grid index (the tail chunk's tiles,
// which see the most keys, first), and the key tiles of BK its last row reaches in each key chunk.
template <int ROWS, int BK>
struct QueryTile {
  int chunk, t0, p0;  // chunk, first row within it, first row's position
  int local0;         // the first row's local row index (chunk * len + t0)
  int begin[2];       // the first key tile to stream from key chunk 0 and 1
  int steps[2];       // key tiles to stream from key chunk 0 and 1
  __device__ __forceinline__ QueryTile(const BlockShape& s, int index, int b) {
    const int per_chunk = tiles_of(s.q_at.len, ROWS);
    const int u = chunk_count(s.q_at) * per_chunk - 1 - index;
    chunk = u / per_chunk;
    t0 = (u % per_chunk) * ROWS;
    p0 = chunk_start(s.q_at, chunk) + t0;
    local0 = chunk * s.q_at.len + t0;
    const int last = p0 + min(ROWS, s.q_at.len - t0) - 1;
    const int doc = s.seg != nullptr ? doc_first(s, b, p0) : 0;  // no row sees a key before it
    for (int i = 0; i < 2; ++i) {
      const int end = i < chunk_count(s.k_at) ? tiles_of(seen_keys(s.k_at, i, last), BK) : 0;
      begin[i] = min(max(0, doc - chunk_start(s.k_at, i)), s.k_at.len) / BK;
      steps[i] = max(0, end - begin[i]);
    }
  }
  __device__ __forceinline__ int n_steps() const { return steps[0] + steps[1]; }
  __device__ __forceinline__ int key_chunk(int step) const { return step < steps[0] ? 0 : 1; }
  __device__ __forceinline__ int key_row0(int step, int BKr) const {
    return (step < steps[0] ? begin[0] + step : begin[1] + step - steps[0]) * BKr;
  }
};

// The segment id of local row r (position p) of a chunk of len rows; -1 past the chunk or
// without a document mask.
__device__ __forceinline__ int row_segment(const BlockShape& s, int b, int r, int p, int len) {
  return s.seg != nullptr && r < len ? seg_at(s, b, p) : -1;
}
__device__ __forceinline__ int row_segment(const BlockShape& s, int b, int r, int p) {
  return row_segment(s, b, r, p, s.q_at.len);
}
// Whether the key at position kp (row kr of its chunk) is seen by the query at position qp, of
// segment id qseg (-1 for a row past its chunk, which is not stored).
__device__ __forceinline__ bool seen(const BlockShape& s, int b, int kp, int kr, int qp, int qseg) {
  return kp <= qp && kr < s.k_at.len && (s.seg == nullptr || (qseg >= 0 && seg_at(s, b, kp) == qseg));
}

// Loads key tile `step` of qt (K and V of kv head kvh, sequence b) into buffer `buffer`.
template <int HS, int ROWS, int BK>
__device__ __forceinline__ void load_key_tile(bf16* k_s, bf16* v_s, const bf16* kv, const BlockShape& s,
                                              const QueryTile<ROWS, BK>& qt, int b, int kvh, int step,
                                              int buffer) {
  constexpr int S = HS + kTcPad;
  const int kc = qt.key_chunk(step);
  const bf16* rows =
      kv + (std::int64_t(b) * s.Tk + std::int64_t(kc) * s.k_at.len) * s.ld + std::int64_t(kvh) * HS;
  tc_load_tile<BK, HS>(k_s + buffer * BK * S, rows + s.k_col, s.ld, qt.key_row0(step, BK), s.k_at.len);
  tc_load_tile<BK, HS>(v_s + buffer * BK * S, rows + s.v_col, s.ld, qt.key_row0(step, BK), s.k_at.len);
}

// Adds `scale` times a 16 x HS fp32 accumulator (C fragments; this thread's rows row_lo and
// row_lo + 8 of a tile, local to its chunk) into fp32 rows at `base` (row r at base + r * stride),
// rows at or past len skipped.
template <int HS>
__device__ __forceinline__ void add_rows_f32(float* base, std::int64_t stride, const float (&acc)[HS / 8][4],
                                             int row_lo, int len, float scale) {
  const int t = int(threadIdx.x) % 4;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int r = row_lo + 8 * hh;
    if (r >= len) continue;
    float* row = base + std::int64_t(r) * stride;
#pragma unroll
    for (int d = 0; d < HS / 8; ++d) {
      auto* at = reinterpret_cast<float2*>(row + d * 8 + 2 * t);
      const float2 old = *at;
      *at = make_float2(old.x + acc[d][2 * hh] * scale, old.y + acc[d][2 * hh + 1] * scale);
    }
  }
}

// Grid (query tiles of both chunks, NH, B). As flash_forward_tc_kernel, with positions.
template <int HS>
__global__ void __launch_bounds__(kTcThreads)
    block_forward_tc_kernel(float* out, float* lse, const bf16* qkv, const bf16* kv, BlockShape s) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
  constexpr int BR = kTcRows, BC = kTcCols, S = HS + kTcPad, KD = HS / 16, NT = BC / 8, DT = HS / 8;
  extern __shared__ float4 smem[];
  bf16* q_s = reinterpret_cast<bf16*>(smem);  // (BR, S)
  bf16* k_s = q_s + BR * S;                   // 2 x (BC, S)
  bf16* v_s = k_s + 2 * BC * S;               // 2 x (BC, S)

  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, g = lane / 4, t = lane % 4;
  const int h = blockIdx.y, b = blockIdx.z, kvh = h / (s.NH / s.NKV), C = s.NH * HS;
  const QueryTile<BR, BC> qt(s, blockIdx.x, b);
  const int n_steps = qt.n_steps();
  tc_load_tile<BR, HS>(q_s,
                       qkv + (std::int64_t(b) * s.Tq + qt.chunk * s.q_at.len) * s.QKV + std::int64_t(h) * HS,
                       s.QKV, qt.t0, s.q_at.len);
  if (n_steps > 0) load_key_tile<HS>(k_s, v_s, kv, s, qt, b, kvh, 0, 0);
  tc::cp_async_commit();

  const int row_p = qt.p0 + warp * 16 + g;  // positions of this thread's rows: row_p and row_p + 8
  const int seg_lo = row_segment(s, b, qt.t0 + warp * 16 + g, row_p),
            seg_hi = row_segment(s, b, qt.t0 + warp * 16 + g + 8, row_p + 8);
  std::uint32_t qf[KD][4];
  float o[DT][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

  for (int step = 0; step < n_steps; ++step) {
    if (step + 1 < n_steps) load_key_tile<HS>(k_s, v_s, kv, s, qt, b, kvh, step + 1, (step + 1) % 2);
    tc::cp_async_commit();
    tc::cp_async_wait<1>();
    __syncthreads();
    const bf16* kb = k_s + (step % 2) * BC * S;
    const bf16* vb = v_s + (step % 2) * BC * S;
    if (step == 0) {
#pragma unroll
      for (int kk = 0; kk < KD; ++kk) tc_a_fragment<S>(qf[kk], q_s, warp * 16, kk);
    }
    float sc[NT][4] = {};
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) tc_product_transposed<BC, S>(sc, qf[kk], kb, kk);

    const int j0 = qt.key_row0(step, BC), kp0 = chunk_start(s.k_at, qt.key_chunk(step)) + j0;
    const bool masked = kp0 + BC - 1 > qt.p0 + warp * 16 || j0 + BC > s.k_at.len || s.seg != nullptr;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int qp = row_p + 8 * hh;
      float row_max = -INFINITY;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int c = j * 8 + 2 * t + e;
          float& x = sc[j][2 * hh + e];
          x = (!masked || seen(s, b, kp0 + c, j0 + c, qp, hh == 0 ? seg_lo : seg_hi)) ? x * s.score_scale
                                                                                      : -INFINITY;
          row_max = fmaxf(row_max, x);
        }
      }
      const float m_new = fmaxf(m[hh], quad_max(row_max));
      const float base = m_new == -INFINITY ? 0.0f : m_new;  // every key so far masked
      const float correction = exp2f(m[hh] - base);
      float row_sum = 0.0f;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = sc[j][2 * hh + e];
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
    tc_accumulate_product<HS, BC, S>(o, sc, vb);  // O += P V
    __syncthreads();
  }
  tc::cp_async_wait<0>();

#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int r = qt.t0 + warp * 16 + g + 8 * hh;  // row within the chunk
    const float row_l = quad_sum(l[hh]);
    if (r >= s.q_at.len) continue;
    const int local = qt.chunk * s.q_at.len + r;
    const float inv_l = row_l > 0.0f ? 1.0f / row_l : 0.0f;
    float* o_row = out + (std::int64_t(b) * s.Tq + local) * C + std::int64_t(h) * HS;
#pragma unroll
    for (int d = 0; d < DT; ++d) {
      *reinterpret_cast<float2*>(o_row + d * 8 + 2 * t) =
          make_float2(o[d][2 * hh] * inv_l, o[d][2 * hh + 1] * inv_l);
    }
    if (t == 0) {
      lse[(std::int64_t(b) * s.NH + h) * s.Tq + local] =
          row_l > 0.0f ? (m[hh] + log2f(row_l)) * kLn2 : -INFINITY;
    }
  }
#endif
}

// D (B,NH,Tq) = rowsum(dout out): one warp per (b, t, h) row of HS elements.
__global__ void block_dot_kernel(float* D, const bf16* dout, const bf16* out, std::int64_t rows, int Tq,
                                 int NH, int HS) {
  const std::int64_t row = (std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = int(threadIdx.x) % 32;
  if (row >= rows) return;  // whole warps only
  float sum = 0.0f;
  for (int d = lane; d < HS; d += 32)
    sum += __bfloat162float(dout[row * HS + d]) * __bfloat162float(out[row * HS + d]);
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (lane == 0) {
    const std::int64_t bt = row / NH;
    D[(bt / Tq * NH + row % NH) * Tq + bt % Tq] = sum;
  }
}

// Grid (query tiles, NH, B), as the forward: dq += scale dS K over the key tiles the rows reach.
template <int HS, int BK>
__global__ void __launch_bounds__(kTcThreads)
    block_dq_tc_kernel(float* dq, const bf16* dout, const bf16* qkv, const float* lse, const float* D,
                       const bf16* kv, BlockShape s) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
  constexpr int BQ = kTcRows, S = HS + kTcPad, KD = HS / 16, NT = BK / 8, DT = HS / 8;
  extern __shared__ float4 smem[];
  bf16* q_s = reinterpret_cast<bf16*>(smem);  // (BQ, S)
  bf16* do_s = q_s + BQ * S;                  // (BQ, S)
  bf16* k_s = do_s + BQ * S;                  // 2 x (BK, S)
  bf16* v_s = k_s + 2 * BK * S;               // 2 x (BK, S)

  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, g = lane / 4, t = lane % 4;
  const int h = blockIdx.y, b = blockIdx.z, kvh = h / (s.NH / s.NKV), C = s.NH * HS;
  const QueryTile<BQ, BK> qt(s, blockIdx.x, b);
  const int n_steps = qt.n_steps();
  if (n_steps == 0) return;  // no key of the block is seen by these rows (uniform over the block)
  const std::int64_t row0 = std::int64_t(b) * s.Tq + qt.chunk * s.q_at.len;  // the chunk's first row
  tc_load_tile<BQ, HS>(q_s, qkv + row0 * s.QKV + std::int64_t(h) * HS, s.QKV, qt.t0, s.q_at.len);
  tc_load_tile<BQ, HS>(do_s, dout + row0 * C + std::int64_t(h) * HS, C, qt.t0, s.q_at.len);
  load_key_tile<HS>(k_s, v_s, kv, s, qt, b, kvh, 0, 0);
  tc::cp_async_commit();

  const int row_p = qt.p0 + warp * 16 + g;
  const int seg_lo = row_segment(s, b, qt.t0 + warp * 16 + g, row_p),
            seg_hi = row_segment(s, b, qt.t0 + warp * 16 + g + 8, row_p + 8);
  float row_lse[2], row_d[2];  // lse in log2 units and D of this thread's rows
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int r = qt.t0 + warp * 16 + g + 8 * hh;
    const std::int64_t at = (std::int64_t(b) * s.NH + h) * s.Tq + qt.chunk * s.q_at.len + r;
    row_lse[hh] = r < s.q_at.len ? lse[at] * kLog2e : 0.0f;
    row_d[hh] = r < s.q_at.len ? D[at] : 0.0f;
  }

  float acc[DT][4] = {};
  for (int step = 0; step < n_steps; ++step) {
    if (step + 1 < n_steps) load_key_tile<HS>(k_s, v_s, kv, s, qt, b, kvh, step + 1, (step + 1) % 2);
    tc::cp_async_commit();
    tc::cp_async_wait<1>();
    __syncthreads();
    const bf16* kb = k_s + (step % 2) * BK * S;
    const bf16* vb = v_s + (step % 2) * BK * S;
    float sc[NT][4] = {}, dp[NT][4] = {};
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) {
      std::uint32_t qa[4], doa[4];
      tc_a_fragment<S>(qa, q_s, warp * 16, kk);
      tc_a_fragment<S>(doa, do_s, warp * 16, kk);
      tc_product_transposed<BK, S>(sc, qa, kb, kk);   // S = Q K^T
      tc_product_transposed<BK, S>(dp, doa, vb, kk);  // dP = dO V^T
    }
    const int j0 = qt.key_row0(step, BK), kp0 = chunk_start(s.k_at, qt.key_chunk(step)) + j0;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int hh = e / 2, c = j * 8 + 2 * t + e % 2;
        const bool visible = seen(s, b, kp0 + c, j0 + c, row_p + 8 * hh, hh == 0 ? seg_lo : seg_hi);
        const float p = visible ? exp2f(sc[j][e] * s.score_scale - row_lse[hh]) : 0.0f;
        dp[j][e] = visible ? p * (dp[j][e] - row_d[hh]) : 0.0f;
      }
    }
    tc_accumulate_product<HS, BK, S>(acc, dp, kb);  // dQ += dS K
    __syncthreads();
  }
  add_rows_f32<HS>(dq + row0 * s.QKV + std::int64_t(h) * HS, s.QKV, acc, qt.t0 + warp * 16 + g, s.q_at.len,
                   s.scale);
#endif
}

// Grid (key tiles of both chunks, NKV, B): dK, dV of 64 keys over the query tiles, of every head
// of the group, whose last row reaches the tile's first key.
template <int HS, int BQ>
__global__ void __launch_bounds__(kTcThreads)
    block_dkdv_tc_kernel(float* dkv, const bf16* dout, const bf16* qkv, const float* lse, const float* D,
                         const bf16* kv, BlockShape s) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
  constexpr int BK = kTcRows, S = HS + kTcPad, KD = HS / 16, NT = BQ / 8, DT = HS / 8;
  extern __shared__ float4 smem[];
  bf16* k_s = reinterpret_cast<bf16*>(smem);                   // (BK, S)
  bf16* v_s = k_s + BK * S;                                    // (BK, S)
  bf16* q_s = v_s + BK * S;                                    // 2 x (BQ, S)
  bf16* do_s = q_s + 2 * BQ * S;                               // 2 x (BQ, S)
  float* lse_s = reinterpret_cast<float*>(do_s + 2 * BQ * S);  // 2 x BQ, log2 units
  float* d_s = lse_s + 2 * BQ;                                 // 2 x BQ

  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, g = lane / 4, t = lane % 4;
  const int kvh = blockIdx.y, b = blockIdx.z, group = s.NH / s.NKV, C = s.NH * HS;
  const int per_chunk = tiles_of(s.k_at.len, BK);
  const int kc = int(blockIdx.x) / per_chunk, j0 = int(blockIdx.x) % per_chunk * BK;
  const int kp0 = chunk_start(s.k_at, kc) + j0;
  // Query tiles of each chunk from the first whose rows reach key position kp0.
  const int q_tiles = tiles_of(s.q_at.len, BQ);
  // With a document mask, only up to the last row of the document of the tile's last key.
  const int doc_end = s.seg != nullptr ? doc_last(s, b, kp0 + min(BK, s.k_at.len - j0) - 1) : INT_MAX;
  const auto tiles_from = [&](int ci, int& first) {
    if (ci >= chunk_count(s.q_at)) return (first = 0);
    const int start = chunk_start(s.q_at, ci), tt = max(0, kp0 - start);
    const int last = doc_end == INT_MAX ? s.q_at.len - 1 : min(s.q_at.len - 1, doc_end - start);
    first = tt / BQ;
    return tt < s.q_at.len && last >= tt ? last / BQ + 1 - first : 0;
  };
  int first0, first1;
  const int count0 = tiles_from(0, first0), per_head = count0 + tiles_from(1, first1),
            n_iter = group * per_head;
  if (n_iter == 0) return;
  // Iteration i: query head kvh group + i / per_head; its query tile i % per_head, chunk 0's first.
  const auto tile_of = [&](int i, int& h, int& ci, int& q0) {
    const int r = i % per_head;
    h = kvh * group + i / per_head;
    ci = r < count0 ? 0 : 1;
    q0 = (ci == 0 ? first0 + r : first1 + r - count0) * BQ;
  };
  const auto load = [&](int i, int buffer) {
    int h, ci, q0;
    tile_of(i, h, ci, q0);
    const std::int64_t row0 = std::int64_t(b) * s.Tq + std::int64_t(ci) * s.q_at.len;
    tc_load_tile<BQ, HS>(q_s + buffer * BQ * S, qkv + row0 * s.QKV + std::int64_t(h) * HS, s.QKV, q0,
                         s.q_at.len);
    tc_load_tile<BQ, HS>(do_s + buffer * BQ * S, dout + row0 * C + std::int64_t(h) * HS, C, q0, s.q_at.len);
    const std::int64_t at = (std::int64_t(b) * s.NH + h) * s.Tq + std::int64_t(ci) * s.q_at.len;
    tc_load_row_values<BQ>(lse_s + buffer * BQ, d_s + buffer * BQ, lse + at, D + at, q0, s.q_at.len);
  };
  const bf16* keys =
      kv + (std::int64_t(b) * s.Tk + std::int64_t(kc) * s.k_at.len) * s.ld + std::int64_t(kvh) * HS;
  tc_load_tile<BK, HS>(k_s, keys + s.k_col, s.ld, j0, s.k_at.len);
  tc_load_tile<BK, HS>(v_s, keys + s.v_col, s.ld, j0, s.k_at.len);
  load(0, 0);
  tc::cp_async_commit();

  const int key_r = j0 + warp * 16 + g;  // this thread's keys within the chunk: key_r and key_r + 8
  const int kseg[2] = {row_segment(s, b, key_r, kp0 - j0 + key_r, s.k_at.len),
                       row_segment(s, b, key_r + 8, kp0 - j0 + key_r + 8, s.k_at.len)};
  float dk[DT][4] = {}, dv[DT][4] = {};
  for (int i = 0; i < n_iter; ++i) {
    if (i + 1 < n_iter) load(i + 1, (i + 1) % 2);
    tc::cp_async_commit();
    tc::cp_async_wait<1>();
    __syncthreads();
    int h, ci, q0;
    tile_of(i, h, ci, q0);
    const int qp0 = chunk_start(s.q_at, ci) + q0;
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
      tc_product_transposed<BQ, S>(st, ka, qb, kk);    // S^T = K Q^T
      tc_product_transposed<BQ, S>(dpt, va, dob, kk);  // dP^T = V dO^T
    }
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int kr = key_r + 8 * (e / 2), c = j * 8 + 2 * t + e % 2;
        const bool visible = kr < s.k_at.len && q0 + c < s.q_at.len && kp0 - j0 + kr <= qp0 + c &&
                             (s.seg == nullptr || seg_at(s, b, qp0 + c) == kseg[e / 2]);
        const float p = visible ? exp2f(st[j][e] * s.score_scale - lse_b[c]) : 0.0f;
        dpt[j][e] = visible ? p * (dpt[j][e] - d_b[c]) : 0.0f;
        st[j][e] = p;
      }
    }
    tc_accumulate_product<HS, BQ, S>(dv, st, dob);  // dV += P^T dO
    tc_accumulate_product<HS, BQ, S>(dk, dpt, qb);  // dK += dS^T Q
    __syncthreads();
  }
  float* grads =
      dkv + (std::int64_t(b) * s.Tk + std::int64_t(kc) * s.k_at.len) * s.ld + std::int64_t(kvh) * HS;
  add_rows_f32<HS>(grads + s.k_col, s.ld, dk, key_r, s.k_at.len, s.scale);
  add_rows_f32<HS>(grads + s.v_col, s.ld, dv, key_r, s.k_at.len, 1.0f);
#endif
}

}  // namespace

template <int HS>
void block_forward_tc_launch(float* out, float* lse, const bf16* qkv, const bf16* kv, int B,
                             const BlockShape& s, cudaStream_t stream) {
  constexpr std::size_t smem = tc_tile_bytes(kTcRows, HS) + 4 * tc_tile_bytes(kTcCols, HS);
  static_assert(smem <= max_shared_bytes, "context attention forward: tiles too large for shared memory");
  auto* kernel = block_forward_tc_kernel<HS>;
  allow_shared_memory(kernel, smem);
  const int tiles = s.q_at.count() * n_tiles(s.q_at.len, kTcRows);
  kernel<<<dim3(tiles, s.NH, B), kTcThreads, smem, stream>>>(out, lse, qkv, kv, s);
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
}

template <int HS>
void block_backward_tc_launch(float* dq, float* dkv, const bf16* dout, const bf16* qkv, const bf16* out,
                              const float* lse, const bf16* kv, int B, const BlockShape& s,
                              cudaStream_t stream) {
  constexpr int cols = HS == 128 ? 32 : 64;  // streamed rows per step, as the flash backward's
  const std::int64_t rows = std::int64_t(B) * s.Tq * s.NH;
  const StreamScratch scratch(std::size_t(rows) * sizeof(float), stream);
  float* D = scratch.at<float>();
  constexpr int dot_block = 256;
  block_dot_kernel<<<unsigned((rows * 32 + dot_block - 1) / dot_block), dot_block, 0, stream>>>(
      D, dout, out, rows, s.Tq, s.NH, HS);
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
  {
    constexpr std::size_t smem =
        2 * tc_tile_bytes(kTcRows, HS) + 4 * tc_tile_bytes(cols, HS) + 4 * cols * sizeof(float);
    static_assert(smem <= max_shared_bytes, "context attention dK/dV: tiles too large for shared memory");
    auto* kernel = block_dkdv_tc_kernel<HS, cols>;
    allow_shared_memory(kernel, smem);
    const int tiles = s.k_at.count() * n_tiles(s.k_at.len, kTcRows);
    kernel<<<dim3(tiles, s.NKV, B), kTcThreads, smem, stream>>>(dkv, dout, qkv, lse, D, kv, s);
    LLMTRAIN_CUDA_CHECK(cudaGetLastError());
  }
  {
    constexpr std::size_t smem = 2 * tc_tile_bytes(kTcRows, HS) + 4 * tc_tile_bytes(cols, HS);
    static_assert(smem <= max_shared_bytes, "context attention dQ: tiles too large for shared memory");
    auto* kernel = block_dq_tc_kernel<HS, cols>;
    allow_shared_memory(kernel, smem);
    const int tiles = s.q_at.count() * n_tiles(s.q_at.len, kTcRows);
    kernel<<<dim3(tiles, s.NH, B), kTcThreads, smem, stream>>>(dq, dout, qkv, lse, D, kv, s);
    LLMTRAIN_CUDA_CHECK(cudaGetLastError());
  }
}

template void block_forward_tc_launch<64>(float*, float*, const bf16*, const bf16*, int, const BlockShape&,
                                          cudaStream_t);
template void block_forward_tc_launch<128>(float*, float*, const bf16*, const bf16*, int, const BlockShape&,
                                           cudaStream_t);
template void block_backward_tc_launch<64>(float*, float*, const bf16*, const bf16*, const bf16*,
                                           const float*, const bf16*, int, const BlockShape&, cudaStream_t);
template void block_backward_tc_launch<128>(float*, float*, const bf16*, const bf16*, const bf16*,
                                            const float*, const bf16*, int, const BlockShape&, cudaStream_t);

}  // namespace llmtrain::cuda::flash
