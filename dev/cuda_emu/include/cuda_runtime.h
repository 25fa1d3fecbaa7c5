// cuda_runtime.h for the CPU emulation: the runtime API plus device code (llmtrain_emu/device.h)
// and launches (llmtrain_emu/launch.h). nvcc includes it in every .cu file; the emulated build
// does the same with -include.
#pragma once

#include "cuda_runtime_api.h"
#include "llmtrain_emu/device.h"
#include "llmtrain_emu/launch.h"

template <class T>
cudaError_t cudaFuncSetAttribute(T* function, cudaFuncAttribute attr, int value) {
  return cudaFuncSetAttribute(llmtrain_emu::function_id(function), attr, value);
}
template <class T>
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attributes, T* function) {
  return cudaFuncGetAttributes(attributes, llmtrain_emu::function_id(function));
}
template <class T>
cudaError_t cudaMalloc(T** pointer, std::size_t bytes) {
  return cudaMalloc(reinterpret_cast<void**>(pointer), bytes);
}
template <class T>
cudaError_t cudaMallocAsync(T** pointer, std::size_t bytes, cudaStream_t stream) {
  return cudaMallocAsync(reinterpret_cast<void**>(pointer), bytes, stream);
}
