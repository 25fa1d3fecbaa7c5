// The stream the ops run on. It has a CUDA type, so it lives apart from runtime.h, which any
// part of the program may include.
#pragma once

#include <cuda_runtime_api.h>

namespace llmtrain::device {

/// The process-wide compute stream: created on first use on the current device (so a process
/// selects its GPU with cudaSetDevice before any op runs), non-blocking (it neither waits for
/// the legacy default stream nor makes it wait), never destroyed (the driver reclaims it at
/// exit). Every op in src/ops launches its kernels here; the copies of runtime.h are ordered
/// with it. Work on any other stream (NCCL's) must be ordered against it with events. Creating
/// it also makes the device's stream-ordered memory pool keep freed memory (the kernels take
/// their scratch space from that pool on every call).
cudaStream_t compute_stream();

}  // namespace llmtrain::device
