// The CUDA runtime API on the host: device memory as tracked host allocations, streams and
// events as checked handles (all work is synchronous, but for what is held on a stream: see
// hold()), the error state, device properties.
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>

#include "cuda_runtime_api.h"
#include "internal.h"
#include "llmtrain_emu/runtime_control.h"
#include "nccl.h"

struct CUstream_st {
  unsigned int flags;
  std::deque<std::function<void()>> held;  // work held on the stream (llmtrain_emu::hold), oldest first
  std::uint64_t holds = 0;                 // items ever held on it
};
struct CUevent_st {
  unsigned int flags;
  bool recorded;
  cudaStream_t stream = nullptr;  // where it was last recorded (a created stream), and the number of
  std::uint64_t after = 0;        // items held there before it
};
struct CUmemPoolHandle_st {
  std::uint64_t release_threshold;
};

namespace llmtrain_emu {
namespace {

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : fallback;
}

Settings read_settings() {
  Settings s;
  s.workers = std::max(1, env_int("LLMTRAIN_EMU_WORKERS", 1));
  const char* schedule = std::getenv("LLMTRAIN_EMU_SCHEDULE");
  if (schedule && std::strcmp(schedule, "reverse") == 0) s.schedule = 1;
  if (schedule && std::strcmp(schedule, "random") == 0) s.schedule = 2;
  s.max_shared_optin = std::size_t(env_int("LLMTRAIN_EMU_MAX_SHARED_KB", 227)) * 1024;
  s.verbose = env_int("LLMTRAIN_EMU_VERBOSE", 0) != 0;
  return s;
}

// The device's memory as the emulator reports it (an 80 GB GPU); allocations are host memory.
constexpr std::size_t emulated_total_memory = std::size_t(80) << 30;

struct Allocation {
  std::size_t bytes;
  bool stream_ordered;  // from cudaMallocAsync
};

struct Registry {
  std::mutex mutex;
  std::map<std::uintptr_t, Allocation> allocations;  // by start address
  std::size_t in_use = 0;
  std::set<CUstream_st*> streams;
  std::set<CUevent_st*> events;
  std::unordered_map<const void*, int> max_dynamic_shared;
  CUmemPoolHandle_st pool{0};
};

Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: kernels' static objects free at exit
  return *r;
}

thread_local cudaError_t last_error = cudaSuccess;
std::atomic<int> sticky{cudaSuccess};
thread_local int current_device = 0;

// The allocation holding `pointer` (its end included when `inclusive_end`), or end().
std::map<std::uintptr_t, Allocation>::const_iterator find_allocation(const Registry& r, const void* pointer,
                                                                    bool inclusive_end) {
  const auto address = reinterpret_cast<std::uintptr_t>(pointer);
  auto it = r.allocations.upper_bound(address);
  if (it == r.allocations.begin()) return r.allocations.end();
  --it;
  const std::uintptr_t end = it->first + it->second.bytes;
  if (address < end || (inclusive_end && address == end)) return it;
  return r.allocations.end();
}

cudaError_t fail(cudaError_t status, const std::string& why) {
  report(why);
  last_error = status;
  return status;
}

// Returns the sticky error, if any (every call fails after a device fault).
cudaError_t check_sticky() {
  const cudaError_t s = sticky_error();
  if (s != cudaSuccess) last_error = s;
  return s;
}

bool valid_stream(cudaStream_t stream) {
  if (stream == nullptr || stream == cudaStreamLegacy || stream == cudaStreamPerThread) return true;
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  return r.streams.count(stream) != 0;
}

cudaError_t allocate(void** pointer, std::size_t bytes, bool stream_ordered, const char* call) {
  if (const cudaError_t s = check_sticky()) return s;
  if (pointer == nullptr) return fail(cudaErrorInvalidValue, std::string(call) + ": null output pointer");
  *pointer = nullptr;
  if (bytes == 0) return cudaSuccess;
  Registry& r = registry();
  {
    std::lock_guard lock(r.mutex);
    if (r.in_use + bytes > emulated_total_memory) {
      return fail(cudaErrorMemoryAllocation, std::string(call) + ": out of (emulated 80 GB) device memory");
    }
  }
  void* p = nullptr;
  // 256-byte aligned, as cudaMalloc's; exactly `bytes` long, so that AddressSanitizer reports an
  // access past the end (a GPU rounds allocations up and would not fault there).
  if (posix_memalign(&p, 256, bytes) != 0 || p == nullptr) {
    last_error = cudaErrorMemoryAllocation;
    return cudaErrorMemoryAllocation;
  }
  std::memset(p, 0xff, bytes);  // uninitialised device memory reads as NaN (floats) or -1 (ints)
  std::lock_guard lock(r.mutex);
  r.allocations[reinterpret_cast<std::uintptr_t>(p)] = Allocation{bytes, stream_ordered};
  r.in_use += bytes;
  *pointer = p;
  return cudaSuccess;
}

cudaError_t release(void* pointer, const char* call) {
  if (pointer == nullptr) return cudaSuccess;
  Registry& r = registry();
  {
    std::lock_guard lock(r.mutex);
    const auto it = r.allocations.find(reinterpret_cast<std::uintptr_t>(pointer));
    if (it == r.allocations.end()) {
      last_error = cudaErrorInvalidValue;
      report(std::string(call) + "(" + describe_pointer(pointer) + "): not the start of a live device allocation");
      return cudaErrorInvalidValue;
    }
    r.in_use -= it->second.bytes;
    r.allocations.erase(it);
  }
  std::free(pointer);  // AddressSanitizer then reports any later use of it
  return cudaSuccess;
}

const char* kind_name(cudaMemcpyKind kind) {
  switch (kind) {
    case cudaMemcpyHostToHost: return "HostToHost";
    case cudaMemcpyHostToDevice: return "HostToDevice";
    case cudaMemcpyDeviceToHost: return "DeviceToHost";
    case cudaMemcpyDeviceToDevice: return "DeviceToDevice";
    default: return "Default";
  }
}

cudaError_t copy(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind, cudaStream_t stream,
                 const char* call) {
  if (const cudaError_t s = check_sticky()) return s;
  if (!valid_stream(stream)) return fail(cudaErrorInvalidResourceHandle, std::string(call) + ": invalid stream");
  release_held(stream);
  if (bytes == 0) return cudaSuccess;
  if (dst == nullptr || src == nullptr) return fail(cudaErrorInvalidValue, std::string(call) + ": null pointer");
  const bool dst_device = is_device_range(dst, bytes), src_device = is_device_range(src, bytes);
  bool want_dst_device = false, want_src_device = false, check = true;
  switch (kind) {
    case cudaMemcpyHostToHost: break;
    case cudaMemcpyHostToDevice: want_dst_device = true; break;
    case cudaMemcpyDeviceToHost: want_src_device = true; break;
    case cudaMemcpyDeviceToDevice: want_dst_device = want_src_device = true; break;
    case cudaMemcpyDefault: check = false; break;
    default: return fail(cudaErrorInvalidMemcpyDirection, std::string(call) + ": bad cudaMemcpyKind");
  }
  if (check && (dst_device != want_dst_device || src_device != want_src_device)) {
    return fail(cudaErrorInvalidValue, std::string(call) + "(" + kind_name(kind) + ", " + std::to_string(bytes) +
                                           " bytes): dst " + describe_pointer(dst) + ", src " +
                                           describe_pointer(src) +
                                           (want_dst_device && !dst_device ? " (dst range not in one device allocation)" : "") +
                                           (want_src_device && !src_device ? " (src range not in one device allocation)" : ""));
  }
  const auto d = reinterpret_cast<std::uintptr_t>(dst), s = reinterpret_cast<std::uintptr_t>(src);
  if (d < s + bytes && s < d + bytes) {
    return fail(cudaErrorInvalidValue, std::string(call) + ": source and destination overlap");
  }
  std::memcpy(dst, src, bytes);
  return cudaSuccess;
}

cudaError_t fill(void* pointer, int value, std::size_t bytes, cudaStream_t stream, const char* call) {
  if (const cudaError_t s = check_sticky()) return s;
  if (!valid_stream(stream)) return fail(cudaErrorInvalidResourceHandle, std::string(call) + ": invalid stream");
  release_held(stream);
  if (bytes == 0) return cudaSuccess;
  if (!is_device_range(pointer, bytes)) {
    return fail(cudaErrorInvalidValue, std::string(call) + "(" + std::to_string(bytes) + " bytes): " +
                                           describe_pointer(pointer) + ", range not in one device allocation");
  }
  std::memset(pointer, value, bytes);
  return cudaSuccess;
}

}  // namespace

const Settings& settings() {
  static const Settings s = read_settings();
  return s;
}

void report(const std::string& message) {
  std::fprintf(stderr, "llmtrain_emu: %s\n", message.c_str());
  std::fflush(stderr);
}

void set_last_error(cudaError_t status) { last_error = status; }

void set_sticky_error(cudaError_t status) {
  int expected = cudaSuccess;
  sticky.compare_exchange_strong(expected, int(status));
  last_error = status;
}

cudaError_t sticky_error() { return cudaError_t(sticky.load()); }

bool is_device_range(const void* pointer, std::size_t bytes) {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  const auto it = find_allocation(r, pointer, bytes == 0);
  if (it == r.allocations.end()) return false;
  return reinterpret_cast<std::uintptr_t>(pointer) + bytes <= it->first + it->second.bytes;
}

std::string describe_pointer(const void* pointer) {
  char address[32];
  std::snprintf(address, sizeof address, "%p", pointer);
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  const auto it = find_allocation(r, pointer, true);
  if (it == r.allocations.end()) return std::string(address) + " (not device memory)";
  const std::uintptr_t offset = reinterpret_cast<std::uintptr_t>(pointer) - it->first;
  if (offset == it->second.bytes) {
    return std::string(address) + " (just past the end of a device allocation of " + std::to_string(offset) +
           " bytes: not device memory)";
  }
  return std::string(address) + " (" + std::to_string(offset) + " bytes into a device allocation of " +
         std::to_string(it->second.bytes) + ")";
}

bool check_device_range(const void* pointer, std::size_t bytes, const char* what) {
  if (bytes == 0 || is_device_range(pointer, bytes)) return true;
  report(std::string(what) + ": " + std::to_string(bytes) + " bytes at " + describe_pointer(pointer) +
         " are not inside one device allocation");
  return false;
}

bool check_stream(cudaStream_t stream, const char* what) {
  release_held(stream);
  if (valid_stream(stream)) return true;
  report(std::string(what) + ": invalid stream handle");
  return false;
}

namespace {

// A stream made by cudaStreamCreate and still alive (not the legacy or per-thread stream).
bool created_stream(cudaStream_t stream) {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  return r.streams.count(stream) != 0;
}

// Runs the items held on `stream` until `upto` of them have ever run.
void run_held(cudaStream_t stream, std::uint64_t upto) {
  while (!stream->held.empty() && stream->holds - stream->held.size() < upto) {
    const std::function<void()> work = std::move(stream->held.front());
    stream->held.pop_front();
    work();
  }
}

}  // namespace

void hold(cudaStream_t stream, std::function<void()> work) {
  if (!created_stream(stream)) {
    work();
    return;
  }
  stream->held.push_back(std::move(work));
  stream->holds += 1;
}

void release_held(cudaStream_t stream) {
  if (created_stream(stream)) {
    run_held(stream, stream->holds);
    return;
  }
  if (stream != nullptr && stream != cudaStreamLegacy) return;
  // The legacy stream waits for every blocking stream's work.
  std::vector<CUstream_st*> blocking;
  {
    Registry& r = registry();
    std::lock_guard lock(r.mutex);
    for (CUstream_st* s : r.streams) {
      if (!(s->flags & cudaStreamNonBlocking)) blocking.push_back(s);
    }
  }
  for (CUstream_st* s : blocking) run_held(s, s->holds);
}

void release_all_held() {
  std::vector<CUstream_st*> streams;
  {
    Registry& r = registry();
    std::lock_guard lock(r.mutex);
    streams.assign(r.streams.begin(), r.streams.end());
  }
  for (CUstream_st* s : streams) run_held(s, s->holds);
}

int max_dynamic_shared(const void* function) {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  const auto it = r.max_dynamic_shared.find(function);
  return it == r.max_dynamic_shared.end() ? 0 : it->second;
}

}  // namespace llmtrain_emu

using namespace llmtrain_emu;

// ---- errors and versions ---------------------------------------------------------------------------

cudaError_t cudaGetLastError() {
  const cudaError_t s = last_error;
  last_error = sticky_error();
  return s;
}

cudaError_t cudaPeekAtLastError() { return last_error; }

const char* cudaGetErrorName(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInitializationError: return "cudaErrorInitializationError";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevicePointer: return "cudaErrorInvalidDevicePointer";
    case cudaErrorInvalidMemcpyDirection: return "cudaErrorInvalidMemcpyDirection";
    case cudaErrorInvalidDeviceFunction: return "cudaErrorInvalidDeviceFunction";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
    case cudaErrorLaunchOutOfResources: return "cudaErrorLaunchOutOfResources";
    case cudaErrorAssert: return "cudaErrorAssert";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    case cudaErrorNotSupported: return "cudaErrorNotSupported";
    default: return "cudaErrorUnknown";
  }
}

const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorLaunchOutOfResources: return "too many resources requested for launch";
    case cudaErrorLaunchFailure: return "unspecified launch failure (emulated device fault, see llmtrain_emu lines)";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    case cudaErrorAssert: return "device-side assert triggered";
    default: return cudaGetErrorName(error);
  }
}

cudaError_t cudaRuntimeGetVersion(int* version) {
  *version = 13000;
  return cudaSuccess;
}

cudaError_t cudaDriverGetVersion(int* version) {
  *version = 13000;
  return cudaSuccess;
}

// ---- devices ---------------------------------------------------------------------------------------

cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  *device = current_device;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  if (device != 0) return fail(cudaErrorInvalidDevice, "cudaSetDevice(" + std::to_string(device) + "): one device");
  current_device = device;
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (device != 0) return fail(cudaErrorInvalidDevice, "cudaGetDeviceProperties: one device");
  std::memset(prop, 0, sizeof *prop);
  std::snprintf(prop->name, sizeof prop->name, "llmtrain_emu (CPU emulation of an sm_90 GPU)");
  prop->totalGlobalMem = emulated_total_memory;
  prop->sharedMemPerBlock = default_shared_limit;
  prop->regsPerBlock = 65536;
  prop->warpSize = 32;
  prop->maxThreadsPerBlock = 1024;
  prop->maxThreadsDim[0] = 1024;
  prop->maxThreadsDim[1] = 1024;
  prop->maxThreadsDim[2] = 64;
  prop->maxGridSize[0] = 2147483647;
  prop->maxGridSize[1] = 65535;
  prop->maxGridSize[2] = 65535;
  prop->totalConstMem = 65536;
  prop->major = 9;
  prop->minor = 0;
  prop->multiProcessorCount = 132;
  prop->l2CacheSize = 50 << 20;
  prop->maxThreadsPerMultiProcessor = 2048;
  prop->sharedMemPerMultiprocessor = 233472;
  prop->sharedMemPerBlockOptin = settings().max_shared_optin;
  prop->regsPerMultiprocessor = 65536;
  prop->memoryBusWidth = 5120;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  cudaDeviceProp p;
  if (const cudaError_t s = cudaGetDeviceProperties(&p, device)) return s;
  switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock: *value = p.maxThreadsPerBlock; break;
    case cudaDevAttrMaxBlockDimX: *value = p.maxThreadsDim[0]; break;
    case cudaDevAttrMaxBlockDimY: *value = p.maxThreadsDim[1]; break;
    case cudaDevAttrMaxBlockDimZ: *value = p.maxThreadsDim[2]; break;
    case cudaDevAttrMaxGridDimX: *value = p.maxGridSize[0]; break;
    case cudaDevAttrMaxGridDimY: *value = p.maxGridSize[1]; break;
    case cudaDevAttrMaxGridDimZ: *value = p.maxGridSize[2]; break;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = int(p.sharedMemPerBlock); break;
    case cudaDevAttrWarpSize: *value = 32; break;
    case cudaDevAttrMultiProcessorCount: *value = p.multiProcessorCount; break;
    case cudaDevAttrComputeCapabilityMajor: *value = p.major; break;
    case cudaDevAttrComputeCapabilityMinor: *value = p.minor; break;
    case cudaDevAttrMaxSharedMemoryPerMultiprocessor: *value = int(p.sharedMemPerMultiprocessor); break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = int(p.sharedMemPerBlockOptin); break;
    default: return fail(cudaErrorInvalidValue, "cudaDeviceGetAttribute: attribute not emulated");
  }
  return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize() {
  llmtrain_emu::count_runtime_call("cudaDeviceSynchronize");
  release_all_held();
  return check_sticky();
}

cudaError_t cudaDeviceReset() { return cudaSuccess; }

cudaError_t cudaMemGetInfo(std::size_t* free, std::size_t* total) {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  *total = emulated_total_memory;
  *free = emulated_total_memory - r.in_use;
  return cudaSuccess;
}

// ---- memory ------------------------------------------------------------------------------------------

cudaError_t cudaMalloc(void** pointer, std::size_t bytes) { return allocate(pointer, bytes, false, "cudaMalloc"); }

cudaError_t cudaFree(void* pointer) {
  release_all_held();  // cudaFree synchronizes the device
  return release(pointer, "cudaFree");
}

cudaError_t cudaMallocHost(void** pointer, std::size_t bytes) {
  *pointer = std::malloc(bytes ? bytes : 1);
  return *pointer ? cudaSuccess : cudaErrorMemoryAllocation;
}

cudaError_t cudaFreeHost(void* pointer) {
  std::free(pointer);
  return cudaSuccess;
}

cudaError_t cudaMallocAsync(void** pointer, std::size_t bytes, cudaStream_t stream) {
  if (!valid_stream(stream)) return fail(cudaErrorInvalidResourceHandle, "cudaMallocAsync: invalid stream");
  release_held(stream);
  return allocate(pointer, bytes, true, "cudaMallocAsync");
}

cudaError_t cudaFreeAsync(void* pointer, cudaStream_t stream) {
  if (!valid_stream(stream)) return fail(cudaErrorInvalidResourceHandle, "cudaFreeAsync: invalid stream");
  release_held(stream);
  return release(pointer, "cudaFreeAsync");
}

cudaError_t cudaMemcpy(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind) {
  return copy(dst, src, bytes, kind, nullptr, "cudaMemcpy");
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind, cudaStream_t stream) {
  return copy(dst, src, bytes, kind, stream, "cudaMemcpyAsync");
}

cudaError_t cudaMemset(void* pointer, int value, std::size_t bytes) {
  return fill(pointer, value, bytes, nullptr, "cudaMemset");
}

cudaError_t cudaMemsetAsync(void* pointer, int value, std::size_t bytes, cudaStream_t stream) {
  return fill(pointer, value, bytes, stream, "cudaMemsetAsync");
}

cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t* pool, int device) {
  if (device != 0) return fail(cudaErrorInvalidDevice, "cudaDeviceGetDefaultMemPool: one device");
  *pool = &registry().pool;
  return cudaSuccess;
}

cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr, void* value) {
  if (pool != &registry().pool) return fail(cudaErrorInvalidValue, "cudaMemPoolSetAttribute: unknown pool");
  if (attr == cudaMemPoolAttrReleaseThreshold) {
    pool->release_threshold = *static_cast<std::uint64_t*>(value);
  } else if (attr != cudaMemPoolReuseFollowEventDependencies && attr != cudaMemPoolReuseAllowOpportunistic &&
             attr != cudaMemPoolReuseAllowInternalDependencies) {
    return fail(cudaErrorInvalidValue, "cudaMemPoolSetAttribute: read-only or unknown attribute");
  }
  return cudaSuccess;
}

cudaError_t cudaMemPoolGetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr, void* value) {
  if (pool != &registry().pool) return fail(cudaErrorInvalidValue, "cudaMemPoolGetAttribute: unknown pool");
  if (attr == cudaMemPoolAttrReleaseThreshold) {
    *static_cast<std::uint64_t*>(value) = pool->release_threshold;
    return cudaSuccess;
  }
  if (attr >= cudaMemPoolAttrReservedMemCurrent) {
    *static_cast<std::uint64_t*>(value) = 0;
    return cudaSuccess;
  }
  *static_cast<int*>(value) = 1;
  return cudaSuccess;
}

cudaError_t cudaMemPoolTrimTo(cudaMemPool_t pool, std::size_t) {
  return pool == &registry().pool ? cudaSuccess : fail(cudaErrorInvalidValue, "cudaMemPoolTrimTo: unknown pool");
}

// ---- streams and events -------------------------------------------------------------------------------

cudaError_t cudaStreamCreate(cudaStream_t* stream) { return cudaStreamCreateWithFlags(stream, cudaStreamDefault); }

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags) {
  if (const cudaError_t s = check_sticky()) return s;
  auto* st = new CUstream_st{flags, {}, 0};
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  r.streams.insert(st);
  *stream = st;
  return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  release_held(stream);  // its work still completes
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  if (r.streams.erase(stream) == 0) {
    last_error = cudaErrorInvalidResourceHandle;
    report("cudaStreamDestroy: not a live stream");
    return cudaErrorInvalidResourceHandle;
  }
  for (CUevent_st* e : r.events) {
    if (e->stream == stream) e->stream = nullptr;
  }
  delete stream;
  return cudaSuccess;
}

static cudaError_t stream_synchronize(cudaStream_t stream);
cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  llmtrain_emu::count_runtime_call("cudaStreamSynchronize");
  return stream_synchronize(stream);
}
static cudaError_t stream_synchronize(cudaStream_t stream) {
  if (!valid_stream(stream)) return fail(cudaErrorInvalidResourceHandle, "cudaStreamSynchronize: invalid stream");
  release_held(stream);
  return check_sticky();
}

cudaError_t cudaStreamQuery(cudaStream_t stream) {
  llmtrain_emu::count_runtime_call("cudaStreamQuery");
  return stream_synchronize(stream);
}

namespace {
bool valid_event(cudaEvent_t event) {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  return r.events.count(event) != 0;
}

// Whatever waits for `event` waits for the work held on its stream before it was recorded.
void release_before(cudaEvent_t event) {
  if (event->stream && created_stream(event->stream)) run_held(event->stream, event->after);
}
}  // namespace

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int) {
  llmtrain_emu::count_runtime_call("cudaStreamWaitEvent");
  if (!valid_stream(stream) || !valid_event(event)) {
    return fail(cudaErrorInvalidResourceHandle, "cudaStreamWaitEvent: invalid stream or event");
  }
  // The stream's later work comes after the work before the event: that work is run now.
  release_before(event);
  return check_sticky();
}

cudaError_t cudaEventCreate(cudaEvent_t* event) { return cudaEventCreateWithFlags(event, cudaEventDefault); }

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
  auto* e = new CUevent_st{flags, false, nullptr, 0};
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  r.events.insert(e);
  *event = e;
  return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  if (r.events.erase(event) == 0) {
    last_error = cudaErrorInvalidResourceHandle;
    report("cudaEventDestroy: not a live event");
    return cudaErrorInvalidResourceHandle;
  }
  delete event;
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  if (!valid_stream(stream) || !valid_event(event)) {
    return fail(cudaErrorInvalidResourceHandle, "cudaEventRecord: invalid stream or event");
  }
  event->recorded = true;
  event->stream = created_stream(stream) ? stream : nullptr;
  event->after = event->stream ? stream->holds : 0;
  return check_sticky();
}

static cudaError_t event_synchronize(cudaEvent_t event);
cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  llmtrain_emu::count_runtime_call("cudaEventSynchronize");
  return event_synchronize(event);
}
static cudaError_t event_synchronize(cudaEvent_t event) {
  if (!valid_event(event)) return fail(cudaErrorInvalidResourceHandle, "cudaEventSynchronize: invalid event");
  release_before(event);
  return check_sticky();
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
  llmtrain_emu::count_runtime_call("cudaEventQuery");
  return event_synchronize(event);
}

cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  if (!valid_event(start) || !valid_event(end)) {
    return fail(cudaErrorInvalidResourceHandle, "cudaEventElapsedTime: invalid event");
  }
  if (!start->recorded || !end->recorded || (start->flags & cudaEventDisableTiming) ||
      (end->flags & cudaEventDisableTiming)) {
    return fail(cudaErrorInvalidResourceHandle, "cudaEventElapsedTime: an event was not recorded or has no timing");
  }
  *ms = 0.0f;  // no timing in the emulation
  return cudaSuccess;
}

// ---- kernel attributes ----------------------------------------------------------------------------------

cudaError_t cudaFuncSetAttribute(const void* function, cudaFuncAttribute attr, int value) {
  if (function == nullptr) return fail(cudaErrorInvalidDeviceFunction, "cudaFuncSetAttribute: null function");
  if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    if (value < 0 || std::size_t(value) > settings().max_shared_optin) {
      return fail(cudaErrorInvalidValue, "cudaFuncSetAttribute(MaxDynamicSharedMemorySize, " + std::to_string(value) +
                                             "): above the device's opt-in limit of " +
                                             std::to_string(settings().max_shared_optin) + " bytes");
    }
    Registry& r = registry();
    std::lock_guard lock(r.mutex);
    r.max_dynamic_shared[function] = value;
    return cudaSuccess;
  }
  if (attr == cudaFuncAttributePreferredSharedMemoryCarveout) return cudaSuccess;
  return fail(cudaErrorInvalidValue, "cudaFuncSetAttribute: attribute not emulated");
}

cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attributes, const void* function) {
  std::memset(attributes, 0, sizeof *attributes);
  attributes->maxThreadsPerBlock = 1024;
  attributes->maxDynamicSharedSizeBytes = max_dynamic_shared(function);
  if (attributes->maxDynamicSharedSizeBytes == 0) attributes->maxDynamicSharedSizeBytes = int(default_shared_limit);
  return cudaSuccess;
}

cudaError_t cudaFuncSetCacheConfig(const void*, cudaFuncCache) { return cudaSuccess; }

// ---- NCCL's version (src/device/runtime.cpp asks it) ---------------------------------------------------------

ncclResult_t ncclGetVersion(int* version) {
  *version = 0;
  return ncclSuccess;
}

const char* ncclGetErrorString(ncclResult_t result) { return result == ncclSuccess ? "no error" : "NCCL error (emulation)"; }

namespace {
std::mutex runtime_calls_mutex;
std::map<std::string, std::int64_t>& runtime_call_counts() {
  static std::map<std::string, std::int64_t> counts;
  return counts;
}
}  // namespace

void llmtrain_emu::count_runtime_call(const char* name) {
  std::lock_guard<std::mutex> lock(runtime_calls_mutex);
  runtime_call_counts()[name] += 1;
}

std::int64_t llmtrain_emu::runtime_calls(const char* name) {
  std::lock_guard<std::mutex> lock(runtime_calls_mutex);
  const auto it = runtime_call_counts().find(name);
  return it == runtime_call_counts().end() ? 0 : it->second;
}
