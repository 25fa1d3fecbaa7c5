// Element types and 128-bit memory access for the kernels (device code; include from .cu only).
// The kernels are templates on the storage type, named Elem there (T is time), float now and
// __nv_bfloat16 to come; they compute, and accumulate, in float. A Chunk<T, W> is W consecutive
// elements moved as one access: with W * sizeof(T) == 16 it compiles to one 128-bit load or
// store (LDG.128 / STG.128), which needs the address 16-byte aligned; launchers check that with
// aligned16() and otherwise run the same kernel with W = 1.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>

namespace llmtrain::cuda {

/// Elements per 128-bit access.
template <class T>
inline constexpr int vec_width = 16 / int(sizeof(T));

template <class T, int W>
struct alignas(sizeof(T) * W) Chunk {
  static_assert(W > 0 && (W & (W - 1)) == 0, "a Chunk holds a power of two of elements");
  static_assert(sizeof(T) * W <= 16, "a Chunk is at most one 128-bit access");
  T e[W];
};

/// p must be aligned to sizeof(T) * W bytes.
template <int W, class T>
__device__ __forceinline__ Chunk<T, W> load_chunk(const T* p) {
  return *reinterpret_cast<const Chunk<T, W>*>(p);
}
template <int W, class T>
__device__ __forceinline__ void store_chunk(T* p, const Chunk<T, W>& chunk) {
  *reinterpret_cast<Chunk<T, W>*>(p) = chunk;
}

/// Storage type <-> float (the compute type). A bf16 build adds overloads for __nv_bfloat16.
__device__ __forceinline__ float to_float(float x) {
  return x;
}
template <class T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}

/// True when every pointer is 16-byte aligned (null pointers pass: absent arguments).
inline bool aligned16(std::initializer_list<const void*> pointers) {
  for (const void* p : pointers) {
    if (reinterpret_cast<std::uintptr_t>(p) % 16 != 0) return false;
  }
  return true;
}

}  // namespace llmtrain::cuda
