// Every CUDA runtime call of the device layer goes through LLMTRAIN_DEVICE_CHECK, which names the
// call, file and line. (The kernel library has its own LLMTRAIN_DEVICE_CHECK, throwing its own error.)
#pragma once

#include <string>

#include <cuda_runtime_api.h>

#include "core/error.h"

namespace llmtrain::device {

[[noreturn]] inline void throw_cuda_error(cudaError_t status, const char* call, const char* file, int line) {
  throw RuntimeError(std::string("CUDA error: ") + cudaGetErrorString(status) + " in " + call + " at " +
                     file + ":" + std::to_string(line));
}

}  // namespace llmtrain::device

#define LLMTRAIN_DEVICE_CHECK(call)                                                     \
  do {                                                                                  \
    const cudaError_t llmtrain_status_ = (call);                                        \
    if (llmtrain_status_ != cudaSuccess) {                                              \
      ::llmtrain::device::throw_cuda_error(llmtrain_status_, #call, __FILE__, __LINE__); \
    }                                                                                   \
  } while (0)
