// Kernel launches in the CPU emulation. preprocess_cuda.py rewrites
//   kernel<<<grid, block, shared_bytes, stream>>>(args...)
// into
//   ::llmtrain_emu::launch("kernel", __FILE__, __LINE__, ::llmtrain_emu::LaunchConfig(grid, block,
//       shared_bytes, stream), [&](auto&&... a) { kernel(a...); }, args...)
// The arguments are evaluated once and copied, as CUDA copies them into the parameter space;
// each emulated thread then calls the kernel with its own copies (by-value parameters may be
// modified per thread). The lambda keeps template argument deduction exactly as in the
// original call (kernel<K><<<...>>>(value) deduces the rest from `value`).
#pragma once

#include <cstddef>
#include <tuple>
#include <type_traits>
#include <utility>

#include "cuda_runtime_api.h"

namespace llmtrain_emu {

struct LaunchConfig {
  dim3 grid, block;
  std::size_t shared_bytes;
  cudaStream_t stream;
  LaunchConfig(dim3 g, dim3 b, std::size_t s = 0, cudaStream_t st = nullptr)
      : grid(g), block(b), shared_bytes(s), stream(st) {}
};

/// Runs every thread of the grid: body(closure) in each, with the index variables set; sets the
/// calling thread's last error (cudaGetLastError) on a failed launch.
void run_grid(const LaunchConfig& config, const char* kernel_text, const char* file, int line,
              void (*body)(void* closure), void* closure);

/// False (after printing why) when a non-null pointer argument is not inside device memory.
bool check_pointer_argument(const void* pointer, int index, const char* kernel_text, const char* file, int line);
/// Records a failed launch (cudaGetLastError returns `status`).
void fail_launch(cudaError_t status);

template <class Call, class... Args>
void launch(const char* kernel_text, const char* file, int line, const LaunchConfig& config, Call call,
            Args&&... args) {
  struct Closure {
    Call call;
    std::tuple<std::decay_t<Args>...> params;
  };
  Closure closure{call, std::tuple<std::decay_t<Args>...>(std::forward<Args>(args)...)};
  bool ok = true;
  int index = 0;
  std::apply(
      [&](const auto&... p) {
        (
            [&](const auto& param) {
              using P = std::decay_t<decltype(param)>;
              if constexpr (std::is_pointer_v<P> && !std::is_function_v<std::remove_pointer_t<P>>) {
                if (!check_pointer_argument((const void*)param, index, kernel_text, file, line))
                  ok = false;
              }
              ++index;
            }(p),
            ...);
      },
      closure.params);
  if (!ok) {
    fail_launch(cudaErrorInvalidValue);
    return;
  }
  run_grid(
      config, kernel_text, file, line,
      [](void* c) {
        auto* cl = static_cast<Closure*>(c);
        std::apply(cl->call, cl->params);
      },
      &closure);
}

}  // namespace llmtrain_emu
