// Self-test of the CUDA emulator: small kernels with one deliberate bug each, and the one
// correct twin, to show that the emulator reports what it claims to. One scenario per process
// (device faults are sticky):   emu_selftest SCENARIO   ("emu_selftest list" names them).
// The process prints "DETECTED: ..." or "OK: ..." when it returns normally; for the scenarios a
// sanitizer catches, the sanitizer's report ends the process. dev/cuda_emu/run.sh --selftest
// runs them all and checks each outcome against what is expected.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/cuda/mma.cuh"

namespace {

constexpr int n = 64;

__global__ void neighbour_read(float* out, bool sync) {
  __shared__ float s[n];
  s[threadIdx.x] = float(threadIdx.x);
  if (sync) __syncthreads();
  out[threadIdx.x] = s[(threadIdx.x + 1) % n];  // written by another thread
}

__global__ void previous_read(float* out) {
  __shared__ float s[n];
  s[threadIdx.x] = float(threadIdx.x);
  out[threadIdx.x] = threadIdx.x > 0 ? s[threadIdx.x - 1] : 0.0f;  // no barrier: a race
}

__global__ void warp_sum_after_exit(float* out) {
  if (threadIdx.x >= 16) return;  // half the warp leaves
  float x = 1.0f;
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  out[threadIdx.x] = x;
}

__global__ void warp_sum(float* out) {
  float x = float(threadIdx.x);
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  const float down = __shfl_down_sync(0xffffffffu, float(threadIdx.x), 1);
  const unsigned ballot = __ballot_sync(0xffffffffu, threadIdx.x % 2 == 0);
  out[threadIdx.x] = x + (threadIdx.x == 31 ? 0.0f : down - float(threadIdx.x + 1)) + (ballot == 0x55555555u ? 0.0f : 1e6f);
}

__global__ void divergent_barrier(float* out) {
  if (threadIdx.x < 16) {
    out[threadIdx.x] = __shfl_sync(0xffffffffu, 1.0f, 0);
  } else {
    __syncthreads();
  }
}

__global__ void mismatched_masks(float* out) {
  const unsigned mask = threadIdx.x == 3 ? 0x0000ffffu : 0xffffffffu;
  out[threadIdx.x] = __shfl_xor_sync(mask, 1.0f, 1);
}

__global__ void shared_overflow(float* out) {
  __shared__ float s[32];
  s[threadIdx.x + 1] = 1.0f;  // thread 31 writes s[32]
  __syncthreads();
  out[threadIdx.x] = s[threadIdx.x];
}

__global__ void global_overflow(float* out) { out[threadIdx.x + 1] = 1.0f; }

__global__ void misaligned_vector(const float* in, float* out) {
  const float4 v = *reinterpret_cast<const float4*>(in + 1);  // 4 bytes off 16-byte alignment
  out[threadIdx.x] = v.x;
}

__global__ void __launch_bounds__(128) bounded(float* out) { out[threadIdx.x] = 1.0f; }

__global__ void dynamic_shared(float* out) {
  extern __shared__ float dyn[];
  dyn[threadIdx.x] = 2.0f;
  __syncthreads();
  out[threadIdx.x] = dyn[(threadIdx.x + 1) % blockDim.x];
}

__global__ void same_element(float* out) { out[threadIdx.x] = float(blockIdx.x); }  // blocks race

__global__ void own_element(float* out) { out[blockIdx.x * blockDim.x + threadIdx.x] = float(blockIdx.x); }

// A block reduction called twice, without the barrier that keeps the second call's writes of
// the per-warp results from overtaking other warps' reads of the first call's.
__device__ float block_sum_unsafe(float x) {
  __shared__ float per_warp[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  if (lane == 0) per_warp[warp] = x;  // a __syncthreads belongs before this
  __syncthreads();
  x = lane < warps ? per_warp[lane] : 0.0f;
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

__global__ void reduce_twice(float* out) {
  const float a = block_sum_unsafe(1.0f);
  const float b = block_sum_unsafe(2.0f);
  if (threadIdx.x == 0) out[blockIdx.x] = a + b;
}

__global__ void copy_kernel(const float* in, float* out) { out[threadIdx.x] = in[threadIdx.x]; }

__global__ void trap_kernel(float*) { __trap(); }

// One warp: A (16x16), B given twice, as (n x k) = B^T and as (k x n), all bf16 row-major in
// global memory; cp.async into padded shared tiles, ldmatrix into fragments (A: x4; B^T: x2;
// B: x2 .trans), two mma.sync products, D = A B + 1 written row-major (16x8) twice. `shift`
// elements added to every ldmatrix row address (8 bytes: misaligned); `diverge`: lanes 16-31
// run ldmatrix while lanes 0-15 run mma.
__global__ void tensor_core_product(const __nv_bfloat16* a, const __nv_bfloat16* bt, const __nv_bfloat16* b,
                                    float* d, int shift, bool diverge) {
  __shared__ __align__(16) __nv_bfloat16 a_s[16][24];
  __shared__ __align__(16) __nv_bfloat16 bt_s[8][24];
  __shared__ __align__(16) __nv_bfloat16 b_s[16][16];
  const int lane = threadIdx.x;
  llmtrain::cuda::tc::cp_async_16(&a_s[lane / 2][lane % 2 * 8], a + lane * 8);
  if (lane < 16) llmtrain::cuda::tc::cp_async_16(&bt_s[lane / 2][lane % 2 * 8], bt + lane * 8);
  if (lane < 16) llmtrain::cuda::tc::cp_async_16(&b_s[lane][0], b + lane * 8);
  llmtrain::cuda::tc::cp_async_commit();
  llmtrain::cuda::tc::cp_async_wait<0>();
  __syncthreads();
  std::uint32_t af[4], bf[2], bf_trans[2];
  llmtrain::cuda::tc::ldmatrix<4, false>(af, &a_s[lane % 16][lane / 16 * 8 + shift]);
  llmtrain::cuda::tc::ldmatrix<2, false>(bf, &bt_s[lane % 8][lane / 8 % 2 * 8]);
  llmtrain::cuda::tc::ldmatrix<2, true>(bf_trans, &b_s[lane % 16][0]);
  const float one[4] = {1.0f, 1.0f, 1.0f, 1.0f};
  float d1[4], d2[4];
  if (diverge && lane >= 16) {
    llmtrain::cuda::tc::ldmatrix<2, false>(bf, &bt_s[lane % 8][0]);
  } else {
    llmtrain::cuda::tc::mma_bf16(d1, af, bf[0], bf[1], one);
  }
  llmtrain::cuda::tc::mma_bf16(d2, af, bf_trans[0], bf_trans[1], one);
  const int g = lane / 4, t = lane % 4;
  for (int i = 0; i < 4; ++i) {
    const int at = (g + 8 * (i / 2)) * 8 + 2 * t + i % 2;
    d[at] = d1[i];
    d[128 + at] = d2[i];
  }
}

float* device_floats(int count) {
  void* p = nullptr;
  if (cudaMalloc(&p, count * sizeof(float)) != cudaSuccess) std::abort();
  return static_cast<float*>(p);
}

std::vector<float> to_host(const float* d, int count) {
  std::vector<float> h(count);
  if (cudaMemcpy(h.data(), d, count * sizeof(float), cudaMemcpyDeviceToHost) != cudaSuccess) {
    std::printf("copy back failed\n");
  }
  return h;
}

int result(bool detected, const std::string& what) {
  std::printf("%s: %s\n", detected ? "DETECTED" : "OK", what.c_str());
  return 0;
}

// A launch the emulator must refuse (or a fault it must report): the error code after it.
int expect_error(const char* what) {
  const cudaError_t s = cudaGetLastError(), sync = cudaDeviceSynchronize();
  const cudaError_t e = s != cudaSuccess ? s : sync;
  return result(e != cudaSuccess, std::string(what) + " -> " + cudaGetErrorName(e));
}

int run(const std::string& scenario) {
  float* out = device_floats(n);
  if (scenario == "race_missing_syncthreads") {
    neighbour_read<<<1, n>>>(out, false);
    const auto h = to_host(out, n);
    int nan = 0;
    for (float x : h) nan += std::isnan(x);
    return result(nan > 0, std::to_string(nan) + " threads read shared memory no thread had written yet (NaN)");
  }
  if (scenario == "correct_syncthreads") {
    neighbour_read<<<1, n>>>(out, true);
    const auto h = to_host(out, n);
    for (int i = 0; i < n; ++i) {
      if (h[i] != float((i + 1) % n)) return result(true, "wrong value with the barrier");
    }
    return result(false, "neighbour read after __syncthreads is correct");
  }
  if (scenario == "race_hidden_by_order") {  // run with LLMTRAIN_EMU_SCHEDULE=forward and reverse
    previous_read<<<1, n>>>(out);
    const auto h = to_host(out, n);
    int nan = 0;
    for (float x : h) nan += std::isnan(x);
    return result(nan > 0, std::to_string(nan) + " threads read unwritten shared memory");
  }
  if (scenario == "race_between_blocks") {  // only ThreadSanitizer sees it: blocks run in turn
    same_element<<<2, 32>>>(out);
    const auto h = to_host(out, 32);
    return result(false, "two blocks wrote the same elements; the last one wins here (" + std::to_string(h[0]) + ")");
  }
  if (scenario == "disjoint_blocks") {
    own_element<<<2, 32>>>(out);
    const auto h = to_host(out, 64);
    return result(h[0] != 0.0f || h[63] != 1.0f, "two blocks, one element each");
  }
  if (scenario == "reduce_missing_barrier") {  // 512 threads; hidden by any sequential order
    reduce_twice<<<2, 512>>>(out);
    const auto h = to_host(out, 2);
    return result(h[0] != 1536.0f, "block reduction without its first barrier gives " + std::to_string(h[0]));
  }
  if (scenario == "correct_warp_collectives") {
    warp_sum<<<1, 32>>>(out);
    const auto h = to_host(out, 32);
    for (int i = 0; i < 32; ++i) {
      if (h[i] != 496.0f) return result(true, "lane " + std::to_string(i) + " got " + std::to_string(h[i]));
    }
    return result(false, "xor butterfly, shfl_down and ballot give the expected values");
  }
  if (scenario == "shuffle_after_exit") {
    warp_sum_after_exit<<<1, 32>>>(out);
    return expect_error("full-mask shuffle after half the warp returned");
  }
  if (scenario == "deadlock") {
    divergent_barrier<<<1, 32>>>(out);
    return expect_error("__syncthreads in one half of a warp, a shuffle in the other");
  }
  if (scenario == "mismatched_masks") {
    mismatched_masks<<<1, 32>>>(out);
    return expect_error("lanes of one warp shuffle with different masks");
  }
  if (scenario == "partial_warp_full_mask") {
    warp_sum<<<1, 20>>>(out);
    return expect_error("full-mask shuffle in a block of 20 threads");
  }
  if (scenario == "shared_overflow") {  // AddressSanitizer ends the process
    shared_overflow<<<1, 32>>>(out);
    return expect_error("no report: shared-memory overflow missed");
  }
  if (scenario == "global_overflow") {  // AddressSanitizer ends the process
    global_overflow<<<1, n>>>(out);
    return expect_error("no report: global-memory overflow missed");
  }
  if (scenario == "misaligned_float4") {  // UBSan reports the misaligned load
    misaligned_vector<<<1, 1>>>(out, out + 8);
    return expect_error("misaligned float4 load");
  }
  if (scenario == "launch_bounds") {
    bounded<<<1, 256>>>(out);
    return expect_error("256 threads for __launch_bounds__(128)");
  }
  if (scenario == "dynamic_shared_without_optin") {
    dynamic_shared<<<1, 32, 64 * 1024>>>(out);
    return expect_error("64 KB of dynamic shared memory without cudaFuncSetAttribute");
  }
  if (scenario == "dynamic_shared_with_optin") {
    cudaFuncSetAttribute(dynamic_shared, cudaFuncAttributeMaxDynamicSharedMemorySize, 64 * 1024);
    dynamic_shared<<<1, 32, 64 * 1024>>>(out);
    const cudaError_t e = cudaGetLastError();
    const auto h = to_host(out, 32);
    return result(e != cudaSuccess || h[0] != 2.0f, std::string("64 KB with the opt-in: ") + cudaGetErrorName(e));
  }
  if (scenario == "block_too_large") {
    bounded<<<1, 2048>>>(out);
    return expect_error("2048 threads per block");
  }
  if (scenario == "host_pointer_argument") {
    std::vector<float> host(n);
    copy_kernel<<<1, n>>>(host.data(), out);
    return expect_error("a host pointer as a kernel argument");
  }
  if (scenario == "memcpy_wrong_direction") {
    float* other = device_floats(n);
    const cudaError_t e = cudaMemcpy(other, out, n * sizeof(float), cudaMemcpyHostToDevice);
    return result(e != cudaSuccess, std::string("HostToDevice copy from device memory -> ") + cudaGetErrorName(e));
  }
  if (scenario == "uninitialised_device_memory") {
    float* fresh = device_floats(n);
    copy_kernel<<<1, n>>>(fresh, out);
    const auto h = to_host(out, n);
    return result(std::isnan(h[0]), "cudaMalloc'ed memory reads as NaN until written");
  }
  if (scenario == "trap") {
    trap_kernel<<<1, 1>>>(out);
    const cudaError_t e = cudaGetLastError();
    const cudaError_t later = cudaMemset(out, 0, 4);  // device faults are sticky
    return result(e != cudaSuccess && later != cudaSuccess,
                  std::string("__trap() -> ") + cudaGetErrorName(e) + ", then cudaMemset -> " + cudaGetErrorName(later));
  }
  if (scenario == "cublaslt_misaligned_pointer") {
    cublasLtHandle_t handle;
    cublasLtCreate(&handle);
    cublasLtMatmulDesc_t desc;
    cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    cublasLtMatrixLayout_t a, b, d;
    cublasLtMatrixLayoutCreate(&a, CUDA_R_32F, 4, 4, 4);
    cublasLtMatrixLayoutCreate(&b, CUDA_R_32F, 4, 4, 4);
    cublasLtMatrixLayoutCreate(&d, CUDA_R_32F, 4, 4, 4);
    cublasLtMatmulPreference_t pref;
    cublasLtMatmulPreferenceCreate(&pref);  // default: 256-byte aligned pointers promised
    cublasLtMatmulHeuristicResult_t heuristic;
    int found = 0;
    cublasLtMatmulAlgoGetHeuristic(handle, desc, a, b, d, d, pref, 1, &heuristic, &found);
    const float alpha = 1.0f, beta = 0.0f;
    const cublasStatus_t s = cublasLtMatmul(handle, desc, &alpha, out + 1, a, out + 20, b, &beta, out + 40, d, out + 40,
                                            d, &heuristic.algo, nullptr, 0, nullptr);
    return result(s != CUBLAS_STATUS_SUCCESS, std::string("matmul on pointers less aligned than the heuristic was told -> ") +
                                                  cublasLtGetStatusName(s));
  }
  if (scenario == "cublaslt_gemm") {
    // D (2x3) = A (2x4) B (4x3) + bias, column-major, against a direct computation.
    std::vector<float> host(n);
    for (int i = 0; i < n; ++i) host[i] = float(i % 7) - 3.0f;
    cudaMemcpy(out, host.data(), n * sizeof(float), cudaMemcpyHostToDevice);
    float* dd = device_floats(6);
    cublasLtHandle_t handle;
    cublasLtCreate(&handle);
    cublasLtMatmulDesc_t desc;
    cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    const cublasOperation_t t = CUBLAS_OP_T;
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof t);
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof epilogue);
    const float* bias = out + 32;
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias);
    cublasLtMatrixLayout_t a, b, d;
    cublasLtMatrixLayoutCreate(&a, CUDA_R_32F, 4, 2, 5);  // stored 4x2 (ld 5): op(A) = A^T is 2x4
    cublasLtMatrixLayoutCreate(&b, CUDA_R_32F, 4, 3, 4);
    cublasLtMatrixLayoutCreate(&d, CUDA_R_32F, 2, 3, 2);
    const float alpha = 2.0f, beta = 0.0f;
    const cublasStatus_t s = cublasLtMatmul(handle, desc, &alpha, out, a, out + 16, b, &beta, dd, d, dd, d, nullptr,
                                            nullptr, 0, nullptr);
    const auto got = to_host(dd, 6);
    double worst = 0.0;
    for (int j = 0; j < 3; ++j) {
      for (int i = 0; i < 2; ++i) {
        double want = host[32 + i];
        for (int k = 0; k < 4; ++k) want += 2.0 * host[k + i * 5] * host[16 + k + j * 4];
        worst = std::max(worst, std::abs(want - got[i + j * 2]));
      }
    }
    return result(s != CUBLAS_STATUS_SUCCESS || worst > 1e-5,
                  std::string("transposed GEMM with bias and alpha, ") + cublasLtGetStatusName(s) + ", max error " +
                      std::to_string(worst));
  }
  if (scenario == "tensor_core_product" || scenario == "ldmatrix_misaligned" || scenario == "matrix_divergent") {
    // Small integers over 8: exact in bf16, products and sums exact in fp32.
    std::vector<__nv_bfloat16> a(256), bt(128), b(128);
    std::vector<double> A(256), B(128);
    for (int i = 0; i < 256; ++i) A[i] = double((i * 7) % 11 - 5) / 8.0;
    for (int k = 0; k < 16; ++k) {
      for (int j = 0; j < 8; ++j) B[k * 8 + j] = double((k * 3 + j * 5) % 9 - 4) / 4.0;
    }
    for (int i = 0; i < 256; ++i) a[i] = __nv_bfloat16(float(A[i]));
    for (int k = 0; k < 16; ++k) {
      for (int j = 0; j < 8; ++j) {
        b[k * 8 + j] = __nv_bfloat16(float(B[k * 8 + j]));
        bt[j * 16 + k] = b[k * 8 + j];
      }
    }
    void *da = nullptr, *dbt = nullptr, *db = nullptr;
    cudaMalloc(&da, 512);
    cudaMalloc(&dbt, 256);
    cudaMalloc(&db, 256);
    cudaMemcpy(da, a.data(), 512, cudaMemcpyHostToDevice);
    cudaMemcpy(dbt, bt.data(), 256, cudaMemcpyHostToDevice);
    cudaMemcpy(db, b.data(), 256, cudaMemcpyHostToDevice);
    float* dd = device_floats(256);
    const auto* ca = static_cast<const __nv_bfloat16*>(da);
    const auto* cbt = static_cast<const __nv_bfloat16*>(dbt);
    const auto* cb = static_cast<const __nv_bfloat16*>(db);
    if (scenario == "ldmatrix_misaligned") {
      tensor_core_product<<<1, 32>>>(ca, cbt, cb, dd, 4, false);
      return expect_error("ldmatrix with rows 8 bytes off 16-byte alignment");
    }
    if (scenario == "matrix_divergent") {
      tensor_core_product<<<1, 32>>>(ca, cbt, cb, dd, 0, true);
      return expect_error("half a warp in mma.sync, the other half in ldmatrix");
    }
    tensor_core_product<<<1, 32>>>(ca, cbt, cb, dd, 0, false);
    const auto got = to_host(dd, 256);
    double worst = 0.0;
    for (int i = 0; i < 16; ++i) {
      for (int j = 0; j < 8; ++j) {
        double want = 1.0;
        for (int k = 0; k < 16; ++k) want += A[i * 16 + k] * B[k * 8 + j];
        worst = std::max({worst, std::abs(want - got[i * 8 + j]), std::abs(want - got[128 + i * 8 + j])});
      }
    }
    return result(!(worst == 0.0), "mma.sync m16n8k16 bf16 from ldmatrix x4, x2 and x2.trans fragments and "
                                   "cp.async tiles against a plain loop, max error " + std::to_string(worst));
  }
  std::printf("unknown scenario %s\n", scenario.c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  const char* scenarios =
      "race_missing_syncthreads correct_syncthreads race_hidden_by_order race_between_blocks disjoint_blocks "
      "reduce_missing_barrier "
      "correct_warp_collectives "
      "shuffle_after_exit deadlock mismatched_masks partial_warp_full_mask shared_overflow global_overflow "
      "misaligned_float4 launch_bounds dynamic_shared_without_optin dynamic_shared_with_optin block_too_large "
      "host_pointer_argument memcpy_wrong_direction uninitialised_device_memory trap cublaslt_misaligned_pointer "
      "cublaslt_gemm tensor_core_product ldmatrix_misaligned matrix_divergent";
  if (argc != 2 || std::strcmp(argv[1], "list") == 0) {
    std::printf("%s\n", scenarios);
    return argc == 2 ? 0 : 2;
  }
  return run(argv[1]);
}
