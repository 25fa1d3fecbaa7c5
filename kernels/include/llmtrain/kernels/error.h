// The one error the kernel library throws: a kernel that cannot run the arguments it was given
// (a shape outside its limits, a CUDA, cuBLASLt or cuDNN call that failed). The library includes
// nothing of the program above it, so the op layer (src/ops) turns this into the program's own
// error, naming the op.
#pragma once

#include <stdexcept>
#include <string>

namespace llmtrain::kernels {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

}  // namespace llmtrain::kernels
