// The CPU GEMM. On x86-64 CPUs with AVX-512 a packed kernel (the BLIS scheme): B is copied, KC
// rows at a time, into panels of NR = 32 columns and A into panels of MR = 12 rows, each laid out
// k-major so that the micro-kernel reads both operands contiguously; the micro-kernel holds a
// 12 x 32 tile of C in 24 zmm registers and adds one rank-1 product per k (2 loads, 12
// broadcasts, 24 FMAs). A tile's threads never share a C element, and each element sums its K in
// the same blocks in the same order whatever the shape around it or the thread count.
//
// Why not OpenBLAS everywhere: its runtime dispatch picks its kernels from the CPU's model number,
// and a CPU it does not know gets its generic SSE3 ("Prescott") kernels; and at the linear
// layers' small shapes (K = 128) its threading costs more than it gains. Measured on a 2-core
// AVX-512 x86-64 VM that OpenBLAS 0.3.21 takes for Prescott, one thread: (768 x 128) x (128 x 384)
// 68 GFLOP/s here against OpenBLAS's 14; (2048 x 1024) x (1024 x 256) 126 against 29.
#include "gemm.h"

#if LLMTRAIN_HAVE_OPENBLAS
#include <cblas.h>
#endif
#include <omp.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define LLMTRAIN_GEMM_AVX512 1
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "llmtrain/kernels/vec_math.h"

namespace llmtrain::cpu {
namespace {

#if !LLMTRAIN_HAVE_OPENBLAS
// C (M,N) = alpha op(A) op(B) + beta C by plain loops: the fallback without OpenBLAS or AVX-512.
void gemm_loops(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, std::int64_t lda,
                const float* B, std::int64_t ldb, float beta, float* C, std::int64_t ldc) {
  for (int m = 0; m < M; ++m) {
    float* c = C + m * ldc;
    for (int n = 0; n < N; ++n) c[n] = beta == 0.0f ? 0.0f : beta * c[n];
    for (int k = 0; k < K; ++k) {
      const float a = alpha * (trans_a ? A[k * lda + m] : A[m * lda + k]);
      if (trans_b) {
        for (int n = 0; n < N; ++n) c[n] += a * B[n * ldb + k];
      } else {
        const float* b = B + k * ldb;
#pragma omp simd
        for (int n = 0; n < N; ++n) c[n] += a * b[n];
      }
    }
  }
}
#endif

#if LLMTRAIN_GEMM_AVX512

constexpr int MR = 12;     // rows of a C tile (and of an A panel)
constexpr int NR = 32;     // columns of a C tile: two zmm registers
constexpr int KC = 256;    // k per block: an A panel (12 KiB) and a B panel (32 KiB) stay in L1/L2
constexpr int NC = 2048;   // columns of B packed at a time (2 MiB at KC = 256)

bool have_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f");
  return yes;
}

// C (m <= MR, n <= NR; rows ldc apart) = alpha Ap Bp + beta C, Ap (kc, MR) and Bp (kc, NR) packed.
__attribute__((target("avx512f"))) void micro_kernel(int kc, const float* Ap, const float* Bp, float* C,
                                                      std::int64_t ldc, int m, int n, float alpha, float beta) {
  __m512 c[MR][2];
  for (int i = 0; i < MR; ++i) c[i][0] = c[i][1] = _mm512_setzero_ps();
  for (int k = 0; k < kc; ++k) {
    const __m512 b0 = _mm512_load_ps(Bp + k * NR), b1 = _mm512_load_ps(Bp + k * NR + 16);
    const float* a = Ap + k * MR;
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) {
      const __m512 ai = _mm512_set1_ps(a[i]);
      c[i][0] = _mm512_fmadd_ps(ai, b0, c[i][0]);
      c[i][1] = _mm512_fmadd_ps(ai, b1, c[i][1]);
    }
  }
  const __mmask16 mask0 = n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
  const __mmask16 mask1 = n >= 32 ? __mmask16(0xFFFF) : n <= 16 ? __mmask16(0) : __mmask16((1u << (n - 16)) - 1);
  const __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
  for (int i = 0; i < m; ++i) {
    float* row = C + i * ldc;
    __m512 r0 = _mm512_mul_ps(va, c[i][0]), r1 = _mm512_mul_ps(va, c[i][1]);
    if (beta != 0.0f) {
      r0 = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(mask0, row), r0);
      r1 = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(mask1, row + 16), r1);
    }
    _mm512_mask_storeu_ps(row, mask0, r0);
    _mm512_mask_storeu_ps(row + 16, mask1, r1);
  }
}

// Bp: columns [j0, j0 + nc) of op(B)'s rows [k0, k0 + kc), as panels of NR columns, each (kc, NR)
// k-major, zero past column nc.
void pack_b(bool trans_b, const float* B, std::int64_t ldb, int k0, int kc, int j0, int nc, float* Bp, int panel) {
  float* dst = Bp + std::size_t(panel) * NR * kc;
  const int jp = j0 + panel * NR, nj = std::min(NR, j0 + nc - jp);
  if (!trans_b) {  // B (K, N): a row piece per k
    for (int k = 0; k < kc; ++k) {
      const float* s = B + std::int64_t(k0 + k) * ldb + jp;
      float* d = dst + k * NR;
      for (int j = 0; j < nj; ++j) d[j] = s[j];
      for (int j = nj; j < NR; ++j) d[j] = 0.0f;
    }
  } else {  // B (N, K): B's row j read along k, written down the panel's column j
    for (int j = 0; j < nj; ++j) {
      const float* s = B + std::int64_t(jp + j) * ldb + k0;
      for (int k = 0; k < kc; ++k) dst[k * NR + j] = s[k];
    }
    for (int k = 0; k < kc; ++k) {
      for (int j = nj; j < NR; ++j) dst[k * NR + j] = 0.0f;
    }
  }
}

// Ap: rows [i0, i0 + mi) of op(A)'s columns [k0, k0 + kc), (kc, MR) k-major, zero past row mi.
void pack_a(bool trans_a, const float* A, std::int64_t lda, int k0, int kc, int i0, int mi, float* Ap) {
  if (trans_a) {  // A (K, M): a row piece per k
    for (int k = 0; k < kc; ++k) {
      const float* s = A + std::int64_t(k0 + k) * lda + i0;
      float* d = Ap + k * MR;
      for (int i = 0; i < mi; ++i) d[i] = s[i];
      for (int i = mi; i < MR; ++i) d[i] = 0.0f;
    }
  } else {  // A (M, K): A's row i read along k
    for (int i = 0; i < mi; ++i) {
      const float* s = A + std::int64_t(i0 + i) * lda + k0;
      for (int k = 0; k < kc; ++k) Ap[k * MR + i] = s[k];
    }
    for (int k = 0; k < kc; ++k) {
      for (int i = mi; i < MR; ++i) Ap[k * MR + i] = 0.0f;
    }
  }
}

void gemm_packed_avx512(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A,
                        std::int64_t lda, const float* B, std::int64_t ldb, float beta, float* C, std::int64_t ldc) {
  // The packed B of one (KC, NC) block, shared by the team; the calling thread's, grown once.
  thread_local std::unique_ptr<float[]> b_store;
  thread_local std::size_t b_floats = 0;
  const int nc_max = std::min(N, NC);
  const std::size_t need = std::size_t((nc_max + NR - 1) / NR) * NR * KC + 16;
  if (b_floats < need) {
    b_store.reset(new float[need]);
    b_floats = need;
  }
  float* Bp = reinterpret_cast<float*>((reinterpret_cast<std::uintptr_t>(b_store.get()) + 63) & ~std::uintptr_t(63));
  const int m_panels = (M + MR - 1) / MR;
  const bool threads = worth_threads(std::int64_t(M) * N * K) && !omp_in_parallel();
#pragma omp parallel if (threads)
  {
    alignas(64) float Ap[MR * KC];
    for (int k0 = 0; k0 < K; k0 += KC) {
      const int kc = std::min(KC, K - k0);
      const float block_beta = k0 == 0 ? beta : 1.0f;  // later blocks add to what the first wrote
      for (int j0 = 0; j0 < N; j0 += NC) {
        const int nc = std::min(NC, N - j0), n_panels = (nc + NR - 1) / NR;
#pragma omp for schedule(static)
        for (int p = 0; p < n_panels; ++p) pack_b(trans_b, B, ldb, k0, kc, j0, nc, Bp, p);
        // A task packs one A panel and runs it against a strip of B panels: the whole width where
        // there are rows enough to share out (A packed once per panel: its gather costs about a
        // fifth of a 12 x 128 strip's FMAs), narrower strips for short products (a decoding step).
        const int teams = omp_get_num_threads();
        const int strips = std::min(n_panels, std::max(1, (4 * teams + m_panels - 1) / m_panels));
        const int tile_panels = (n_panels + strips - 1) / strips;
#pragma omp for collapse(2) schedule(static)
        for (int q = 0; q < m_panels; ++q) {
          for (int s = 0; s < strips; ++s) {
            const int i0 = q * MR, mi = std::min(MR, M - i0);
            pack_a(trans_a, A, lda, k0, kc, i0, mi, Ap);
            for (int p = s * tile_panels; p < std::min(n_panels, (s + 1) * tile_panels); ++p) {
              const int jp = j0 + p * NR;
              micro_kernel(kc, Ap, Bp + std::size_t(p) * NR * kc, C + std::int64_t(i0) * ldc + jp, ldc, mi,
                           std::min(NR, N - jp), alpha, block_beta);
            }
          }
        }
      }
    }
  }
}

#endif  // LLMTRAIN_GEMM_AVX512

}  // namespace

bool gemm_packed() {
#if LLMTRAIN_GEMM_AVX512
  return have_avx512();
#else
  return false;
#endif
}

void gemm(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, std::int64_t lda,
          const float* B, std::int64_t ldb, float beta, float* C, std::int64_t ldc) {
  if (M <= 0 || N <= 0) return;
#if LLMTRAIN_GEMM_AVX512
  if (K > 0 && have_avx512()) {
    gemm_packed_avx512(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    return;
  }
#endif
#if LLMTRAIN_HAVE_OPENBLAS
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, M, N, K, alpha,
              A, int(lda), B, int(ldb), beta, C, int(ldc));
#else
  gemm_loops(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
#endif
}

}  // namespace llmtrain::cpu
