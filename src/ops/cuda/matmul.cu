// Matmuls through cuBLASLt; weights are (OC, C), as torch.nn.Linear's.
//  - Row-major X (rows, cols) is column-major X^T, so out (N,OC) = inp W^T is, column-major,
//    out^T (OC x N) = W^T (OC x C) inp^T (C x N): A = W transposed, B = inp; and the bias, one
//    value per output channel, is a per-row bias of that column-major product: the BIAS
//    epilogue adds it while the tile is still in registers.
//  - Backward accumulates with beta = 1: dinp^T (C x N) += W^T dout^T, dweight^T (C x OC) +=
//    inp^T dout. dbias is a deterministic column sum of dout (reduce.cuh): the BGRADB epilogue
//    overwrites instead of adding, and would need a buffer and a second pass anyway.
//  - fp32 in and out with CUBLAS_COMPUTE_32F (true fp32 products: matches the CPU to ~1e-6),
//    or CUBLAS_COMPUTE_32F_FAST_TF32 after set_matmul_tf32(true).
//  - bf16 (mixed precision): bf16 A and B (tensor cores), CUBLAS_COMPUTE_32F (fp32 accumulation;
//    the TF32 switch does not apply). out and dinp are bf16 D matrices (the += of dinp reads the
//    old bf16 value as C with beta = 1: one rounding per op); dweight is an fp32 D matrix, so the
//    gradient accumulates in fp32; the bias is bf16 (cuBLASLt's bias type defaults to D's), dbias
//    an fp32 column sum of the bf16 dout as in fp32.
//  - The algorithm for a shape comes from cuBLASLt's heuristic once, then from a cache keyed by
//    everything the heuristic sees (shape, transposes, epilogue, compute type, and the pointer
//    alignments: parameter views into the flat buffer are not always 256-byte aligned, and an
//    algorithm chosen for aligned pointers may not run on others).
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "cublaslt_context.h"
#include "cuda_check.h"
#include "launch.cuh"
#include "kernels.h"
#include "reduce.cuh"
#include "vector_io.cuh"

namespace llmtrain::cuda {
namespace {

// D (m x n) = op(A) op(B) [+ bias per row] + beta D, all column-major; op(A) is m x k. A and B
// have one element type, D (and the bias) another.
struct Gemm {
  bool trans_a = false, trans_b = false;
  std::uint64_t m = 0, n = 0, k = 0;
  std::int64_t lda = 0, ldb = 0, ldd = 0;
  cudaDataType_t ab_type = CUDA_R_32F, d_type = CUDA_R_32F;
};

// The largest power of two (2 to 256) dividing the address: what cuBLASLt may assume. fp32
// pointers are always at least 4-byte aligned; a bf16 view may be only 2.
std::uint32_t alignment_of(const void* p) {
  const auto address = reinterpret_cast<std::uintptr_t>(p);
  std::uint32_t alignment = 256;
  while (alignment > 2 && address % alignment != 0) alignment /= 2;
  return alignment;
}

class MatmulDesc {
 public:
  explicit MatmulDesc(cublasComputeType_t compute) {
    LLMTRAIN_CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc_, compute, CUDA_R_32F));
  }
  ~MatmulDesc() { cublasLtMatmulDescDestroy(desc_); }
  MatmulDesc(const MatmulDesc&) = delete;
  MatmulDesc& operator=(const MatmulDesc&) = delete;
  template <class V>
  void set(cublasLtMatmulDescAttributes_t attribute, const V& value) {
    LLMTRAIN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc_, attribute, &value, sizeof value));
  }
  cublasLtMatmulDesc_t get() const { return desc_; }

 private:
  cublasLtMatmulDesc_t desc_ = nullptr;
};

class Layout {
 public:
  Layout(cudaDataType_t type, std::uint64_t rows, std::uint64_t cols, std::int64_t ld) {
    LLMTRAIN_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&layout_, type, rows, cols, ld));
  }
  ~Layout() { cublasLtMatrixLayoutDestroy(layout_); }
  Layout(const Layout&) = delete;
  Layout& operator=(const Layout&) = delete;
  cublasLtMatrixLayout_t get() const { return layout_; }

 private:
  cublasLtMatrixLayout_t layout_ = nullptr;
};

class Preference {
 public:
  Preference() { LLMTRAIN_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&preference_)); }
  ~Preference() { cublasLtMatmulPreferenceDestroy(preference_); }
  Preference(const Preference&) = delete;
  Preference& operator=(const Preference&) = delete;
  template <class V>
  void set(cublasLtMatmulPreferenceAttributes_t attribute, const V& value) {
    LLMTRAIN_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference_, attribute, &value, sizeof value));
  }
  cublasLtMatmulPreference_t get() const { return preference_; }

 private:
  cublasLtMatmulPreference_t preference_ = nullptr;
};

// trans_a, trans_b, m, n, k, lda, ldb, ldd, bias, tf32, alignments of A, B, D, bias, types of
// A/B and D.
using AlgoKey = std::tuple<bool, bool, std::uint64_t, std::uint64_t, std::uint64_t, std::int64_t,
                           std::int64_t, std::int64_t, bool, bool, std::uint32_t, std::uint32_t,
                           std::uint32_t, std::uint32_t, int, int>;

class AlgoCache {
 public:
  static AlgoCache& get() {
    static AlgoCache cache;
    return cache;
  }
  std::mutex mutex;
  std::map<AlgoKey, cublasLtMatmulAlgo_t> algos;
};

void gemm(const Gemm& g, const void* A, const void* B, void* D, const void* bias, float beta,
          cudaStream_t stream) {
  // A bias view below 16-byte alignment (a bf16 one may be 2-byte aligned) goes through an
  // aligned stream-ordered copy: cuBLASLt states no alignment rule for the BIAS epilogue's
  // vector, and the copy (m elements) costs next to nothing.
  const std::size_t bias_bytes = g.m * (g.d_type == CUDA_R_16BF ? 2 : 4);
  const StreamScratch aligned_bias(bias && alignment_of(bias) < 16 ? bias_bytes : 0, stream);
  if (bias && alignment_of(bias) < 16) {
    LLMTRAIN_CUDA_CHECK(
        cudaMemcpyAsync(aligned_bias.at<char>(), bias, bias_bytes, cudaMemcpyDeviceToDevice, stream));
    bias = aligned_bias.at<char>();
  }
  CublasLtContext& context = CublasLtContext::get();
  const bool tf32 = g.ab_type == CUDA_R_32F && context.allow_tf32();  // TF32 rounds fp32 inputs only
  MatmulDesc desc(tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F);
  desc.set(CUBLASLT_MATMUL_DESC_TRANSA, g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N);
  desc.set(CUBLASLT_MATMUL_DESC_TRANSB, g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N);
  desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE, bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT);
  if (bias) desc.set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias);
  // Stored shapes: op(A) = A^T means A is stored k x m.
  const Layout a(g.ab_type, g.trans_a ? g.k : g.m, g.trans_a ? g.m : g.k, g.lda);
  const Layout b(g.ab_type, g.trans_b ? g.n : g.k, g.trans_b ? g.k : g.n, g.ldb);
  const Layout d(g.d_type, g.m, g.n, g.ldd);

  const AlgoKey key{g.trans_a,
                    g.trans_b,
                    g.m,
                    g.n,
                    g.k,
                    g.lda,
                    g.ldb,
                    g.ldd,
                    bias != nullptr,
                    tf32,
                    alignment_of(A),
                    alignment_of(B),
                    alignment_of(D),
                    bias ? alignment_of(bias) : 0u,
                    int(g.ab_type),
                    int(g.d_type)};
  cublasLtMatmulAlgo_t algo;
  {
    AlgoCache& cache = AlgoCache::get();
    const std::lock_guard<std::mutex> lock(cache.mutex);
    const auto found = cache.algos.find(key);
    if (found != cache.algos.end()) {
      algo = found->second;
    } else {
      Preference preference;
      preference.set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, std::uint64_t(context.workspace_bytes()));
      preference.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, alignment_of(A));
      preference.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, alignment_of(B));
      preference.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, alignment_of(D));
      preference.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, alignment_of(D));
      cublasLtMatmulHeuristicResult_t result{};
      int found_count = 0;
      LLMTRAIN_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(context.handle(), desc.get(), a.get(), b.get(),
                                                           d.get(), d.get(), preference.get(), 1, &result,
                                                           &found_count));
      if (found_count == 0) {
        throw RuntimeError("cuBLASLt has no algorithm for the matmul m=" + std::to_string(g.m) + " n=" +
                           std::to_string(g.n) + " k=" + std::to_string(g.k) + (bias ? " with bias" : "") +
                           (g.ab_type == CUDA_R_16BF ? " (bf16 inputs, " : " (fp32 inputs, ") +
                           (g.d_type == CUDA_R_16BF ? "bf16 output)" : "fp32 output)") + ", alignments " +
                           std::to_string(alignment_of(A)) + "/" + std::to_string(alignment_of(B)) + "/" +
                           std::to_string(alignment_of(D)) + " bytes");
      }
      algo = result.algo;
      cache.algos.emplace(key, algo);
    }
  }
  const float alpha = 1.0f;
  LLMTRAIN_CUBLAS_CHECK(cublasLtMatmul(context.handle(), desc.get(), &alpha, A, a.get(), B, b.get(), &beta, D,
                                       d.get(), D, d.get(), &algo, context.workspace(),
                                       context.workspace_bytes(), stream));
}

// Per (row, channel) of dout (N,OC): the bias gradient term.
template <class Elem>
struct BiasGrad {
  const Elem* dout;  // (N,OC)
  int OC;
  __device__ void operator()(std::int64_t i, int c, float (&v)[1]) const {
    v[0] = to_float(dout[i * OC + c]);
  }
};

template <class T>
constexpr cudaDataType_t data_type();
template <>
constexpr cudaDataType_t data_type<float>() {
  return CUDA_R_32F;
}
template <>
constexpr cudaDataType_t data_type<bf16>() {
  return CUDA_R_16BF;
}

// Elem: the type of the activations and weights (fp32 or bf16); dweight and dbias are fp32.
template <class Elem>
void matmul_forward_gemms(Elem* out, const Elem* inp, const Elem* weight, const Elem* bias, std::int64_t N,
                          int C, int OC, cudaStream_t stream) {
  if (N <= 0 || OC <= 0) return;
  // out^T (OC x N) = W^T (OC x C; W stored column-major C x OC) inp^T (C x N) [+ bias]
  Gemm g;
  g.trans_a = true;
  g.m = std::uint64_t(OC);
  g.n = std::uint64_t(N);
  g.k = std::uint64_t(C);
  g.lda = C;
  g.ldb = C;
  g.ldd = OC;
  g.ab_type = g.d_type = data_type<Elem>();
  gemm(g, weight, inp, out, bias, 0.0f, stream);
}

template <class Elem>
void matmul_backward_gemms(Elem* dinp, float* dweight, float* dbias, const Elem* dout, const Elem* inp,
                           const Elem* weight, std::int64_t N, int C, int OC, cudaStream_t stream) {
  if (N <= 0 || OC <= 0 || C <= 0) return;
  // dinp^T (C x N) += W^T (C x OC, W stored column-major) dout^T (OC x N)
  Gemm dx;
  dx.m = std::uint64_t(C);
  dx.n = std::uint64_t(N);
  dx.k = std::uint64_t(OC);
  dx.lda = C;
  dx.ldb = OC;
  dx.ldd = C;
  dx.ab_type = dx.d_type = data_type<Elem>();
  gemm(dx, weight, dout, dinp, nullptr, 1.0f, stream);
  // dweight^T (C x OC) += inp^T (C x N) dout (N x OC; dout^T stored column-major OC x N)
  Gemm dw;
  dw.trans_b = true;
  dw.m = std::uint64_t(C);
  dw.n = std::uint64_t(OC);
  dw.k = std::uint64_t(N);
  dw.lda = C;
  dw.ldb = OC;
  dw.ldd = C;
  dw.ab_type = data_type<Elem>();
  dw.d_type = CUDA_R_32F;  // the weight gradient accumulates in fp32
  gemm(dw, inp, dout, dweight, nullptr, 1.0f, stream);
  if (dbias) column_sums<1>(ColumnOutputs<1>{{dbias}}, BiasGrad<Elem>{dout, OC}, N, OC, stream);
}

}  // namespace

void set_matmul_tf32(bool allow) {
  CublasLtContext::get().set_allow_tf32(allow);
}

void matmul_forward(float* out, const float* inp, const float* weight, const float* bias, std::int64_t N,
                    int C, int OC, cudaStream_t stream) {
  matmul_forward_gemms(out, inp, weight, bias, N, C, OC, stream);
}

void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, std::int64_t N, int C, int OC, cudaStream_t stream) {
  matmul_backward_gemms(dinp, dweight, dbias, dout, inp, weight, N, C, OC, stream);
}

void matmul_forward(bf16* out, const bf16* inp, const bf16* weight, const bf16* bias, std::int64_t N, int C,
                    int OC, cudaStream_t stream) {
  matmul_forward_gemms(out, inp, weight, bias, N, C, OC, stream);
}

void matmul_backward(bf16* dinp, float* dweight, float* dbias, const bf16* dout, const bf16* inp,
                     const bf16* weight, std::int64_t N, int C, int OC, cudaStream_t stream) {
  matmul_backward_gemms(dinp, dweight, dbias, dout, inp, weight, N, C, OC, stream);
}

}  // namespace llmtrain::cuda
