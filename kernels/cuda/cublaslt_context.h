// The process's cuBLASLt handle and matmul workspace, and the cuBLAS status check. Kernel code
// only (it has cuBLASLt types).
#pragma once

#include <cublasLt.h>

#include <atomic>
#include <cstddef>
#include <string>

#include "llmtrain/kernels/error.h"

namespace llmtrain::cuda {

[[noreturn]] inline void throw_cublas_error(cublasStatus_t status, const char* call, const char* file,
                                            int line) {
  throw kernels::Error(std::string("cuBLAS error: ") + cublasLtGetStatusString(status) + " in " + call +
                     " at " + file + ":" + std::to_string(line));
}

/// One handle and one workspace per process, made on first use on the current device. The
/// workspace is shared by every matmul, so matmuls must run on one stream (the compute stream)
/// or be otherwise ordered. Never destroyed: the driver reclaims both at exit, and destroying
/// them from a static destructor can run after the CUDA runtime has shut down.
class CublasLtContext {
 public:
  static CublasLtContext& get();

  cublasLtHandle_t handle() const { return handle_; }
  void* workspace() const { return workspace_; }
  std::size_t workspace_bytes() const { return workspace_bytes_; }
  bool allow_tf32() const { return allow_tf32_.load(std::memory_order_relaxed); }
  void set_allow_tf32(bool allow) { allow_tf32_.store(allow, std::memory_order_relaxed); }

  CublasLtContext(const CublasLtContext&) = delete;
  CublasLtContext& operator=(const CublasLtContext&) = delete;

 private:
  CublasLtContext();

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  std::size_t workspace_bytes_ = 0;
  std::atomic<bool> allow_tf32_{false};
};

}  // namespace llmtrain::cuda

#define LLMTRAIN_CUBLAS_CHECK(call)                                                      \
  do {                                                                                   \
    const cublasStatus_t llmtrain_status_ = (call);                                      \
    if (llmtrain_status_ != CUBLAS_STATUS_SUCCESS) {                                     \
      ::llmtrain::cuda::throw_cublas_error(llmtrain_status_, #call, __FILE__, __LINE__); \
    }                                                                                    \
  } while (0)
