// Test hook of the NCCL shim (runtime/nccl.cpp): how many times a call has been made in this
// process, so that a test can see a collective made in pieces.
#pragma once

#include <cstdint>

namespace llmtrain_emu {

/// Calls so far of `name` ("ncclAllReduce", "ncclReduceScatter", "ncclAllGather", "ncclBroadcast",
/// "ncclSend", "ncclRecv"), each counted when made, whatever it returned.
std::int64_t nccl_calls(const char* name);

}  // namespace llmtrain_emu
