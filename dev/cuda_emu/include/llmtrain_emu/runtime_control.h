// Test hook of the emulated CUDA runtime (runtime/runtime.cpp): how many times the calls with which
// the host waits for the device or orders streams were made in this process, so that a test can
// see whether a step waited on the host (synchronize, query) or only ordered streams (wait event).
#pragma once

#include <cstdint>

namespace llmtrain_emu {

/// Calls so far of `name`: "cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaStreamQuery",
/// "cudaEventSynchronize", "cudaEventQuery" or "cudaStreamWaitEvent".
std::int64_t runtime_calls(const char* name);
/// Counts one call of `name` (the runtime's own bookkeeping).
void count_runtime_call(const char* name);

}  // namespace llmtrain_emu
