// Each op's CUDA kernel is one template on the element type of its activations
// (llmtrain/kernels/cuda.h); its .cu file defines the template and instantiates it, with this
// macro, for the two element types the library supports.
#pragma once

#include <cuda_bf16.h>

/// Instantiates the op template `name` (declared in cuda.h) for float and bf16 activations.
#define LLMTRAIN_INSTANTIATE_ACTIVATIONS(name) \
  template decltype(name<float>) name<float>;  \
  template decltype(name<__nv_bfloat16>) name<__nv_bfloat16>;
