// The cuBLAS status check. Kernel code only (it has cuBLASLt types). The handle and workspace a
// matmul runs with come from its caller (cuda::Blas, llmtrain/kernels/cuda.h).
#pragma once

#include <cublasLt.h>

#include <string>

#include "llmtrain/kernels/error.h"

namespace llmtrain::cuda {

[[noreturn]] inline void throw_cublas_error(cublasStatus_t status, const char* call, const char* file,
                                            int line) {
  throw kernels::Error(std::string("cuBLAS error: ") + cublasLtGetStatusString(status) + " in " + call +
                     " at " + file + ":" + std::to_string(line));
}

}  // namespace llmtrain::cuda

#define LLMTRAIN_CUBLAS_CHECK(call)                                                      \
  do {                                                                                   \
    const cublasStatus_t llmtrain_status_ = (call);                                      \
    if (llmtrain_status_ != CUBLAS_STATUS_SUCCESS) {                                     \
      ::llmtrain::cuda::throw_cublas_error(llmtrain_status_, #call, __FILE__, __LINE__); \
    }                                                                                    \
  } while (0)
