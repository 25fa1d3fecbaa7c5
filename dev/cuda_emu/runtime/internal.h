// State shared by the emulator's runtime files: the device-memory registry, the error state,
// per-kernel attributes and the settings read from the environment.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "cuda_runtime_api.h"

namespace llmtrain_emu {

// ---- settings (environment variables, read once) ------------------------------------------------
struct Settings {
  int workers = 1;                         // LLMTRAIN_EMU_WORKERS: OS threads running blocks
  int schedule = 0;                        // LLMTRAIN_EMU_SCHEDULE: 0 forward, 1 reverse, 2 random
  std::size_t max_shared_optin = 232448;   // LLMTRAIN_EMU_MAX_SHARED_KB (default 227 KB, sm_90)
  bool verbose = false;                    // LLMTRAIN_EMU_VERBOSE=1: one line per launch
};
const Settings& settings();

/// One line on stderr, prefixed "llmtrain_emu: ".
void report(const std::string& message);

// ---- errors --------------------------------------------------------------------------------------
/// Sets the calling thread's last error (returned and cleared by cudaGetLastError).
void set_last_error(cudaError_t status);
/// A device-side fault: sticky, every later runtime call fails with it (as on a GPU).
void set_sticky_error(cudaError_t status);
cudaError_t sticky_error();

// ---- device memory ----------------------------------------------------------------------------------
/// True when [pointer, pointer + bytes) lies inside one live device allocation (bytes may be 0:
/// then pointer may also be its end).
bool is_device_range(const void* pointer, std::size_t bytes);
/// False (after printing why) unless [pointer, pointer + bytes) lies in one device allocation.
bool check_device_range(const void* pointer, std::size_t bytes, const char* what);
/// False (after printing why) unless `stream` is a valid stream handle; first runs the work held
/// on it (a kernel launched there comes after it).
bool check_stream(cudaStream_t stream, const char* what);

// ---- work held on a stream --------------------------------------------------------------------------
/// Holds `work` on `stream` (a created stream; on any other it runs now) until something is
/// ordered after it: a wait for an event recorded after it (cudaStreamWaitEvent,
/// cudaEventSynchronize, cudaEventQuery), a synchronize or query of the stream or the device, later
/// work on the same stream, a blocking stream's work reached by the legacy stream, cudaFree. So
/// a reader that is not ordered after it sees the memory as it was. The NCCL shim holds its data
/// movement this way; kernels and copies still run when issued.
void hold(cudaStream_t stream, std::function<void()> work);
/// Runs the work held on `stream` (the legacy stream: on every blocking stream).
void release_held(cudaStream_t stream);
/// Runs the work held on every stream.
void release_all_held();
/// A description of where `pointer` is ("32 bytes into a device allocation of 4096 bytes", "not
/// device memory (host?)").
std::string describe_pointer(const void* pointer);

// ---- kernels ----------------------------------------------------------------------------------------
/// The dynamic shared memory a kernel opted in to with cudaFuncSetAttribute; 0 when it did not.
int max_dynamic_shared(const void* function);
constexpr std::size_t default_shared_limit = 48 * 1024;

}  // namespace llmtrain_emu
