// Device-side CUDA for the CPU emulation: the execution space qualifiers (no-ops), the
// built-in index variables, __syncthreads, warp shuffles and votes, atomics, the intrinsics and
// math functions the kernels use, and the hooks that the source rewriting
// (dev/cuda_emu/preprocess_cuda.py) inserts: per-block __shared__ storage and the kernel-entry
// check. Each CUDA thread runs as its own fiber (runtime/scheduler.cpp); the index variables
// are thread_local to the OS thread running a block and are set before each fiber switch.
#pragma once

#include <math.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "llmtrain_emu/vector_types.h"

#define __global__
#define __device__
#define __host__
#define __noinline__ __attribute__((noinline))
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __constant__
#define __managed__
#define __grid_constant__
// Every __shared__ declaration must have been rewritten by preprocess_cuda.py; one that was not
// (a header outside kernels/cuda/?) fails to compile here, naming this macro.
#define __shared__ LLMTRAIN_EMU_SHARED_DECLARATION_NOT_REWRITTEN_BY_PREPROCESS_CUDA_PY
// Kernels test this to use the emulator's versions of instructions written as inline PTX on the
// GPU (kernels/cuda/mma.cuh: mma.sync, ldmatrix, cp.async).
#define LLMTRAIN_CUDA_EMU 1

inline thread_local uint3 threadIdx{0, 0, 0};
inline thread_local uint3 blockIdx{0, 0, 0};
inline thread_local dim3 blockDim{1, 1, 1};
inline thread_local dim3 gridDim{1, 1, 1};
inline constexpr int warpSize = 32;

namespace llmtrain_emu {

enum class WarpOp : int { sync, shfl_idx, shfl_up, shfl_down, shfl_xor, ballot, any, all, match_any, matrix };

/// The collective step of a warp: waits until every lane of `mask` has called it with the same
/// op, mask and width, then returns this lane's result (a shuffled value, a ballot...).
std::uint64_t warp_collective(WarpOp op, unsigned mask, std::uint64_t value, int param, int width);
/// __syncthreads: waits for every (non-exited) thread of the block; returns the number of
/// threads that passed a nonzero predicate, and the number that arrived in *arrived.
int block_barrier(int predicate, int* arrived);
/// Per-block storage of `bytes` for the __shared__ declaration identified by `tag`: the same
/// storage for every thread of the block, filled with 0xFF bytes (NaN) when the block starts.
void* block_shared_storage(const void* tag, std::size_t bytes, std::size_t alignment);
/// The block's dynamic shared memory (the launch's third parameter), 0xFF-filled.
void* dynamic_shared_storage();
/// First statement of every kernel (inserted by preprocess_cuda.py): checks the launch against
/// the kernel's __launch_bounds__ and its cudaFuncSetAttribute opt-in, once per block.
void kernel_entry(const void* function, const char* pretty_name, unsigned max_threads_per_block);
/// Stops the block as a device-side fault (sticky error), with a message.
[[noreturn]] void device_trap(const char* what);

/// A function's address as an untyped id (function pointers do not convert to void*).
template <class F>
const void* function_id(F* function) {
  static_assert(sizeof(function) == sizeof(void*), "function pointers must be pointer-sized");
  const void* id = nullptr;
  std::memcpy(&id, &function, sizeof id);
  return id;
}

template <class T>
T& block_shared(const void* tag) {
  static_assert(std::is_trivially_destructible_v<std::remove_all_extents_t<T>>,
                "__shared__ variables must be of trivial types");
  return *static_cast<T*>(block_shared_storage(tag, sizeof(T), alignof(T) < 16 ? 16 : alignof(T)));
}

template <class T>
T* dynamic_shared() {
  return static_cast<T*>(dynamic_shared_storage());
}

template <class T>
std::uint64_t to_bits(const T& value) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "warp shuffles move at most 8 bytes");
  std::uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  return bits;
}
template <class T>
T from_bits(std::uint64_t bits) {
  T value;
  std::memcpy(&value, &bits, sizeof(T));
  return value;
}

}  // namespace llmtrain_emu

// ---- tensor-core matrix instructions and cp.async (the PTX that kernels/cuda/mma.cuh wraps) -----

namespace llmtrain_emu {

enum class MatrixKind : int { mma_m16n8k16_bf16 = 1, ldmatrix = 2 };

/// One lane's part of a warp-wide matrix instruction: what it brings (registers, a row address)
/// and, after warp_matrix returns, what it receives. The scheduler assembles the whole operands
/// from the 32 lanes by the PTX ISA's fragment layouts (runtime/scheduler.cpp, complete_matrix).
struct MatrixLane {
  MatrixKind kind = MatrixKind::mma_m16n8k16_bf16;
  int count = 0;       // ldmatrix: number of 8x8 matrices (1, 2 or 4)
  bool trans = false;  // ldmatrix .trans
  const void* address = nullptr;  // ldmatrix: the row this lane names
  std::uint32_t a[4] = {}, b[2] = {};  // mma: bf16 pairs, lower column/row in the low half
  float c[4] = {};
  std::uint32_t out[4] = {};  // ldmatrix: the fragments received
  float d[4] = {};            // mma: the result
};

/// The warp collective of a matrix instruction: every lane of the (full) warp must arrive with the
/// same kind; faults on misaligned or non-shared ldmatrix rows.
inline void warp_matrix(MatrixLane& lane) {
  warp_collective(WarpOp::matrix, 0xffffffffu, std::uint64_t(reinterpret_cast<std::uintptr_t>(&lane)),
                  int(lane.kind), warpSize);
}

/// cp.async.cg.shared.global with 16 bytes, done synchronously (commit and wait are no-ops): `dst`
/// must be 16-byte aligned shared memory of the block and `src` 16-byte aligned device memory
/// (faults otherwise); src_bytes < 16 copies that many bytes and zero-fills the rest.
void cp_async_16(void* dst, const void* src, int src_bytes);

}  // namespace llmtrain_emu

// ---- synchronisation, warp shuffles and votes -------------------------------------------------

inline void __syncthreads() { llmtrain_emu::block_barrier(0, nullptr); }
inline int __syncthreads_count(int predicate) { return llmtrain_emu::block_barrier(predicate != 0, nullptr); }
inline int __syncthreads_and(int predicate) {
  int arrived = 0;
  return llmtrain_emu::block_barrier(predicate != 0, &arrived) == arrived;
}
inline int __syncthreads_or(int predicate) { return llmtrain_emu::block_barrier(predicate != 0, nullptr) > 0; }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  llmtrain_emu::warp_collective(llmtrain_emu::WarpOp::sync, mask, 0, 0, warpSize);
}

template <class T>
T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize) {
  return llmtrain_emu::from_bits<T>(llmtrain_emu::warp_collective(llmtrain_emu::WarpOp::shfl_idx, mask,
                                                                  llmtrain_emu::to_bits(var), src_lane, width));
}
template <class T>
T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
  return llmtrain_emu::from_bits<T>(llmtrain_emu::warp_collective(llmtrain_emu::WarpOp::shfl_up, mask,
                                                                  llmtrain_emu::to_bits(var), int(delta), width));
}
template <class T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
  return llmtrain_emu::from_bits<T>(llmtrain_emu::warp_collective(llmtrain_emu::WarpOp::shfl_down, mask,
                                                                  llmtrain_emu::to_bits(var), int(delta), width));
}
template <class T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize) {
  return llmtrain_emu::from_bits<T>(llmtrain_emu::warp_collective(llmtrain_emu::WarpOp::shfl_xor, mask,
                                                                  llmtrain_emu::to_bits(var), lane_mask, width));
}
inline unsigned __ballot_sync(unsigned mask, int predicate) {
  return unsigned(llmtrain_emu::warp_collective(llmtrain_emu::WarpOp::ballot, mask, predicate != 0, 0, warpSize));
}
inline int __any_sync(unsigned mask, int predicate) {
  return int(llmtrain_emu::warp_collective(llmtrain_emu::WarpOp::any, mask, predicate != 0, 0, warpSize));
}
inline int __all_sync(unsigned mask, int predicate) {
  return int(llmtrain_emu::warp_collective(llmtrain_emu::WarpOp::all, mask, predicate != 0, 0, warpSize));
}
template <class T>
unsigned __match_any_sync(unsigned mask, T value) {
  return unsigned(llmtrain_emu::warp_collective(llmtrain_emu::WarpOp::match_any, mask,
                                                llmtrain_emu::to_bits(value), 0, warpSize));
}
/// The lanes of this thread's warp that have not exited.
unsigned __activemask();

inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_system() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
[[noreturn]] inline void __trap() { llmtrain_emu::device_trap("__trap()"); }
inline void __nanosleep(unsigned) {}
long long clock64();

template <class T>
T __ldg(const T* p) {
  return *p;
}
template <class T>
T __ldcs(const T* p) {
  return *p;
}
template <class T>
T __ldcg(const T* p) {
  return *p;
}
template <class T>
void __stcs(T* p, T v) {
  *p = v;
}
template <class T>
void __stcg(T* p, T v) {
  *p = v;
}

// ---- atomics (real atomics: blocks may run on several OS threads) ---------------------------

template <class T>
T llmtrain_emu_atomic_rmw(T* address, T (*op)(T, T), T value) {
  T old;
  __atomic_load(address, &old, __ATOMIC_RELAXED);
  T desired;
  do {
    desired = op(old, value);
  } while (!__atomic_compare_exchange(address, &old, &desired, false, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED));
  return old;
}
inline int atomicAdd(int* a, int v) { return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicAdd(unsigned* a, unsigned v) { return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST); }
inline unsigned long long atomicAdd(unsigned long long* a, unsigned long long v) {
  return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST);
}
inline float atomicAdd(float* a, float v) {
  return llmtrain_emu_atomic_rmw<float>(a, [](float x, float y) { return x + y; }, v);
}
inline double atomicAdd(double* a, double v) {
  return llmtrain_emu_atomic_rmw<double>(a, [](double x, double y) { return x + y; }, v);
}
inline int atomicSub(int* a, int v) { return __atomic_fetch_sub(a, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicSub(unsigned* a, unsigned v) { return __atomic_fetch_sub(a, v, __ATOMIC_SEQ_CST); }
inline int atomicExch(int* a, int v) { return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicExch(unsigned* a, unsigned v) { return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST); }
inline float atomicExch(float* a, float v) {
  float old;
  __atomic_exchange(a, &v, &old, __ATOMIC_SEQ_CST);
  return old;
}
inline int atomicMax(int* a, int v) {
  return llmtrain_emu_atomic_rmw<int>(a, [](int x, int y) { return x > y ? x : y; }, v);
}
inline unsigned atomicMax(unsigned* a, unsigned v) {
  return llmtrain_emu_atomic_rmw<unsigned>(a, [](unsigned x, unsigned y) { return x > y ? x : y; }, v);
}
inline int atomicMin(int* a, int v) {
  return llmtrain_emu_atomic_rmw<int>(a, [](int x, int y) { return x < y ? x : y; }, v);
}
inline unsigned atomicMin(unsigned* a, unsigned v) {
  return llmtrain_emu_atomic_rmw<unsigned>(a, [](unsigned x, unsigned y) { return x < y ? x : y; }, v);
}
inline int atomicAnd(int* a, int v) { return __atomic_fetch_and(a, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicAnd(unsigned* a, unsigned v) { return __atomic_fetch_and(a, v, __ATOMIC_SEQ_CST); }
inline int atomicOr(int* a, int v) { return __atomic_fetch_or(a, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicOr(unsigned* a, unsigned v) { return __atomic_fetch_or(a, v, __ATOMIC_SEQ_CST); }
inline int atomicXor(int* a, int v) { return __atomic_fetch_xor(a, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicXor(unsigned* a, unsigned v) { return __atomic_fetch_xor(a, v, __ATOMIC_SEQ_CST); }
template <class T>
T llmtrain_emu_atomic_cas(T* a, T compare, T value) {
  __atomic_compare_exchange_n(a, &compare, value, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return compare;  // the old value either way
}
inline int atomicCAS(int* a, int c, int v) { return llmtrain_emu_atomic_cas(a, c, v); }
inline unsigned atomicCAS(unsigned* a, unsigned c, unsigned v) { return llmtrain_emu_atomic_cas(a, c, v); }
inline unsigned long long atomicCAS(unsigned long long* a, unsigned long long c, unsigned long long v) {
  return llmtrain_emu_atomic_cas(a, c, v);
}

// ---- integer and bit intrinsics ----------------------------------------------------------------

inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(unsigned(x)); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll((unsigned long long)x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned __brev(unsigned x) {
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
  return r;
}
inline int __mul24(int a, int b) { return a * b; }
inline int __umul24(unsigned a, unsigned b) { return int(a * b); }
inline int __mulhi(int a, int b) { return int((long long)a * b >> 32); }
inline unsigned __umulhi(unsigned a, unsigned b) { return unsigned((unsigned long long)a * b >> 32); }
inline float __int_as_float(int x) { return llmtrain_emu::from_bits<float>(std::uint32_t(x)); }
inline int __float_as_int(float x) { return int(std::uint32_t(llmtrain_emu::to_bits(x))); }
inline float __uint_as_float(unsigned x) { return llmtrain_emu::from_bits<float>(x); }
inline unsigned __float_as_uint(float x) { return unsigned(llmtrain_emu::to_bits(x)); }
inline double __longlong_as_double(long long x) { return llmtrain_emu::from_bits<double>(std::uint64_t(x)); }
inline long long __double_as_longlong(double x) { return (long long)llmtrain_emu::to_bits(x); }

// CUDA's min and max overloads (global functions in device code).
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline unsigned min(int a, unsigned b) { return min(unsigned(a), b); }
inline unsigned max(int a, unsigned b) { return max(unsigned(a), b); }
inline unsigned min(unsigned a, int b) { return min(a, unsigned(b)); }
inline unsigned max(unsigned a, int b) { return max(a, unsigned(b)); }
inline long min(long a, long b) { return a < b ? a : b; }
inline long max(long a, long b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned long min(unsigned long a, unsigned long b) { return a < b ? a : b; }
inline unsigned long max(unsigned long a, unsigned long b) { return a > b ? a : b; }
inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }

// ---- floating-point intrinsics: the host's correctly rounded (or libm) versions ---------------
// The GPU's fast intrinsics (__expf, __fdividef...) have larger errors than these; results match
// the GPU's only to within the documented error bounds, not bit for bit.

inline float __expf(float x) { return expf(x); }
inline float __exp10f(float x) { return exp10f(x); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __log10f(float x) { return log10f(x); }
inline float __powf(float x, float y) { return powf(x, y); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __tanf(float x) { return tanf(x); }
inline void __sincosf(float x, float* s, float* c) { sincosf(x, s, c); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __frsqrt_rn(float x) { return 1.0f / sqrtf(x); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __fma_rn(double a, double b, double c) { return fma(a, b, c); }
inline float __saturatef(float x) { return x != x ? 0.0f : fminf(fmaxf(x, 0.0f), 1.0f); }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float rcbrtf(float x) { return 1.0f / cbrtf(x); }
inline float normcdff(float x) { return 0.5f * erfcf(-x * 0.70710678118654752f); }
inline int __float2int_rn(float x) { return int(nearbyintf(x)); }
inline int __float2int_rz(float x) { return int(x); }
inline unsigned __float2uint_rn(float x) { return unsigned(nearbyintf(x)); }
inline float __int2float_rn(int x) { return float(x); }
inline float __uint2float_rn(unsigned x) { return float(x); }
inline int __double2int_rn(double x) { return int(nearbyint(x)); }
inline float __double2float_rn(double x) { return float(x); }
