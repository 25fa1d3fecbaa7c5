// NCCL for the CPU emulation: the version (src/device/runtime.cpp) and what the NCCL
// communicator (src/dist/nccl_communicator.cpp) calls, in one process. A communicator of N ranks
// stands for N ranks that all hold this process's data (so a sum is N times it). A non-blocking
// communicator (config.blocking = 0) returns ncclInProgress from every call and does the work
// only when ncclCommGetAsyncError has been polled LLMTRAIN_EMU_NCCL_POLLS times (default 3):
// reading the result earlier shows the data unreduced, as a GPU could. A call made while the
// previous one is still in progress fails with ncclInvalidUsage, as NCCL asks.
//
// Point-to-point (ncclSend, ncclRecv): the N ranks are taken to run this same program, each on its
// own rank, so rank q's send to q + d carries what this process sends to rank + d. A send is kept
// (its bytes copied when its work runs); a recv from q takes the oldest kept send to rank +
// (rank - q), the one rank q makes to this rank, and fails (ncclInvalidUsage, through
// ncclCommGetAsyncError on a non-blocking communicator, with a line on stderr) when there is none
// (N ranks would wait for ever) or when its count or type differ. Both buffers must be device
// memory (ncclInvalidArgument otherwise). Inside ncclGroupStart/ncclGroupEnd the calls only queue
// and return ncclSuccess; ncclGroupEnd submits each communicator's queued calls as one call (its
// sends before its recvs, as NCCL lets a group's transfers progress together). The shim does not
// see the ordering deadlocks of separate, ungrouped calls on real ranks.
#pragma once

#include <cstddef>

#include "cuda_runtime_api.h"

typedef enum {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7,
} ncclResult_t;

#define NCCL_MAJOR 2
#define NCCL_MINOR 0
#define NCCL_PATCH 0

typedef struct llmtrain_emu_nccl_comm* ncclComm_t;
typedef struct { char internal[128]; } ncclUniqueId;
typedef enum { ncclInt32 = 2, ncclInt64 = 4, ncclFloat = 7, ncclDouble = 8, ncclBfloat16 = 9 } ncclDataType_t;
typedef enum { ncclSum = 0, ncclMax = 3 } ncclRedOp_t;
typedef struct {
  int blocking;
} ncclConfig_t;
#define NCCL_CONFIG_INITIALIZER {1}

/// 0: the emulation has no real NCCL ("0.0.0").
ncclResult_t ncclGetVersion(int* version);
const char* ncclGetErrorString(ncclResult_t result);
ncclResult_t ncclGetUniqueId(ncclUniqueId* id);
ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank, ncclConfig_t* config);
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* state);
ncclResult_t ncclCommDestroy(ncclComm_t comm);
ncclResult_t ncclCommAbort(ncclComm_t comm);
ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, ncclDataType_t type, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t recv_count, ncclDataType_t type, ncclRedOp_t op,
                               ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclAllGather(const void* send, void* recv, size_t send_count, ncclDataType_t type, ncclComm_t comm,
                           cudaStream_t stream);
ncclResult_t ncclBroadcast(const void* send, void* recv, size_t count, ncclDataType_t type, int root, ncclComm_t comm,
                           cudaStream_t stream);
ncclResult_t ncclSend(const void* send, size_t count, ncclDataType_t type, int peer, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclRecv(void* recv, size_t count, ncclDataType_t type, int peer, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclGroupStart();
ncclResult_t ncclGroupEnd();
