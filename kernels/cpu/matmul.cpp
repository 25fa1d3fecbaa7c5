// Matmuls through the CPU GEMM (gemm.h: its own packed kernel on AVX-512 CPUs, else OpenBLAS's
// sgemm; row-major). Weights are (OC, C), as torch.nn.Linear's.
// A build without OpenBLAS (LLMTRAIN_HAVE_OPENBLAS unset: a GPU node with only the CUDA toolkit)
// on a CPU without AVX-512 uses plain OpenMP loops instead: the same results to rounding, blocked
// so that a tile of one operand stays in cache while the other streams past, four outputs per pass
// over a row, and each output written by one thread in a fixed order (the same bits at any thread
// count). GPT-2 124M's MLP matmul (N=1024, C=768, OC=3072), one x86-64 core: forward 15.5 GFLOP/s,
// backward 11.6; OpenBLAS 39 and 42. Fine for tests and small runs; CPU training wants either.
#include <algorithm>
#include <cstring>
#include <vector>

#include "gemm.h"
#include "llmtrain/kernels/cpu.h"
#include "llmtrain/kernels/vec_math.h"

namespace llmtrain::cpu {

namespace {

// dbias (OC) += column sums of dout (N,OC; rows ld apart): each task owns a slice of outputs and
// adds whole row pieces in row order (vectorised, deterministic).
void bias_backward(float* dbias, const float* dout, std::int64_t N, int OC, std::int64_t ld) {
  constexpr int slice = 64;
  const int slices = (OC + slice - 1) / slice;
#pragma omp parallel for if (worth_threads(N * OC))
  for (int k = 0; k < slices; ++k) {
    const int o0 = k * slice, o1 = std::min(OC, o0 + slice);
    float sum[slice] = {};
    for (std::int64_t i = 0; i < N; ++i) {
      const float* row = dout + i * ld;
#pragma omp simd
      for (int o = o0; o < o1; ++o) sum[o - o0] += row[o];
    }
    for (int o = o0; o < o1; ++o) dbias[o] += sum[o - o0];
  }
}

}  // namespace

#if !LLMTRAIN_HAVE_OPENBLAS  // blocked OpenMP loops, for CPUs without AVX-512

namespace {

constexpr std::int64_t outer_block = 16;  // rows (or outputs) per parallel task
constexpr std::int64_t inner_block = 64;  // rows of the operand kept in cache across a task's rows

// dst (C) += a[k] * src[k] (C) for k < K (K <= 4): one pass over dst for up to four source rows.
inline void add_scaled_rows(float* dst, const float* const* src, const float* a, int K, int C) {
  if (K == 4) {
    const float *s0 = src[0], *s1 = src[1], *s2 = src[2], *s3 = src[3];
    const float a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3];
#pragma omp simd
    for (int c = 0; c < C; ++c) dst[c] += a0 * s0[c] + a1 * s1[c] + a2 * s2[c] + a3 * s3[c];
    return;
  }
  for (int k = 0; k < K; ++k) {
    const float* s = src[k];
    const float ak = a[k];
#pragma omp simd
    for (int c = 0; c < C; ++c) dst[c] += ak * s[c];
  }
}

void matmul_forward_loops(float* out, const float* inp, const float* weight, const float* bias, std::int64_t N,
                          int C, int OC, std::int64_t ld) {
  // out (N,OC) = inp (N,C) x weight^T (C,OC) + bias: dot products of contiguous rows, four
  // weight rows against one input row per pass.
#pragma omp parallel for schedule(static) if (worth_threads(N * C * OC))
  for (std::int64_t i0 = 0; i0 < N; i0 += outer_block) {
    const std::int64_t i1 = std::min(N, i0 + outer_block);
    for (std::int64_t o0 = 0; o0 < OC; o0 += inner_block) {
      const std::int64_t o1 = std::min<std::int64_t>(OC, o0 + inner_block);
      for (std::int64_t i = i0; i < i1; ++i) {
        const float* x = inp + i * C;
        std::int64_t o = o0;
        for (; o + 4 <= o1; o += 4) {
          const float *w0 = weight + o * C, *w1 = w0 + C, *w2 = w1 + C, *w3 = w2 + C;
          float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
          for (int c = 0; c < C; ++c) {
            s0 += x[c] * w0[c];
            s1 += x[c] * w1[c];
            s2 += x[c] * w2[c];
            s3 += x[c] * w3[c];
          }
          const float s[4] = {s0, s1, s2, s3};
          for (int k = 0; k < 4; ++k) out[i * ld + o + k] = (bias ? bias[o + k] : 0.0f) + s[k];
        }
        for (; o < o1; ++o) {
          const float* w = weight + o * C;
          float s = 0.0f;
#pragma omp simd reduction(+ : s)
          for (int c = 0; c < C; ++c) s += x[c] * w[c];
          out[i * ld + o] = (bias ? bias[o] : 0.0f) + s;
        }
      }
    }
  }
}

void matmul_backward_loops(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                           const float* weight, std::int64_t N, int C, int OC, std::int64_t ld, bool accumulate) {
  if (dinp && !accumulate) std::memset(dinp, 0, std::size_t(N) * std::size_t(C) * sizeof(float));
  // dinp (N,C) += dout (N,OC) x weight (OC,C): each row of dinp gathers weight rows, four at a time.
  // Each part may run alone (null: skipped).
#pragma omp parallel for schedule(static) if (worth_threads(N * C * OC))
  for (std::int64_t i0 = 0; i0 < (dinp ? N : 0); i0 += outer_block) {
    const std::int64_t i1 = std::min(N, i0 + outer_block);
    for (std::int64_t o0 = 0; o0 < OC; o0 += inner_block) {
      const std::int64_t o1 = std::min<std::int64_t>(OC, o0 + inner_block);
      for (std::int64_t i = i0; i < i1; ++i) {
        for (std::int64_t o = o0; o < o1; o += 4) {
          const int K = int(std::min<std::int64_t>(4, o1 - o));
          const float* rows[4];
          float a[4];
          for (int k = 0; k < K; ++k) {
            rows[k] = weight + (o + k) * C;
            a[k] = dout[i * ld + o + k];
          }
          add_scaled_rows(dinp + i * C, rows, a, K, C);
        }
      }
    }
  }
  // dweight (OC,C) += dout^T (OC,N) x inp (N,C): each row of dweight gathers input rows, four at a time.
#pragma omp parallel for schedule(static) if (worth_threads(N * C * OC))
  for (std::int64_t o0 = 0; o0 < (dweight ? OC : 0); o0 += outer_block) {
    const std::int64_t o1 = std::min<std::int64_t>(OC, o0 + outer_block);
    for (std::int64_t i0 = 0; i0 < N; i0 += inner_block) {
      const std::int64_t i1 = std::min(N, i0 + inner_block);
      for (std::int64_t o = o0; o < o1; ++o) {
        for (std::int64_t i = i0; i < i1; i += 4) {
          const int K = int(std::min<std::int64_t>(4, i1 - i));
          const float* rows[4];
          float a[4];
          for (int k = 0; k < K; ++k) {
            rows[k] = inp + (i + k) * C;
            a[k] = dout[(i + k) * ld + o];
          }
          add_scaled_rows(dweight + o * C, rows, a, K, C);
        }
      }
    }
  }
  if (dbias) bias_backward(dbias, dout, N, OC, ld);
}

}  // namespace

#endif

void matmul_forward(float* out, const float* inp, const float* weight, const float* bias, std::int64_t N, int C,
                    int OC, std::int64_t ld) {
#if !LLMTRAIN_HAVE_OPENBLAS
  if (!gemm_packed()) return matmul_forward_loops(out, inp, weight, bias, N, C, OC, ld);
#endif
  if (bias) {
#pragma omp parallel for if (worth_threads(N * OC))
    for (std::int64_t i = 0; i < N; ++i) {
      for (int o = 0; o < OC; ++o) out[i * ld + o] = bias[o];
    }
  }
  // out (N,OC) = inp (N,C) x weight^T (C,OC) [+ out]
  gemm(false, true, int(N), OC, C, 1.0f, inp, C, weight, C, bias ? 1.0f : 0.0f, out, ld);
}

void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, std::int64_t N, int C, int OC, std::int64_t ld, bool accumulate) {
#if !LLMTRAIN_HAVE_OPENBLAS
  if (!gemm_packed()) return matmul_backward_loops(dinp, dweight, dbias, dout, inp, weight, N, C, OC, ld, accumulate);
#endif
  // dinp (N,C) (+)= dout (N,OC) x weight (OC,C); each part may run alone (null: skipped)
  if (dinp) gemm(false, false, int(N), C, OC, 1.0f, dout, ld, weight, C, accumulate ? 1.0f : 0.0f, dinp, C);
  // dweight (OC,C) += dout^T (OC,N) x inp (N,C)
  if (dweight) gemm(true, false, OC, C, int(N), 1.0f, dout, ld, inp, C, 1.0f, dweight, C);
  if (dbias) bias_backward(dbias, dout, N, OC, ld);
}

// The fused MLP ops are the plain ones in sequence, so that their results are the unfused model's
// bit for bit (the GPU fuses them into cuBLASLt's epilogues).
void matmul_gelu_forward(float* out, float* pre, const float* inp, const float* weight, const float* bias,
                         std::int64_t N, int C, int OC) {
  matmul_forward(pre, inp, weight, bias, N, C, OC, OC);
  gelu_forward(out, pre, N * OC);
}

void matmul_backward_dgelu(float* dpre, float* dweight, float* dbias, float* dpre_bias, const float* dout,
                           const float* inp, const float* pre, const float* weight, std::int64_t N, int C, int OC) {
  // (N,C): d(GELU output), in a buffer kept by the thread from call to call (no allocation, no
  // zeroing: the matmul writes it whole)
  thread_local std::vector<float> dinp;
  if (dinp.size() < std::size_t(N) * std::size_t(C)) dinp.resize(std::size_t(N) * std::size_t(C));
  matmul_backward(dinp.data(), dweight, dbias, dout, inp, weight, N, C, OC, OC, false);
  std::memset(dpre, 0, std::size_t(N) * std::size_t(C) * sizeof(float));
  gelu_backward(dpre, pre, dinp.data(), N * C);
  if (dpre_bias) bias_backward(dpre_bias, dpre, N, C, C);
}

// One matmul_forward per matrix (on the GPU one strided-batched cuBLASLt call). matmul_forward
// takes weight^T: a weight (K,N) is transposed first, K N elements next to the product's M N K.
void batched_matmul(float* out, const float* inp, const float* weight, std::int64_t B, int M, int N, int K,
                    bool transpose_weight) {
  const std::int64_t MK = std::int64_t(M) * K, NK = std::int64_t(N) * K, MN = std::int64_t(M) * N;
  std::vector<float> transposed(transpose_weight ? 0 : std::size_t(NK));  // (N,K)
  for (std::int64_t b = 0; b < B; ++b) {
    const float* w = weight + b * NK;
    if (!transpose_weight) {
      for (int k = 0; k < K; ++k) {
        for (int j = 0; j < N; ++j) transposed[std::size_t(j) * K + k] = w[std::int64_t(k) * N + j];
      }
      w = transposed.data();
    }
    matmul_forward(out + b * MN, inp + b * MK, w, nullptr, M, K, N, N);
  }
}

}  // namespace llmtrain::cpu
