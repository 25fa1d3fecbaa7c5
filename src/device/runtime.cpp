#include "device/runtime.h"

#include <algorithm>
#include <mutex>
#include <unordered_map>

#include <cublasLt.h>
#include <nccl.h>
#if LLMTRAIN_HAVE_CUDNN
#include <cudnn.h>
#endif

#include "device/cuda_check.h"
#include "device/stream.h"

namespace llmtrain::device {
namespace {

// CUDA encodes versions as major * 1000 + minor * 10.
std::string cuda_style_version(int v) { return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10); }

// cuBLAS, cuDNN (9.x) and NCCL (2.9+) encode versions as major * 10000 + minor * 100 + patch.
std::string library_version(std::size_t v) {
  return std::to_string(v / 10000) + "." + std::to_string((v / 100) % 100) + "." + std::to_string(v % 100);
}

}  // namespace

DeviceReport query_devices() {
  DeviceReport report;
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    report.why_none = cudaGetErrorString(status);
    cudaGetLastError();  // clear the sticky error so later calls report their own
    return report;
  }
  if (count == 0) report.why_none = "the CUDA runtime found no device";
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    LLMTRAIN_DEVICE_CHECK(cudaGetDeviceProperties(&prop, i));
    report.devices.push_back({i, prop.name, prop.major, prop.minor, prop.totalGlobalMem, prop.multiProcessorCount});
  }
  return report;
}

bool device_available(std::string* why_not) {
  const DeviceReport report = query_devices();
  if (why_not) *why_not = report.why_none;
  return !report.devices.empty();
}

std::string runtime_version() {
  int v = 0;
  cudaRuntimeGetVersion(&v);
  return cuda_style_version(v);
}

std::string driver_version() {
  int v = 0;
  cudaDriverGetVersion(&v);
  return v == 0 ? "none" : cuda_style_version(v);
}

std::string cublaslt_version() { return library_version(cublasLtGetVersion()); }

std::string cudnn_version() {
#if LLMTRAIN_HAVE_CUDNN
  return library_version(cudnnGetVersion());
#else
  return "not built";
#endif
}

std::string nccl_version() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return "unknown";
  return library_version(static_cast<std::size_t>(v));
}

namespace {

// Bytes of our device buffers now and at most so far (library workspaces and the memory pool's
// scratch are not counted; device_memory() reports what the device as a whole has in use).
struct Allocations {
  std::mutex mutex;
  std::unordered_map<void*, std::size_t> sizes;
  std::size_t current = 0, peak = 0;
};

Allocations& allocations() {
  static Allocations a;
  return a;
}

}  // namespace

void* device_malloc(std::size_t bytes) {
  void* pointer = nullptr;
  const cudaError_t status = cudaMalloc(&pointer, bytes);
  if (status == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();  // clear it: the process may go on (a smaller batch, a clean stop)
    const DeviceMemory m = device_memory();
    throw RuntimeError("out of device memory: " + std::to_string(bytes) + " bytes requested, " +
                       std::to_string(m.free) + " of " + std::to_string(m.total) +
                       " bytes free (reduce train.micro_batch_size, or set train.recompute)");
  }
  LLMTRAIN_DEVICE_CHECK(status);
  Allocations& a = allocations();
  std::lock_guard lock(a.mutex);
  a.sizes[pointer] = bytes;
  a.current += bytes;
  a.peak = std::max(a.peak, a.current);
  return pointer;
}

void device_free(void* pointer) noexcept {
  cudaFree(pointer);
  Allocations& a = allocations();
  std::lock_guard lock(a.mutex);
  if (const auto it = a.sizes.find(pointer); it != a.sizes.end()) {
    a.current -= it->second;
    a.sizes.erase(it);
  }
}

void* host_pinned_malloc(std::size_t bytes) {
  void* pointer = nullptr;
  const cudaError_t status = cudaMallocHost(&pointer, bytes);  // cudaHostAlloc with default flags
  if (status != cudaSuccess) {
    (void)cudaGetLastError();  // not fatal: the caller falls back to ordinary memory
    return nullptr;
  }
  return pointer;
}

void host_pinned_free(void* pointer) noexcept { cudaFreeHost(pointer); }

BufferMemory buffer_memory() {
  Allocations& a = allocations();
  std::lock_guard lock(a.mutex);
  return {a.current, a.peak};
}

DeviceMemory device_memory() {
  std::size_t free = 0, total = 0;
  LLMTRAIN_DEVICE_CHECK(cudaMemGetInfo(&free, &total));
  return {free, total};
}

// Copies and fills run on the compute stream, in order with the ops' kernels: that stream is
// non-blocking, so a plain cudaMemcpy (legacy default stream) would not wait for them, nor they
// for it. Copies from or to the host then wait for the stream (the host buffer may be reused, or
// read, as soon as they return); device-only ones stay asynchronous, like cudaMemcpy's.
void copy_to_device(void* device_dst, const void* host_src, std::size_t bytes) {
  const cudaStream_t stream = compute_stream();
  LLMTRAIN_DEVICE_CHECK(cudaMemcpyAsync(device_dst, host_src, bytes, cudaMemcpyHostToDevice, stream));
  LLMTRAIN_DEVICE_CHECK(cudaStreamSynchronize(stream));
}

void copy_to_host(void* host_dst, const void* device_src, std::size_t bytes) {
  const cudaStream_t stream = compute_stream();
  LLMTRAIN_DEVICE_CHECK(cudaMemcpyAsync(host_dst, device_src, bytes, cudaMemcpyDeviceToHost, stream));
  LLMTRAIN_DEVICE_CHECK(cudaStreamSynchronize(stream));
}

void copy_to_device_async(void* device_dst, const void* pinned_src, std::size_t bytes) {
  LLMTRAIN_DEVICE_CHECK(cudaMemcpyAsync(device_dst, pinned_src, bytes, cudaMemcpyHostToDevice, compute_stream()));
}

void* event_create() {
  cudaEvent_t event = nullptr;
  LLMTRAIN_DEVICE_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  return event;
}

void event_destroy(void* event) noexcept {
  if (event) cudaEventDestroy(static_cast<cudaEvent_t>(event));
}

void event_record(void* event) {
  LLMTRAIN_DEVICE_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(event), compute_stream()));
}

void event_wait(void* event) { LLMTRAIN_DEVICE_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(event))); }

void copy_on_device(void* device_dst, const void* device_src, std::size_t bytes) {
  LLMTRAIN_DEVICE_CHECK(cudaMemcpyAsync(device_dst, device_src, bytes, cudaMemcpyDeviceToDevice, compute_stream()));
}

void fill_zero(void* device_dst, std::size_t bytes) {
  LLMTRAIN_DEVICE_CHECK(cudaMemsetAsync(device_dst, 0, bytes, compute_stream()));
}

int use_device_for_local_rank(int local_rank) {
  int count = 0;
  LLMTRAIN_DEVICE_CHECK(cudaGetDeviceCount(&count));
  if (count < 1) throw RuntimeError("no CUDA device");
  const int device = local_rank % count;
  LLMTRAIN_DEVICE_CHECK(cudaSetDevice(device));
  return device;
}

void synchronize() { LLMTRAIN_DEVICE_CHECK(cudaDeviceSynchronize()); }

}  // namespace llmtrain::device
