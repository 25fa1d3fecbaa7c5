// Matmuls through cuBLASLt; weights are (OC, C), as torch.nn.Linear's.
//  - Row-major X (rows, cols) is column-major X^T, so out (N,OC) = inp W^T is, column-major,
//    out^T (OC x N) = W^T (OC x C) inp^T (C x N): A = W transposed, B = inp; and the bias, one
//    value per output channel, is a per-row bias of that column-major product: the BIAS
//    epilogue adds it while the tile is still in registers.
//  - Backward accumulates with beta = 1: dinp^T (C x N) += W^T dout^T, dweight^T (C x OC) +=
//    inp^T dout; dinp's first writer (accumulate false) has beta = 0, so its old values are
//    neither needed (no memset beforehand) nor read. dbias is a deterministic column sum of dout (reduce.cuh): the BGRADB epilogue
//    overwrites instead of adding, and would need a buffer and a second pass anyway.
//  - fp32 in and out with CUBLAS_COMPUTE_32F (true fp32 products: matches the CPU to ~1e-6),
//    or CUBLAS_COMPUTE_32F_FAST_TF32 where the caller's Blas allows TF32.
//  - bf16 (mixed precision): bf16 A and B (tensor cores), CUBLAS_COMPUTE_32F (fp32 accumulation;
//    the TF32 switch does not apply). out and dinp are bf16 D matrices (the += of dinp reads the
//    old bf16 value as C with beta = 1: one rounding per op); dweight is an fp32 D matrix, so the
//    gradient accumulates in fp32; the bias is bf16 (cuBLASLt's bias type defaults to D's), dbias
//    an fp32 column sum of the bf16 dout as in fp32.
//  - GPT-2's MLP fuses its GELU into the matmuls' epilogues (llm.c does the same): the forward of
//    c_fc is GELU_AUX_BIAS (D = GELU(x W^T + b), the aux output the pre-activation x W^T + b, kept
//    for backward as llm.c keeps it: recomputing it would cost a second matmul), the input
//    gradient of c_proj is DGELU (D = GELU'(aux) . dout W, written with beta = 0). cuBLASLt wants
//    the aux leading dimension a multiple of 8; otherwise, or when no algorithm takes the
//    epilogue, the plain matmul and the elementwise GELU kernels run instead (same results to
//    rounding). In fp32 DGELU_BGRAD also gives the bias gradient of c_fc (the column sums of
//    D, the dgelu's output) into a scratch vector that is then added (it overwrites); in bf16 it
//    would give it in bf16 (the bias vector takes D's type), so there a column sum of D does it.
//  - batched_matmul (Newton-Schulz's products over the matrices of one shape) is one strided-batched
//    matmul (BATCH_COUNT and STRIDED_BATCH_OFFSET on every layout): matrix b of each operand starts
//    b strides after the first, so the alignment cuBLASLt is promised is what every matrix has, the
//    first's address and the stride's bytes together.
//  - The algorithm for a shape is chosen once per process (AlgoCache, below, says how) and cached
//    under everything the heuristic sees (shape, batch, transposes, epilogue, compute type, and the
//    pointer alignments: parameter views into the flat buffer are not always 256-byte aligned, and
//    an algorithm chosen for aligned pointers may not run on others).
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "cublaslt_context.h"
#include "cuda_check.h"
#include "instantiate.cuh"
#include "launch.cuh"
#include "llmtrain/kernels/cuda.h"
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
  // Strided batches: `batch` products, matrix b of A, B and D stride_a, stride_b, stride_d elements
  // times b after the first (batch 1: a plain matmul, strides 0).
  std::int32_t batch = 1;
  std::int64_t stride_a = 0, stride_b = 0, stride_d = 0;
  // For error messages: which product of which call ("forward out = inp W^T"), in its (N,C,OC).
  const char* what = "";
  std::int64_t N = 0;
  int C = 0, OC = 0;
};

// The largest power of two (2 to 256) dividing the address and a batch's stride in bytes (0: one
// matrix): what cuBLASLt may assume of every matrix. fp32 pointers are always at least 4-byte
// aligned; a bf16 view may be only 2.
std::uint32_t alignment_of(const void* p, std::uint64_t stride_bytes = 0) {
  const std::uint64_t bits = std::uint64_t(reinterpret_cast<std::uintptr_t>(p)) | stride_bytes;
  std::uint32_t alignment = 256;
  while (alignment > 2 && bits % alignment != 0) alignment /= 2;
  return alignment;
}

std::uint64_t type_bytes(cudaDataType_t type) {
  return type == CUDA_R_16BF ? 2 : 4;
}

// The alignments of A, B and D that hold for every matrix of g's batch.
struct Alignments {
  std::uint32_t a, b, d;
};
Alignments alignments(const Gemm& g, const void* A, const void* B, const void* D) {
  return {alignment_of(A, std::uint64_t(g.stride_a) * type_bytes(g.ab_type)),
          alignment_of(B, std::uint64_t(g.stride_b) * type_bytes(g.ab_type)),
          alignment_of(D, std::uint64_t(g.stride_d) * type_bytes(g.d_type))};
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
  // batch > 1: that many matrices, each `stride` elements after the one before.
  Layout(cudaDataType_t type, std::uint64_t rows, std::uint64_t cols, std::int64_t ld, std::int32_t batch = 1,
         std::int64_t stride = 0) {
    LLMTRAIN_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&layout_, type, rows, cols, ld));
    if (batch <= 1) return;
    LLMTRAIN_CUBLAS_CHECK(
        cublasLtMatrixLayoutSetAttribute(layout_, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch, sizeof batch));
    LLMTRAIN_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(
        layout_, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof stride));
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

// What runs after the product: a bias (input, or the bias gradient written by BGRAD epilogues)
// and the GELU aux matrix (m x n, column-major, leading dimension aux_ld, D's type).
struct Epilogue {
  cublasLtEpilogue_t kind = CUBLASLT_EPILOGUE_DEFAULT;
  const void* bias = nullptr;
  void* aux = nullptr;
  std::int64_t aux_ld = 0;
};

// trans_a, trans_b, m, n, k, lda, ldb, ldd, epilogue, tf32, alignments of A, B, D, bias, aux,
// types of A/B and D, the workspace the algorithm was chosen within (callers may make Blas
// objects with workspaces of other sizes), and the batch count and strides of A, B, D.
using AlgoKey =
    std::tuple<bool, bool, std::uint64_t, std::uint64_t, std::uint64_t, std::int64_t, std::int64_t,
               std::int64_t, int, bool, std::uint32_t, std::uint32_t, std::uint32_t, std::uint32_t,
               std::uint32_t, int, int, std::size_t, std::int32_t, std::int64_t, std::int64_t, std::int64_t>;

// The algorithm for each key, chosen on the key's first matmul:
//  - the heuristic is asked for up to max_algo_candidates algorithms, best first (its order is
//    fixed for one GPU model, cuBLASLt version and problem, so the choice is the same every run);
//  - a candidate needing more workspace than the caller's Blas has (cuda::matmul_workspace_bytes,
//    32 MiB, for the op layer's) is passed over;
//  - the candidates run the matmul in that order until one succeeds; that one has done the
//    call's work and is cached. A candidate that cublasLtMatmul rejects (NOT_SUPPORTED,
//    INVALID_VALUE, ARCH_MISMATCH: statuses of its argument checks, returned before anything is
//    launched, so D is untouched even when beta = 1 accumulates into it) moves on to the next;
//    any other status (EXECUTION_FAILED: a launch failed) or a CUDA error pending after a
//    rejection throws at once;
//  - no candidate (the heuristic returned none, or every one was passed over or rejected)
//    throws a kernels::Error naming the matmul, its shape, types and alignments.
// Later matmuls of the key run the cached algorithm (one algorithm per key for the process's
// life: the same results call after call) and throw if it fails.
constexpr int max_algo_candidates = 8;

class AlgoCache {
 public:
  static AlgoCache& get() {
    static AlgoCache cache;
    return cache;
  }
  std::optional<cublasLtMatmulAlgo_t> find(const AlgoKey& key) {
    const std::lock_guard<std::mutex> lock(mutex_);
    const auto found = algos_.find(key);
    if (found == algos_.end()) return std::nullopt;
    return found->second;
  }
  // The first algorithm recorded for a key stays (two threads choosing at once choose the same).
  void insert(const AlgoKey& key, const cublasLtMatmulAlgo_t& algo) {
    const std::lock_guard<std::mutex> lock(mutex_);
    algos_.emplace(key, algo);
  }

 private:
  std::mutex mutex_;
  std::map<AlgoKey, cublasLtMatmulAlgo_t> algos_;
};

// The statuses with which cublasLtMatmul turns down an algorithm for a problem, before it
// launches anything.
bool rejects_algorithm(cublasStatus_t status) {
  return status == CUBLAS_STATUS_NOT_SUPPORTED || status == CUBLAS_STATUS_INVALID_VALUE ||
         status == CUBLAS_STATUS_ARCH_MISMATCH;
}

const char* type_name(cudaDataType_t type) {
  return type == CUDA_R_16BF ? "bf16" : type == CUDA_R_32F ? "fp32" : "other";
}

// "forward out = inp W^T (N=4, C=8, OC=16): bf16 inputs, bf16 output, fp32 compute, column-major
// m=16 n=4 k=8, A transposed, B not transposed, ld 8/8/16, bias epilogue, alignment A/B/D/bias
// 256/2/256/256 bytes"
const char* epilogue_name(cublasLtEpilogue_t kind) {
  switch (kind) {
    case CUBLASLT_EPILOGUE_BIAS: return "bias epilogue";
    case CUBLASLT_EPILOGUE_GELU_AUX_BIAS: return "GELU_AUX_BIAS epilogue";
    case CUBLASLT_EPILOGUE_DGELU: return "DGELU epilogue";
    case CUBLASLT_EPILOGUE_DGELU_BGRAD: return "DGELU_BGRAD epilogue";
    default: return "no epilogue";
  }
}

std::string describe(const Gemm& g, bool tf32, const void* A, const void* B, const void* D, const Epilogue& epi) {
  const void* bias = epi.bias;
  const Alignments align = alignments(g, A, B, D);
  const std::string batch = g.batch > 1 ? ", batch " + std::to_string(g.batch) + " strides " +
                                              std::to_string(g.stride_a) + "/" + std::to_string(g.stride_b) +
                                              "/" + std::to_string(g.stride_d)
                                        : std::string();
  return std::string(g.what) + " (N=" + std::to_string(g.N) + ", C=" + std::to_string(g.C) +
         ", OC=" + std::to_string(g.OC) + "): " + type_name(g.ab_type) + " inputs, " + type_name(g.d_type) +
         " output, " + (tf32 ? "tf32" : "fp32") + " compute, column-major m=" + std::to_string(g.m) +
         " n=" + std::to_string(g.n) + " k=" + std::to_string(g.k) + ", A " +
         (g.trans_a ? "transposed" : "not transposed") + ", B " +
         (g.trans_b ? "transposed" : "not transposed") + ", ld " + std::to_string(g.lda) + "/" +
         std::to_string(g.ldb) + "/" + std::to_string(g.ldd) + batch + ", " + epilogue_name(epi.kind) +
         ", alignment A/B/D/bias " + std::to_string(align.a) + "/" + std::to_string(align.b) + "/" +
         std::to_string(align.d) + "/" + (bias ? std::to_string(alignment_of(bias)) : std::string("-")) +
         " bytes";
}

// Runs D = op(A) op(B) (+ beta D) with the epilogue. Returns false, having launched nothing, when
// no algorithm takes the problem and `may_decline` (the caller has an unfused way); else throws.
bool gemm(const Gemm& g, const void* A, const void* B, void* D, Epilogue epi, float beta, const Blas& blas,
          cudaStream_t stream, bool may_decline = false) {
  const void* bias = epi.kind == CUBLASLT_EPILOGUE_BIAS || epi.kind == CUBLASLT_EPILOGUE_GELU_AUX_BIAS ? epi.bias : nullptr;
  // A bias view below 16-byte alignment (a bf16 one may be 2-byte aligned) goes through an
  // aligned stream-ordered copy: cuBLASLt states no alignment rule for the BIAS epilogue's
  // vector, and the copy (m elements) costs next to nothing.
  const std::size_t bias_bytes = g.m * (g.d_type == CUDA_R_16BF ? 2 : 4);
  const StreamScratch aligned_bias(bias && alignment_of(bias) < 16 ? bias_bytes : 0, stream);
  if (bias && alignment_of(bias) < 16) {
    LLMTRAIN_CUDA_CHECK(
        cudaMemcpyAsync(aligned_bias.at<char>(), bias, bias_bytes, cudaMemcpyDeviceToDevice, stream));
    bias = aligned_bias.at<char>();
    epi.bias = bias;
  }
  const bool tf32 = g.ab_type == CUDA_R_32F && blas.allow_tf32;  // TF32 rounds fp32 inputs only
  MatmulDesc desc(tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F);
  desc.set(CUBLASLT_MATMUL_DESC_TRANSA, g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N);
  desc.set(CUBLASLT_MATMUL_DESC_TRANSB, g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N);
  desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE, epi.kind);
  if (epi.bias) desc.set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, epi.bias);
  if (epi.aux) {
    desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, epi.aux);
    desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, epi.aux_ld);
  }
  // Stored shapes: op(A) = A^T means A is stored k x m.
  const Layout a(g.ab_type, g.trans_a ? g.k : g.m, g.trans_a ? g.m : g.k, g.lda, g.batch, g.stride_a);
  const Layout b(g.ab_type, g.trans_b ? g.n : g.k, g.trans_b ? g.k : g.n, g.ldb, g.batch, g.stride_b);
  const Layout d(g.d_type, g.m, g.n, g.ldd, g.batch, g.stride_d);
  const Alignments align = alignments(g, A, B, D);
  const float alpha = 1.0f;
  const auto run = [&](const cublasLtMatmulAlgo_t& algo) {
    return cublasLtMatmul(blas.handle, desc.get(), &alpha, A, a.get(), B, b.get(), &beta, D, d.get(), D, d.get(),
                          &algo, blas.workspace, blas.workspace_bytes, stream);
  };

  const AlgoKey key{g.trans_a,
                    g.trans_b,
                    g.m,
                    g.n,
                    g.k,
                    g.lda,
                    g.ldb,
                    g.ldd,
                    int(epi.kind),
                    tf32,
                    align.a,
                    align.b,
                    align.d,
                    epi.bias ? alignment_of(epi.bias) : 0u,
                    epi.aux ? alignment_of(epi.aux) : 0u,
                    int(g.ab_type),
                    int(g.d_type),
                    blas.workspace_bytes,
                    g.batch,
                    g.stride_a,
                    g.stride_b,
                    g.stride_d};
  AlgoCache& cache = AlgoCache::get();
  if (const std::optional<cublasLtMatmulAlgo_t> algo = cache.find(key)) {
    LLMTRAIN_CUBLAS_CHECK(run(*algo));
    return true;
  }

  Preference preference;
  preference.set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, std::uint64_t(blas.workspace_bytes));
  preference.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align.a);
  preference.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align.b);
  preference.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align.d);
  preference.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align.d);
  std::vector<cublasLtMatmulHeuristicResult_t> candidates(max_algo_candidates);
  int candidate_count = 0;
  // With no algorithm for the problem the heuristic returns NOT_SUPPORTED (and a count of 0).
  const cublasStatus_t heuristic =
      cublasLtMatmulAlgoGetHeuristic(blas.handle, desc.get(), a.get(), b.get(), d.get(), d.get(),
                                     preference.get(), max_algo_candidates, candidates.data(), &candidate_count);
  std::string tried = heuristic == CUBLAS_STATUS_SUCCESS
                          ? "the heuristic offered " + std::to_string(candidate_count) + " algorithm(s)"
                          : std::string("the heuristic returned ") + cublasLtGetStatusString(heuristic);
  if (heuristic != CUBLAS_STATUS_SUCCESS) candidate_count = 0;
  for (int i = 0; i < candidate_count; ++i) {
    const cublasLtMatmulHeuristicResult_t& candidate = candidates[std::size_t(i)];
    tried += "; #" + std::to_string(i) + ": ";
    if (candidate.state != CUBLAS_STATUS_SUCCESS) {
      tried += std::string("state ") + cublasLtGetStatusString(candidate.state);
      continue;
    }
    if (candidate.workspaceSize > blas.workspace_bytes) {
      tried += "needs " + std::to_string(candidate.workspaceSize) + " bytes of workspace, we have " +
               std::to_string(blas.workspace_bytes);
      continue;
    }
    const cublasStatus_t status = run(candidate.algo);
    if (status == CUBLAS_STATUS_SUCCESS) {
      cache.insert(key, candidate.algo);
      return true;
    }
    if (!rejects_algorithm(status)) {
      throw_cublas_error(status, ("cublasLtMatmul (algorithm #" + std::to_string(i) + " for " +
                                  describe(g, tf32, A, B, D, epi) + ")")
                                     .c_str(),
                         __FILE__, __LINE__);
    }
    LLMTRAIN_CUDA_CHECK(cudaPeekAtLastError());  // a CUDA error is not the algorithm's
    tried += cublasLtGetStatusString(status);
  }
  if (may_decline) return false;
  throw kernels::Error("cuBLASLt has no algorithm that runs the matmul " + describe(g, tf32, A, B, D, epi) + " (" +
                     tried + ")");
}

// Per (row, channel) of dout (N,OC; rows ld apart): the bias gradient term.
template <class Elem>
struct BiasGrad {
  const Elem* dout;
  std::int64_t ld;
  __device__ void operator()(std::int64_t i, int c, float (&v)[1]) const {
    v[0] = to_float(dout[i * ld + c]);
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
// The three products of a linear layer (inp (N, C), W (OC, C) row-major, out (N, OC)), in
// cuBLASLt's column-major terms; ld is the row stride of out and dout (OC, or more for the
// padded logits). forward: out^T (OC x N) = W^T (OC x C; W stored column-major C x OC) inp^T (C x N).
template <class Elem>
Gemm forward_gemm(std::int64_t N, int C, int OC, std::int64_t ld, const char* what) {
  Gemm g;
  g.trans_a = true;
  g.m = std::uint64_t(OC);
  g.n = std::uint64_t(N);
  g.k = std::uint64_t(C);
  g.lda = C;
  g.ldb = C;
  g.ldd = ld;
  g.ab_type = g.d_type = data_type<Elem>();
  g.what = what;
  g.N = N;
  g.C = C;
  g.OC = OC;
  return g;
}

// dinp^T (C x N) = W^T (C x OC, W stored column-major) dout^T (OC x N).
template <class Elem>
Gemm dinp_gemm(std::int64_t N, int C, int OC, std::int64_t ld, const char* what) {
  Gemm g;
  g.m = std::uint64_t(C);
  g.n = std::uint64_t(N);
  g.k = std::uint64_t(OC);
  g.lda = C;
  g.ldb = ld;
  g.ldd = C;
  g.ab_type = g.d_type = data_type<Elem>();
  g.what = what;
  g.N = N;
  g.C = C;
  g.OC = OC;
  return g;
}

// dweight^T (C x OC) += inp^T (C x N) dout (N x OC; dout^T stored column-major OC x N), in fp32.
template <class Elem>
Gemm dweight_gemm(std::int64_t N, int C, int OC, std::int64_t ld) {
  Gemm g;
  g.trans_b = true;
  g.m = std::uint64_t(C);
  g.n = std::uint64_t(OC);
  g.k = std::uint64_t(N);
  g.lda = C;
  g.ldb = ld;
  g.ldd = C;
  g.ab_type = data_type<Elem>();
  g.d_type = CUDA_R_32F;  // the weight gradient accumulates in fp32
  g.what = "backward dweight += dout^T inp";
  g.N = N;
  g.C = C;
  g.OC = OC;
  return g;
}

// Per matrix b of the batch: out_b^T (N x M) = op(W_b) (N x K) inp_b^T (K x M), with W_b (N,K)
// row-major stored column-major K x N (transposed), or W_b (K,N) stored column-major N x K.
template <class Elem>
Gemm batched_gemm(std::int64_t B, int M, int N, int K, bool transpose_weight) {
  Gemm g;
  g.trans_a = transpose_weight;
  g.m = std::uint64_t(N);
  g.n = std::uint64_t(M);
  g.k = std::uint64_t(K);
  g.lda = transpose_weight ? K : N;
  g.ldb = K;
  g.ldd = N;
  g.ab_type = g.d_type = data_type<Elem>();
  g.what = transpose_weight ? "batched out = inp W^T" : "batched out = inp W";
  g.N = M;
  g.C = K;
  g.OC = N;
  if (B > 1) {
    g.batch = std::int32_t(B);
    g.stride_a = std::int64_t(N) * K;
    g.stride_b = std::int64_t(M) * K;
    g.stride_d = std::int64_t(M) * N;
  }
  return g;
}

template <class Elem>
void matmul_forward_gemms(Elem* out, const Elem* inp, const Elem* weight, const Elem* bias, std::int64_t N,
                          int C, int OC, std::int64_t ld, const Blas& blas, cudaStream_t stream) {
  if (N <= 0 || OC <= 0) return;
  // out^T (OC x N) = W^T (OC x C; W stored column-major C x OC) inp^T (C x N) [+ bias]
  const Gemm g = forward_gemm<Elem>(N, C, OC, ld, "forward out = inp W^T");
  gemm(g, weight, inp, out, Epilogue{bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT, bias}, 0.0f, blas,
       stream);
}

template <class Elem>
void matmul_backward_gemms(Elem* dinp, float* dweight, float* dbias, const Elem* dout, const Elem* inp,
                           const Elem* weight, std::int64_t N, int C, int OC, std::int64_t ld, bool accumulate,
                           const Blas& blas, cudaStream_t stream) {
  if (N <= 0 || OC <= 0 || C <= 0) return;
  // dinp^T (C x N) += W^T (C x OC, W stored column-major) dout^T (OC x N); each part may run
  // alone (null: skipped)
  if (dinp) {
    const Gemm dx = dinp_gemm<Elem>(N, C, OC, ld, "backward dinp += dout W");
    gemm(dx, weight, dout, dinp, Epilogue{}, accumulate ? 1.0f : 0.0f, blas, stream);
  }
  // dweight^T (C x OC) += inp^T (C x N) dout (N x OC; dout^T stored column-major OC x N)
  if (dweight) {
    const Gemm dw = dweight_gemm<Elem>(N, C, OC, ld);
    gemm(dw, inp, dout, dweight, Epilogue{}, 1.0f, blas, stream);
  }
  if (dbias) column_sums<1>(ColumnOutputs<1>{{dbias}}, BiasGrad<Elem>{dout, ld}, N, OC, stream);
}

// pre = inp W^T + bias and out = GELU(pre) in one GEMM where cuBLASLt takes it.
template <class Elem>
void matmul_gelu_forward_gemms(Elem* out, Elem* pre, const Elem* inp, const Elem* weight, const Elem* bias,
                               std::int64_t N, int C, int OC, const Blas& blas, cudaStream_t stream) {
  if (N <= 0 || OC <= 0) return;
  const Gemm g = forward_gemm<Elem>(N, C, OC, OC, "forward out = GELU(inp W^T + bias)");
  // GELU_AUX_BIAS needs a bias: a missing one is a zero vector (OC elements, next to nothing).
  const StreamScratch zero_bias(bias ? 0 : std::size_t(OC) * sizeof(Elem), stream);
  if (!bias) {
    LLMTRAIN_CUDA_CHECK(cudaMemsetAsync(zero_bias.at<Elem>(), 0, std::size_t(OC) * sizeof(Elem), stream));
    bias = zero_bias.at<Elem>();
  }
  if (OC % 8 == 0 &&
      gemm(g, weight, inp, out, Epilogue{CUBLASLT_EPILOGUE_GELU_AUX_BIAS, bias, pre, OC}, 0.0f, blas, stream, true)) {
    return;
  }
  gemm(g, weight, inp, pre, Epilogue{CUBLASLT_EPILOGUE_BIAS, bias}, 0.0f, blas, stream);
  gelu_forward(out, pre, N * OC, stream);
}

template <class Elem>
void matmul_backward_dgelu_gemms(Elem* dpre, float* dweight, float* dbias, float* dpre_bias, const Elem* dout,
                                 const Elem* inp, const Elem* pre, const Elem* weight, std::int64_t N, int C, int OC,
                                 const Blas& blas, cudaStream_t stream) {
  if (N <= 0 || OC <= 0 || C <= 0) return;
  // dpre^T (C x N) = GELU'(pre^T) . W^T (C x OC) dout^T (OC x N), written (beta = 0)
  const Gemm dx = dinp_gemm<Elem>(N, C, OC, OC, "backward dpre = GELU'(pre) dout W");
  // fp32: the bias gradient of pre from the same epilogue, into a scratch (BGRAD writes).
  const bool bgrad = dpre_bias && dx.d_type == CUDA_R_32F;
  const StreamScratch bias_grad(bgrad ? std::size_t(C) * sizeof(float) : 0, stream);
  bool fused = false;
  if (C % 8 == 0) {
    const Epilogue epi{bgrad ? CUBLASLT_EPILOGUE_DGELU_BGRAD : CUBLASLT_EPILOGUE_DGELU,
                       bgrad ? bias_grad.at<float>() : nullptr, const_cast<Elem*>(pre), C};
    fused = gemm(dx, weight, dout, dpre, epi, 0.0f, blas, stream, true);
  }
  if (fused && bgrad) {
    add_columns(dpre_bias, bias_grad.at<float>(), C, stream);
  } else if (!fused) {  // the product, then the elementwise GELU backward into the zeroed dpre
    const StreamScratch product(std::size_t(N) * std::size_t(C) * sizeof(Elem), stream);
    gemm(dx, weight, dout, product.at<Elem>(), Epilogue{}, 0.0f, blas, stream);
    LLMTRAIN_CUDA_CHECK(cudaMemsetAsync(dpre, 0, std::size_t(N) * std::size_t(C) * sizeof(Elem), stream));
    gelu_backward(dpre, pre, product.at<Elem>(), N * C, stream);
  }
  if (dpre_bias && !(fused && bgrad)) {
    column_sums<1>(ColumnOutputs<1>{{dpre_bias}}, BiasGrad<Elem>{dpre, C}, N, C, stream);
  }
  // dweight and dbias as in matmul_backward (none: left to a later matmul_backward)
  if (dweight) {
    const Gemm dw = dweight_gemm<Elem>(N, C, OC, OC);
    gemm(dw, inp, dout, dweight, Epilogue{}, 1.0f, blas, stream);
  }
  if (dbias) column_sums<1>(ColumnOutputs<1>{{dbias}}, BiasGrad<Elem>{dout, OC}, N, OC, stream);
}

}  // namespace

template <class Act>
void matmul_forward(Act* out, const Act* inp, const Act* weight, const Act* bias, std::int64_t N, int C, int OC,
                    std::int64_t ld, const Blas& blas, cudaStream_t stream) {
  matmul_forward_gemms(out, inp, weight, bias, N, C, OC, ld, blas, stream);
}
LLMTRAIN_INSTANTIATE_ACTIVATIONS(matmul_forward)

template <class Act>
void batched_matmul(Act* out, const Act* inp, const Act* weight, std::int64_t B, int M, int N, int K,
                    bool transpose_weight, const Blas& blas, cudaStream_t stream) {
  if (B <= 0 || M <= 0 || N <= 0) return;
  if (B > INT32_MAX) throw kernels::Error("cuda::batched_matmul: a batch of over 2^31 - 1 matrices");
  gemm(batched_gemm<Act>(B, M, N, K, transpose_weight), weight, inp, out, Epilogue{}, 0.0f, blas, stream);
}
LLMTRAIN_INSTANTIATE_ACTIVATIONS(batched_matmul)

template <class Act>
void matmul_backward(Act* dinp, float* dweight, float* dbias, const Act* dout, const Act* inp, const Act* weight,
                     std::int64_t N, int C, int OC, std::int64_t ld, bool accumulate, const Blas& blas,
                     cudaStream_t stream) {
  matmul_backward_gemms(dinp, dweight, dbias, dout, inp, weight, N, C, OC, ld, accumulate, blas, stream);
}
LLMTRAIN_INSTANTIATE_ACTIVATIONS(matmul_backward)

template <class Act>
void matmul_gelu_forward(Act* out, Act* pre, const Act* inp, const Act* weight, const Act* bias, std::int64_t N,
                         int C, int OC, const Blas& blas, cudaStream_t stream) {
  matmul_gelu_forward_gemms(out, pre, inp, weight, bias, N, C, OC, blas, stream);
}
LLMTRAIN_INSTANTIATE_ACTIVATIONS(matmul_gelu_forward)

template <class Act>
void matmul_backward_dgelu(Act* dpre, float* dweight, float* dbias, float* dpre_bias, const Act* dout, const Act* inp,
                           const Act* pre, const Act* weight, std::int64_t N, int C, int OC, const Blas& blas,
                           cudaStream_t stream) {
  matmul_backward_dgelu_gemms(dpre, dweight, dbias, dpre_bias, dout, inp, pre, weight, N, C, OC, blas, stream);
}
LLMTRAIN_INSTANTIATE_ACTIVATIONS(matmul_backward_dgelu)

}  // namespace llmtrain::cuda
