// The NCCL shim (include/nccl.h): N ranks that hold the same data, in one process; a
// non-blocking communicator defers each call's work until it has been polled enough.
#include <nccl.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

struct llmtrain_emu_nccl_comm {
  int nranks = 1, rank = 0;
  bool blocking = true;
  int polls_left = 0;           // polls of ncclCommGetAsyncError before `pending` runs
  std::function<void()> pending;
};

namespace {

int polls_per_call() {
  const char* text = std::getenv("LLMTRAIN_EMU_NCCL_POLLS");
  return text ? std::atoi(text) : 3;
}

size_t type_size(ncclDataType_t type) { return type == ncclFloat ? 4 : type == ncclBfloat16 ? 2 : 8; }

template <typename T>
void reduce(const void* send, void* recv, size_t count, size_t offset, ncclRedOp_t op, int nranks) {
  std::vector<T> in(static_cast<const T*>(send) + offset, static_cast<const T*>(send) + offset + count);
  for (size_t i = 0; i < count; ++i) static_cast<T*>(recv)[i] = op == ncclSum ? T(in[i] * T(nranks)) : in[i];
}

void reduce_any(const void* send, void* recv, size_t count, size_t offset, ncclDataType_t type, ncclRedOp_t op, int n) {
  if (type == ncclFloat) reduce<float>(send, recv, count, offset, op, n);
  else if (type == ncclDouble) reduce<double>(send, recv, count, offset, op, n);
  else reduce<std::int64_t>(send, recv, count, offset, op, n);
}

// Runs `work` now (blocking) or after the polls (non-blocking).
ncclResult_t submit(ncclComm_t comm, std::function<void()> work) {
  if (!comm) return ncclInvalidArgument;
  if (comm->pending) return ncclInvalidUsage;  // the previous call has not left ncclInProgress
  if (comm->blocking) {
    work();
    return ncclSuccess;
  }
  comm->pending = std::move(work);
  comm->polls_left = polls_per_call();
  return ncclInProgress;
}

}  // namespace

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  std::memset(id, 0, sizeof *id);
  return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId, int rank, ncclConfig_t* config) {
  if (nranks < 1 || rank < 0 || rank >= nranks) return ncclInvalidArgument;
  *comm = new llmtrain_emu_nccl_comm{nranks, rank, !config || config->blocking != 0, 0, {}};
  return submit(*comm, [] {});
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* state) {
  if (!comm) return ncclInvalidArgument;
  if (comm->pending && --comm->polls_left <= 0) {
    comm->pending();
    comm->pending = nullptr;
  }
  *state = comm->pending ? ncclInProgress : ncclSuccess;
  return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  delete comm;
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) { return ncclCommDestroy(comm); }

ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, ncclDataType_t type, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t) {
  const int n = comm ? comm->nranks : 1;
  return submit(comm, [=] { reduce_any(send, recv, count, 0, type, op, n); });
}

ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t recv_count, ncclDataType_t type, ncclRedOp_t op,
                               ncclComm_t comm, cudaStream_t) {
  if (!comm) return ncclInvalidArgument;
  const int n = comm->nranks, rank = comm->rank;
  return submit(comm, [=] { reduce_any(send, recv, recv_count, size_t(rank) * recv_count, type, op, n); });
}

ncclResult_t ncclAllGather(const void* send, void* recv, size_t send_count, ncclDataType_t type, ncclComm_t comm,
                           cudaStream_t) {
  if (!comm) return ncclInvalidArgument;
  const int n = comm->nranks;
  return submit(comm, [=] {
    const size_t bytes = send_count * type_size(type);
    std::vector<char> in(static_cast<const char*>(send), static_cast<const char*>(send) + bytes);
    for (int r = 0; r < n; ++r) std::memcpy(static_cast<char*>(recv) + r * bytes, in.data(), bytes);
  });
}

ncclResult_t ncclBroadcast(const void* send, void* recv, size_t count, ncclDataType_t type, int, ncclComm_t comm,
                           cudaStream_t) {
  return submit(comm, [=] { std::memmove(recv, send, count * type_size(type)); });
}
