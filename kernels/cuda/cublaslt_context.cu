#include "cublaslt_context.h"
#include "cuda_check.h"

namespace llmtrain::cuda {

// 32 MiB: what NVIDIA recommends for cuBLASLt on Hopper (4 MiB would do before it); the large
// split-K and stream-K algorithms need it.
constexpr std::size_t matmul_workspace_bytes = std::size_t(32) << 20;

CublasLtContext::CublasLtContext() {
  LLMTRAIN_CUBLAS_CHECK(cublasLtCreate(&handle_));
  LLMTRAIN_CUDA_CHECK(cudaMalloc(&workspace_, matmul_workspace_bytes));
  workspace_bytes_ = matmul_workspace_bytes;
}

CublasLtContext& CublasLtContext::get() {
  static CublasLtContext* const context = new CublasLtContext();  // never deleted: see the header
  return *context;
}

}  // namespace llmtrain::cuda
