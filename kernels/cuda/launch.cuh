// Launch helpers shared by the kernels: grid sizes and stream-ordered scratch memory.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "cuda_check.h"

namespace llmtrain::cuda {

constexpr int warp_size = 32;

/// Blocks for `work` items at `block` threads each, capped: the kernels using it stride over
/// the rest (65535 blocks of 256 threads fill any current GPU many times over).
inline unsigned grid_for(std::int64_t work, int block, std::int64_t max_blocks = 65535) {
  return static_cast<unsigned>(std::clamp<std::int64_t>((work + block - 1) / block, 1, max_blocks));
}

/// Device memory for one call's temporaries, allocated and freed in `stream`'s order from the
/// device's memory pool (kept between calls: see compute_stream()), so it costs no
/// synchronisation; freed when the object goes out of scope, after the work queued before then.
class StreamScratch {
 public:
  StreamScratch(std::size_t bytes, cudaStream_t stream) : stream_(stream) {
    if (bytes > 0) LLMTRAIN_CUDA_CHECK(cudaMallocAsync(&data_, bytes, stream));
  }
  ~StreamScratch() {
    if (data_) cudaFreeAsync(data_, stream_);
  }
  StreamScratch(const StreamScratch&) = delete;
  StreamScratch& operator=(const StreamScratch&) = delete;

  /// The scratch space from byte `offset` (keep offsets 256-byte aligned) as a T*.
  template <class T>
  T* at(std::size_t offset = 0) const {
    return reinterpret_cast<T*>(static_cast<char*>(data_) + offset);
  }

 private:
  void* data_ = nullptr;
  cudaStream_t stream_;
};

/// `bytes` rounded up to a multiple of 256, to lay several arrays out in one scratch buffer.
constexpr std::size_t round_up_256(std::size_t bytes) {
  return (bytes + 255) / 256 * 256;
}

}  // namespace llmtrain::cuda
