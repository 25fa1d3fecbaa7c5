// The compute stream. A function-local static: created once, thread-safe, on first use.
#include <cstdint>

#include "device/cuda_check.h"
#include "device/stream.h"

namespace llmtrain::device {
namespace {

cudaStream_t create_compute_stream() {
  cudaStream_t stream = nullptr;
  LLMTRAIN_DEVICE_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // The kernels allocate small scratch buffers (sort keys, per-block partials) with
  // cudaMallocAsync on every call. With the pool's default release threshold (0) the memory
  // goes back to the OS at each synchronisation and the next call maps it again; keeping it
  // makes those allocations a free-list lookup.
  int device = 0;
  LLMTRAIN_DEVICE_CHECK(cudaGetDevice(&device));
  cudaMemPool_t pool = nullptr;
  LLMTRAIN_DEVICE_CHECK(cudaDeviceGetDefaultMemPool(&pool, device));
  std::uint64_t keep = UINT64_MAX;
  LLMTRAIN_DEVICE_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
  return stream;
}

}  // namespace

cudaStream_t compute_stream() {
  static const cudaStream_t stream = create_compute_stream();
  return stream;
}

}  // namespace llmtrain::device
