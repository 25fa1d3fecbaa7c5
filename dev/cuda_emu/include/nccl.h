// NCCL for the CPU emulation: only what src/ops/cuda/runtime.cu asks (the version). The NCCL
// communicator (src/dist) is not part of the emulated build.
#pragma once

typedef enum {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
} ncclResult_t;

#define NCCL_MAJOR 2
#define NCCL_MINOR 0
#define NCCL_PATCH 0

/// 0: the emulation has no NCCL ("0.0.0").
ncclResult_t ncclGetVersion(int* version);
const char* ncclGetErrorString(ncclResult_t result);
