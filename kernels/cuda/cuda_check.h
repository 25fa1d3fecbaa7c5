// Every CUDA runtime call goes through LLMTRAIN_CUDA_CHECK, which names the call, file and line.
#pragma once

#include <string>

#include <cuda_runtime_api.h>

#include "llmtrain/kernels/error.h"

namespace llmtrain::cuda {

[[noreturn]] inline void throw_cuda_error(cudaError_t status, const char* call, const char* file, int line) {
  throw kernels::Error(std::string("CUDA error: ") + cudaGetErrorString(status) + " in " + call + " at " +
                     file + ":" + std::to_string(line));
}

}  // namespace llmtrain::cuda

#define LLMTRAIN_CUDA_CHECK(call)                                                     \
  do {                                                                                \
    const cudaError_t llmtrain_status_ = (call);                                      \
    if (llmtrain_status_ != cudaSuccess) {                                            \
      ::llmtrain::cuda::throw_cuda_error(llmtrain_status_, #call, __FILE__, __LINE__); \
    }                                                                                 \
  } while (0)
