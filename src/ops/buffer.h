// Owned memory on one device, and copies between devices.
#pragma once

#include <cstddef>
#include <initializer_list>

#include "core/tensor.h"

namespace llmtrain::ops {

/// True when this binary has the CUDA backend and a device is usable; `why_not` gets the reason.
bool cuda_available(std::string* why_not = nullptr);
/// The CUDA devices this process can use (0 without the CUDA backend); `why_none` gets the reason
/// when there are none.
int cuda_device_count(std::string* why_none = nullptr);

/// Move-only owner of `bytes` bytes on `device` (CPU memory is 64-byte aligned).
class Buffer {
 public:
  Buffer() = default;
  Buffer(Device device, std::size_t bytes);
  /// `bytes` zero bytes of CPU memory mapped from the OS: a page takes memory only once written
  /// (so the gradients of a model loaded for export, eval or generate cost none).
  static Buffer zeroed_cpu(std::size_t bytes);
  ~Buffer();
  Buffer(Buffer&& other) noexcept;
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  /// Host memory to stage copies from the device in: page-locked (pinned) where this build has
  /// CUDA and a device is usable, else ordinary; every page is touched here, so that the first
  /// copy into it pays no page faults. pinned() says which it got.
  static Buffer host_staging(std::size_t bytes);

  void* data() const { return data_; }
  bool pinned() const { return pinned_; }
  std::size_t bytes() const { return bytes_; }
  Device device() const { return device_; }

  /// A view of the start of the buffer with this type and shape (checked to fit).
  Tensor view(DType dtype, std::initializer_list<std::int64_t> shape) const;

 private:
  void release() noexcept;

  void* data_ = nullptr;
  std::size_t bytes_ = 0;
  Device device_ = Device::cpu;
  bool mapped_ = false;  // from zeroed_cpu: munmap, not free
  bool pinned_ = false;  // from host_staging on a CUDA machine: pinned host memory
};

/// Hands the whole pages inside [data, data + bytes) of CPU memory back to the OS: anonymous
/// memory then reads as zero, a read-only file mapping reads the file again. For data read once.
void release_pages(const void* data, std::size_t bytes);

/// dst = src, between any two devices; same dtype and element count.
void copy(const Tensor& dst, const Tensor& src);

/// Copies of small host arrays (a micro-batch's tokens) to the device that return without
/// waiting for the device, so that the host can queue the next micro-step's kernels while the
/// GPU still runs this one's: ops::copy from the host waits for the whole stream. Each copy goes
/// through one of two page-locked staging buffers, rewritten only once the device has read what
/// it held (an event recorded after each copy): the host runs at most two copies ahead.
class Uploader {
 public:
  Uploader() = default;
  ~Uploader();
  Uploader(const Uploader&) = delete;
  Uploader& operator=(const Uploader&) = delete;
  /// dst = src (host memory), as copy(); src may be reused as soon as this returns.
  void upload(const Tensor& dst, const Tensor& src);

 private:
  static constexpr int ring = 2;
  Buffer staging_[ring];
  void* events_[ring] = {};  // each staging buffer's last copy (CUDA events)
  int next_ = 0;
};

/// Binds this process to GPU (local_rank mod the number of GPUs) before any CUDA work; returns
/// its index. RuntimeError in a build without CUDA.
int use_cuda_device(int local_rank);

/// Sets every element of t to zero.
void zero(const Tensor& t);

/// Device memory of this process's current GPU: bytes held by our buffers (now and at most so
/// far) and in use on the whole device (buffers, library workspaces, the CUDA context). All zero
/// in a build without CUDA or before any device buffer exists.
struct DeviceMemoryUse {
  std::int64_t buffers = 0, buffers_peak = 0, device_used = 0, device_total = 0;
};
DeviceMemoryUse device_memory_use();

}  // namespace llmtrain::ops
