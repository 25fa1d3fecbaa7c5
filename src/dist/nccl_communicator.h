// NCCL communicator for device memory (CUDA builds only).
#pragma once

#include <memory>

#include "dist/communicator.h"

namespace llmtrain::dist {

/// A communicator over the same ranks as `host` (which sends NCCL's unique id from rank 0), on
/// CUDA device `device`; every buffer passed to it must be device memory. `host` must outlive it.
std::unique_ptr<Communicator> make_nccl_communicator(Communicator& host, int device, double timeout_s);

}  // namespace llmtrain::dist
