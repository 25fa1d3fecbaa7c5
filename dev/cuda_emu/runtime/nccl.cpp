// The NCCL shim (include/nccl.h): N ranks that hold the same data, in one process; a
// non-blocking communicator defers each call's work until it has been polled enough. A call's
// work checks and matches at once, but its data moves on the call's stream, held there until
// something is ordered after it (llmtrain_emu::hold): a reader that skips the wait for it reads
// the buffer as it was, as it may on a GPU.
#include <nccl.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "internal.h"
#include "llmtrain_emu/nccl_control.h"

namespace {

// A call's work, run when the call completes; its status is the call's (blocking) or the
// communicator's asynchronous error (non-blocking).
using Work = std::function<ncclResult_t()>;

// A send kept until a recv takes it: to rank + offset; its bytes are copied when the send's data
// moves on its stream (before the matching recv's, which comes after it there).
struct Message {
  int offset;
  ncclDataType_t type;
  size_t count;
  std::shared_ptr<std::vector<char>> bytes;
};

}  // namespace

struct llmtrain_emu_nccl_comm {
  int nranks = 1, rank = 0;
  bool blocking = true;
  int polls_left = 0;  // polls of ncclCommGetAsyncError before `pending` runs
  Work pending;
  ncclResult_t async_error = ncclSuccess;  // of the last call that completed
  std::deque<Message> sent;                // sends no recv has taken yet, oldest first
};

namespace {

// Calls made, by name (llmtrain_emu::nccl_calls).
std::map<std::string, std::int64_t>& call_counts() {
  static std::map<std::string, std::int64_t> counts;
  return counts;
}
void counted(const char* name) { call_counts()[name] += 1; }

int polls_per_call() {
  const char* text = std::getenv("LLMTRAIN_EMU_NCCL_POLLS");
  return text ? std::atoi(text) : 3;
}

size_t type_size(ncclDataType_t type) {
  return type == ncclFloat || type == ncclInt32 ? 4 : type == ncclBfloat16 ? 2 : 8;
}

template <typename T>
void reduce(const void* send, void* recv, size_t count, size_t offset, ncclRedOp_t op, int nranks) {
  std::vector<T> in(static_cast<const T*>(send) + offset, static_cast<const T*>(send) + offset + count);
  for (size_t i = 0; i < count; ++i) static_cast<T*>(recv)[i] = op == ncclSum ? T(in[i] * T(nranks)) : in[i];
}

// bf16 words: the sum of n equal values, in float, rounded to the nearest bf16 (ties to even), as
// NCCL's bf16 reductions round each step.
void reduce_bf16(const void* send, void* recv, size_t count, size_t offset, ncclRedOp_t op, int nranks) {
  std::vector<std::uint16_t> in(static_cast<const std::uint16_t*>(send) + offset,
                                static_cast<const std::uint16_t*>(send) + offset + count);
  for (size_t i = 0; i < count; ++i) {
    std::uint32_t bits = std::uint32_t(in[i]) << 16;
    float value = 0;
    std::memcpy(&value, &bits, 4);
    if (op == ncclSum) value *= float(nranks);
    std::memcpy(&bits, &value, 4);
    bits += 0x7fff + ((bits >> 16) & 1);
    static_cast<std::uint16_t*>(recv)[i] = std::uint16_t(bits >> 16);
  }
}

void reduce_any(const void* send, void* recv, size_t count, size_t offset, ncclDataType_t type, ncclRedOp_t op, int n) {
  if (type == ncclBfloat16) reduce_bf16(send, recv, count, offset, op, n);
  else if (type == ncclFloat) reduce<float>(send, recv, count, offset, op, n);
  else if (type == ncclDouble) reduce<double>(send, recv, count, offset, op, n);
  else if (type == ncclInt32) reduce<std::int32_t>(send, recv, count, offset, op, n);
  else reduce<std::int64_t>(send, recv, count, offset, op, n);
}

// Between ncclGroupStart and its ncclGroupEnd (nested: counted), the transfers queued so far.
struct Grouped {
  ncclComm_t comm;
  bool is_send;
  Work work;
};
thread_local int group_depth = 0;
thread_local std::vector<Grouped> grouped;

// Runs `work` now (blocking) or after the polls (non-blocking).
ncclResult_t submit(ncclComm_t comm, Work work) {
  if (!comm) return ncclInvalidArgument;
  if (comm->pending) return ncclInvalidUsage;  // the previous call has not left ncclInProgress
  if (group_depth > 0) {
    llmtrain_emu::report("NCCL shim: only ncclSend and ncclRecv are emulated inside a group");
    return ncclInvalidUsage;
  }
  if (comm->blocking) return comm->async_error = work();
  comm->pending = std::move(work);
  comm->polls_left = polls_per_call();
  return ncclInProgress;
}

// A transfer: queued inside a group, else submitted as a call of its own.
ncclResult_t transfer(ncclComm_t comm, bool is_send, Work work) {
  if (group_depth == 0) return submit(comm, std::move(work));
  grouped.push_back({comm, is_send, std::move(work)});
  return ncclSuccess;
}

// ncclSend's and ncclRecv's checks: the peer a rank of the communicator, the buffer device memory.
ncclResult_t check_transfer(ncclComm_t comm, int peer, const void* buffer, size_t count, ncclDataType_t type,
                            const char* call) {
  if (!comm) return ncclInvalidArgument;
  if (peer < 0 || peer >= comm->nranks) {
    llmtrain_emu::report(std::string(call) + ": peer " + std::to_string(peer) + " is not a rank of a communicator of " +
                         std::to_string(comm->nranks));
    return ncclInvalidArgument;
  }
  if (!llmtrain_emu::check_device_range(buffer, count * type_size(type), call)) return ncclInvalidArgument;
  return ncclSuccess;
}

}  // namespace

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  std::memset(id, 0, sizeof *id);
  return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId, int rank, ncclConfig_t* config) {
  if (nranks < 1 || rank < 0 || rank >= nranks) return ncclInvalidArgument;
  *comm = new llmtrain_emu_nccl_comm{nranks, rank, !config || config->blocking != 0, 0, {}};
  return submit(*comm, [] { return ncclSuccess; });
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* state) {
  if (!comm) return ncclInvalidArgument;
  if (comm->pending && --comm->polls_left <= 0) {
    comm->async_error = comm->pending();
    comm->pending = nullptr;
  }
  *state = comm->pending ? ncclInProgress : comm->async_error;
  return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  delete comm;
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) { return ncclCommDestroy(comm); }

ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, ncclDataType_t type, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t stream) {
  counted("ncclAllReduce");
  const int n = comm ? comm->nranks : 1;
  return submit(comm, [=] {
    llmtrain_emu::hold(stream, [=] { reduce_any(send, recv, count, 0, type, op, n); });
    return ncclSuccess;
  });
}

ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t recv_count, ncclDataType_t type, ncclRedOp_t op,
                               ncclComm_t comm, cudaStream_t stream) {
  counted("ncclReduceScatter");
  if (!comm) return ncclInvalidArgument;
  const int n = comm->nranks, rank = comm->rank;
  return submit(comm, [=] {
    llmtrain_emu::hold(stream, [=] { reduce_any(send, recv, recv_count, size_t(rank) * recv_count, type, op, n); });
    return ncclSuccess;
  });
}

ncclResult_t ncclAllGather(const void* send, void* recv, size_t send_count, ncclDataType_t type, ncclComm_t comm,
                           cudaStream_t stream) {
  counted("ncclAllGather");
  if (!comm) return ncclInvalidArgument;
  const int n = comm->nranks;
  return submit(comm, [=] {
    llmtrain_emu::hold(stream, [=] {
      const size_t bytes = send_count * type_size(type);
      std::vector<char> in(static_cast<const char*>(send), static_cast<const char*>(send) + bytes);
      for (int r = 0; r < n; ++r) std::memcpy(static_cast<char*>(recv) + r * bytes, in.data(), bytes);
    });
    return ncclSuccess;
  });
}

ncclResult_t ncclBroadcast(const void* send, void* recv, size_t count, ncclDataType_t type, int, ncclComm_t comm,
                           cudaStream_t stream) {
  counted("ncclBroadcast");
  return submit(comm, [=] {
    llmtrain_emu::hold(stream, [=] { std::memmove(recv, send, count * type_size(type)); });
    return ncclSuccess;
  });
}

ncclResult_t ncclSend(const void* send, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  counted("ncclSend");
  if (const ncclResult_t bad = check_transfer(comm, peer, send, count, type, "ncclSend")) return bad;
  return transfer(comm, true, [=] {
    const int offset = (peer - comm->rank + comm->nranks) % comm->nranks;
    auto bytes = std::make_shared<std::vector<char>>(count * type_size(type));
    comm->sent.push_back({offset, type, count, bytes});
    llmtrain_emu::hold(stream, [=] { std::memcpy(bytes->data(), send, bytes->size()); });
    return ncclSuccess;
  });
}

ncclResult_t ncclRecv(void* recv, size_t count, ncclDataType_t type, int peer, ncclComm_t comm, cudaStream_t stream) {
  counted("ncclRecv");
  if (const ncclResult_t bad = check_transfer(comm, peer, recv, count, type, "ncclRecv")) return bad;
  return transfer(comm, false, [=] {
    // Rank `peer` runs this program too: what it sends to this rank is what this process sends
    // to the rank as far beyond itself as this rank is beyond `peer`.
    const int offset = (comm->rank - peer + comm->nranks) % comm->nranks;
    const std::string what = "ncclRecv of " + std::to_string(count) + " elements from rank " + std::to_string(peer);
    for (auto it = comm->sent.begin(); it != comm->sent.end(); ++it) {
      if (it->offset != offset) continue;
      if (it->count != count || it->type != type) {
        llmtrain_emu::report(what + " (type " + std::to_string(int(type)) + "): its matching send has " +
                             std::to_string(it->count) + " elements of type " + std::to_string(int(it->type)));
        return ncclInvalidUsage;
      }
      const std::shared_ptr<std::vector<char>> bytes = it->bytes;
      comm->sent.erase(it);
      llmtrain_emu::hold(stream, [=] { std::memcpy(recv, bytes->data(), bytes->size()); });
      return ncclSuccess;
    }
    llmtrain_emu::report(what + ": no matching send was started before it or in its group (" +
                         std::to_string(comm->nranks) + " ranks running this program would wait for ever)");
    return ncclInvalidUsage;
  });
}

ncclResult_t ncclGroupStart() {
  ++group_depth;
  return ncclSuccess;
}

// Each communicator's queued transfers become one call: its sends, then its recvs.
ncclResult_t ncclGroupEnd() {
  if (group_depth == 0) return ncclInvalidUsage;
  if (--group_depth > 0) return ncclSuccess;
  std::vector<Grouped> calls = std::move(grouped);
  grouped.clear();
  ncclResult_t result = ncclSuccess;
  for (size_t i = 0; i < calls.size(); ++i) {
    const ncclComm_t comm = calls[i].comm;
    if (!comm) continue;  // taken with an earlier call of the same communicator
    std::vector<Work> sends, recvs;
    for (size_t j = i; j < calls.size(); ++j) {
      if (calls[j].comm != comm) continue;
      (calls[j].is_send ? sends : recvs).push_back(std::move(calls[j].work));
      calls[j].comm = nullptr;
    }
    const ncclResult_t status = submit(comm, [sends, recvs] {
      for (const auto* part : {&sends, &recvs}) {
        for (const Work& work : *part) {
          if (const ncclResult_t bad = work()) return bad;
        }
      }
      return ncclSuccess;
    });
    if (status != ncclSuccess && (result == ncclSuccess || result == ncclInProgress)) result = status;
  }
  return result;
}

std::int64_t llmtrain_emu::nccl_calls(const char* name) {
  const auto it = call_counts().find(name);
  return it == call_counts().end() ? 0 : it->second;
}
