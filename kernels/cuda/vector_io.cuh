// Element types and 128-bit memory access for the kernels (device code; include from .cu only).
// The kernels are templates on the storage type, named Elem there (T is time), float or
// __nv_bfloat16; they compute, and accumulate, in float. A Chunk<T, W> is W consecutive
// elements moved as one access: with W * sizeof(T) == 16 it compiles to one 128-bit load or
// store (LDG.128 / STG.128), which needs the address 16-byte aligned; launchers check that with
// aligned16() and otherwise run the same kernel with W = 1.
#pragma once

#include <cuda_bf16.h>
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

/// Storage type <-> float (the compute type). bf16 widens exactly; float -> bf16 rounds to
/// nearest even (NaN stays NaN, overflow gives +-inf), as torch's .to(torch.bfloat16).
__device__ __forceinline__ float to_float(float x) {
  return x;
}
__device__ __forceinline__ float to_float(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
template <class T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

/// W consecutive elements at p, as floats, in accesses of at most 16 bytes: a W wider than one
/// 128-bit access of T (8 floats next to 8 bf16 in a mixed-precision kernel) takes several.
/// p must be aligned to min(16, W * sizeof(T)) bytes.
template <int W, class T>
__device__ __forceinline__ void load_floats(const T* p, float (&out)[W]) {
  constexpr int A = W < vec_width<T> ? W : vec_width<T>;  // elements per access
  static_assert(W % A == 0, "W is a power of two, and so is A");
#pragma unroll
  for (int a = 0; a < W; a += A) {
    const Chunk<T, A> chunk = load_chunk<A>(p + a);
#pragma unroll
    for (int k = 0; k < A; ++k) out[a + k] = to_float(chunk.e[k]);
  }
}
/// Stores W floats at p as T (rounded to nearest even for bf16); alignment as load_floats.
template <int W, class T>
__device__ __forceinline__ void store_floats(T* p, const float (&in)[W]) {
  constexpr int A = W < vec_width<T> ? W : vec_width<T>;
  static_assert(W % A == 0, "W is a power of two, and so is A");
#pragma unroll
  for (int a = 0; a < W; a += A) {
    Chunk<T, A> chunk;
#pragma unroll
    for (int k = 0; k < A; ++k) chunk.e[k] = from_float<T>(in[a + k]);
    store_chunk<A>(p + a, chunk);
  }
}

/// True when every pointer is 16-byte aligned (null pointers pass: absent arguments).
inline bool aligned16(std::initializer_list<const void*> pointers) {
  for (const void* p : pointers) {
    if (reinterpret_cast<std::uintptr_t>(p) % 16 != 0) return false;
  }
  return true;
}

}  // namespace llmtrain::cuda
