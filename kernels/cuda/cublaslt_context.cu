// The cuBLASLt handle and workspace that callers make for the matmuls (cuda::Blas).
#include "cublaslt_context.h"
#include "cuda_check.h"
#include "llmtrain/kernels/cuda.h"

namespace llmtrain::cuda {

Blas create_blas(std::size_t workspace_bytes) {
  Blas blas;
  LLMTRAIN_CUBLAS_CHECK(cublasLtCreate(&blas.handle));
  if (workspace_bytes > 0) {
    const cudaError_t status = cudaMalloc(&blas.workspace, workspace_bytes);
    if (status != cudaSuccess) {
      cublasLtDestroy(blas.handle);
      throw_cuda_error(status, "cudaMalloc(matmul workspace)", __FILE__, __LINE__);
    }
  }
  blas.workspace_bytes = workspace_bytes;
  return blas;
}

void destroy_blas(const Blas& blas) {
  if (blas.workspace) LLMTRAIN_CUDA_CHECK(cudaFree(blas.workspace));
  if (blas.handle) LLMTRAIN_CUBLAS_CHECK(cublasLtDestroy(blas.handle));
}

}  // namespace llmtrain::cuda
