#include "ops/buffer.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <sys/mman.h>
#include <unistd.h>
#include <utility>

#include "core/error.h"
#if LLMTRAIN_HAVE_CUDA
#include "device/runtime.h"
#endif

namespace llmtrain::ops {
#if !LLMTRAIN_HAVE_CUDA
namespace {

[[noreturn]] void no_cuda() {
  throw RuntimeError("this llmtrain was built without CUDA (configure with -DLLMTRAIN_CUDA=ON)");
}

}  // namespace
#endif

bool cuda_available(std::string* why_not) {
#if LLMTRAIN_HAVE_CUDA
  return device::device_available(why_not);
#else
  if (why_not) *why_not = "built without CUDA";
  return false;
#endif
}

int cuda_device_count(std::string* why_none) {
#if LLMTRAIN_HAVE_CUDA
  const device::DeviceReport report = device::query_devices();
  if (why_none) *why_none = report.why_none;
  return static_cast<int>(report.devices.size());
#else
  if (why_none) *why_none = "built without CUDA";
  return 0;
#endif
}

Buffer::Buffer(Device device, std::size_t bytes) : bytes_(bytes), device_(device) {
  if (bytes == 0) return;
  if (device == Device::cpu) {
    data_ = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!data_) throw std::bad_alloc();
  } else {
#if LLMTRAIN_HAVE_CUDA
    data_ = device::device_malloc(bytes);
#else
    no_cuda();
#endif
  }
}

Buffer Buffer::zeroed_cpu(std::size_t bytes) {
  Buffer b;
  b.bytes_ = bytes;
  if (bytes == 0) return b;
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);  // page aligned
  if (p == MAP_FAILED) throw std::bad_alloc();
  b.data_ = p;
  b.mapped_ = true;
  return b;
}

Buffer Buffer::host_staging(std::size_t bytes) {
  Buffer out;
#if LLMTRAIN_HAVE_CUDA
  if (bytes > 0 && device::device_available()) {
    out.data_ = device::host_pinned_malloc(bytes);
    out.pinned_ = out.data_ != nullptr;
  }
#endif
  if (!out.data_) out = Buffer(Device::cpu, bytes);
  out.bytes_ = bytes;
  if (bytes > 0) std::memset(out.data_, 0, bytes);  // fault every page in now, not during a save
  return out;
}

Buffer::~Buffer() { release(); }

Buffer::Buffer(Buffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)),
      device_(other.device_),
      mapped_(std::exchange(other.mapped_, false)),
      pinned_(std::exchange(other.pinned_, false)) {}

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    release();
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    device_ = other.device_;
    mapped_ = std::exchange(other.mapped_, false);
    pinned_ = std::exchange(other.pinned_, false);
  }
  return *this;
}

void Buffer::release() noexcept {
  if (!data_) return;
  if (mapped_) {
    munmap(data_, bytes_);
    mapped_ = false;
  } else if (pinned_) {
#if LLMTRAIN_HAVE_CUDA
    device::host_pinned_free(data_);
#endif
    pinned_ = false;
  } else if (device_ == Device::cpu) {
    std::free(data_);
  } else {
#if LLMTRAIN_HAVE_CUDA
    device::device_free(data_);
#endif
  }
  data_ = nullptr;
}

void release_pages(const void* data, std::size_t bytes) {
  const auto page = static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto begin = (reinterpret_cast<std::uintptr_t>(data) + page - 1) / page * page;
  const auto end = (reinterpret_cast<std::uintptr_t>(data) + bytes) / page * page;
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

Tensor Buffer::view(DType dtype, std::initializer_list<std::int64_t> shape) const {
  Tensor t(data_, dtype, device_, shape);
  if (t.bytes() > bytes_) {
    throw RuntimeError("Buffer::view: " + t.describe() + " does not fit in " + std::to_string(bytes_) + " bytes");
  }
  return t;
}

void copy(const Tensor& dst, const Tensor& src) {
  if (dst.dtype != src.dtype || dst.numel() != src.numel()) {
    throw RuntimeError("ops::copy: " + dst.describe() + " <- " + src.describe());
  }
  const std::size_t n = src.bytes();
  if (dst.device == Device::cpu && src.device == Device::cpu) {
    std::memmove(dst.data, src.data, n);
    return;
  }
#if LLMTRAIN_HAVE_CUDA
  if (dst.device == Device::cuda && src.device == Device::cpu) {
    device::copy_to_device(dst.data, src.data, n);
  } else if (dst.device == Device::cpu && src.device == Device::cuda) {
    device::copy_to_host(dst.data, src.data, n);
  } else {
    device::copy_on_device(dst.data, src.data, n);
  }
#else
  no_cuda();
#endif
}

Uploader::~Uploader() {
#if LLMTRAIN_HAVE_CUDA
  for (void*& event : events_) {
    if (!event) continue;
    try {
      device::event_wait(event);  // the staging buffer is freed below: its copy must be done
    } catch (...) {
    }
    device::event_destroy(event);
  }
#endif
}

void Uploader::upload(const Tensor& dst, const Tensor& src) {
  if (dst.dtype != src.dtype || dst.numel() != src.numel() || src.device != Device::cpu) {
    throw RuntimeError("ops::Uploader: " + dst.describe() + " <- " + src.describe());
  }
  if (dst.device == Device::cpu) return copy(dst, src);
#if LLMTRAIN_HAVE_CUDA
  const std::size_t n = src.bytes();
  const int k = next_;
  next_ = (next_ + 1) % ring;
  if (!events_[k]) events_[k] = device::event_create();
  device::event_wait(events_[k]);  // the buffer's previous copy (long done, unless the host is far ahead)
  if (staging_[k].bytes() < n) staging_[k] = Buffer::host_staging(n);
  if (!staging_[k].pinned()) return copy(dst, src);  // no page-locked memory: the waiting copy
  std::memcpy(staging_[k].data(), src.data, n);
  device::copy_to_device_async(dst.data, staging_[k].data(), n);
  device::event_record(events_[k]);
#else
  no_cuda();
#endif
}

int use_cuda_device(int local_rank) {
#if LLMTRAIN_HAVE_CUDA
  return device::use_device_for_local_rank(local_rank);
#else
  (void)local_rank;
  no_cuda();
#endif
}

DeviceMemoryUse device_memory_use() {
  DeviceMemoryUse use;
#if LLMTRAIN_HAVE_CUDA
  const device::BufferMemory buffers = device::buffer_memory();
  if (buffers.peak == 0) return use;
  const device::DeviceMemory device = device::device_memory();
  use = {std::int64_t(buffers.current), std::int64_t(buffers.peak), std::int64_t(device.total - device.free),
         std::int64_t(device.total)};
#endif
  return use;
}

void zero(const Tensor& t) {
  if (t.device == Device::cpu) {
    std::memset(t.data, 0, t.bytes());
    return;
  }
#if LLMTRAIN_HAVE_CUDA
  device::fill_zero(t.data, t.bytes());
#else
  no_cuda();
#endif
}

}  // namespace llmtrain::ops
