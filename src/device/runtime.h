// The CUDA runtime as the rest of llmtrain sees it: device discovery, library versions, memory.
// This header has no CUDA types, so any part of the program may include it.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace llmtrain::device {

struct DeviceProperties {
  int index = 0;
  std::string name;
  int compute_major = 0;
  int compute_minor = 0;
  std::size_t total_memory = 0;  // bytes
  int multiprocessors = 0;
};

/// The devices this process can use, or why there are none ("CUDA driver version is
/// insufficient for CUDA runtime version", ...).
struct DeviceReport {
  std::vector<DeviceProperties> devices;
  std::string why_none;
};
DeviceReport query_devices();

/// true when at least one CUDA device is usable; `why_not` (optional) receives the reason if not.
bool device_available(std::string* why_not = nullptr);

/// Versions as "major.minor[.patch]"; the driver's is "none" when no driver is installed.
std::string runtime_version();
std::string driver_version();
std::string cublaslt_version();
std::string cudnn_version();  // "not built" without cuDNN
std::string nccl_version();

/// Raw device memory (throws RuntimeError on failure) and synchronous copies.
void* device_malloc(std::size_t bytes);
void device_free(void* pointer) noexcept;
/// Page-locked host memory (cudaHostAlloc), which device<->host copies reach at full speed;
/// nullptr when it cannot be had.
void* host_pinned_malloc(std::size_t bytes);
void host_pinned_free(void* pointer) noexcept;
void copy_to_device(void* device_dst, const void* host_src, std::size_t bytes);
void copy_to_host(void* host_dst, const void* device_src, std::size_t bytes);
void copy_on_device(void* device_dst, const void* device_src, std::size_t bytes);
/// Queues a copy from page-locked host memory on the compute stream and returns without waiting:
/// the host must not rewrite `pinned_src` before an event recorded after it has completed.
void copy_to_device_async(void* device_dst, const void* pinned_src, std::size_t bytes);
/// Events on the compute stream, as opaque handles: record marks the work queued so far, wait
/// blocks the host until that work is done (at once for an event never recorded).
void* event_create();
void event_destroy(void* event) noexcept;
void event_record(void* event);
void event_wait(void* event);
void fill_zero(void* device_dst, std::size_t bytes);
void synchronize();
/// Makes device (local_rank mod the device count) this process's device; call before any other
/// CUDA work (streams, handles and buffers belong to the device current when they are made).
/// Returns the device index.
int use_device_for_local_rank(int local_rank);

/// Bytes held by device_malloc'ed buffers: now, and the most at any time so far.
struct BufferMemory {
  std::size_t current = 0, peak = 0;
};
BufferMemory buffer_memory();
/// The current device's free and total memory (cudaMemGetInfo).
struct DeviceMemory {
  std::size_t free = 0, total = 0;
};
DeviceMemory device_memory();

}  // namespace llmtrain::device
