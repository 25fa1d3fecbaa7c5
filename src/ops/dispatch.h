// The op dispatcher: how every op of ops.h runs, written once.
//
// An op (src/ops/ops.cpp) validates its tensors through an `Op`, then hands `Op::run` its kernels
// (LLMTRAIN_KERNELS(name): cpu::name of llmtrain/kernels/cpu.h and cuda::name of
// llmtrain/kernels/cuda.h; LLMTRAIN_MATMUL_KERNELS(name) for the matmuls, whose CUDA kernels also
// take the op layer's cuBLASLt handle and workspace) and ONE description of the kernels' arguments:
// a generic lambda that maps the op's tensors through a view,
//
//     [&](auto v) { return std::tuple(v.out(out), v.f32(mean), v.in(inp), N, C); }
//
// where v.in(t) / v.out(t) are an activation tensor that the kernel reads / writes (or accumulates
// into), v.f32(t) a tensor that is f32 at every precision (weight gradients, statistics) and
// v.i32(t) token ids. `run` calls the lambda once with a probe that checks every tensor is on one
// device, then once more for the implementation that fits the device and the activation dtype:
//
//   cpu  f32   the reference on the tensors' data;
//   cpu  bf16  the reference on f32 copies of the bf16 tensors; outputs are rounded back to bf16
//              (nearest even) after the call: the f32 op's result rounded once, which is what the
//              CUDA kernels compute up to the order of their fp32 sums. A check of the mixed-precision
//              path, not a fast one;
//   cuda f32, cuda bf16   the kernel for float or __nv_bfloat16 pointers (cuda.h's templates are
//              defined for both), on the compute stream of src/device, and for a matmul with
//              matmul_blas() (an op without a kernel for that element type throws).
//
// Nothing here is seen by the model: it includes ops.h only.
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/tensor.h"
#include "llmtrain/kernels/error.h"
#include "ops/profile.h"
#if LLMTRAIN_HAVE_CUDA
#include "llmtrain/kernels/cuda.h"
#include "device/stream.h"
#endif

namespace llmtrain::ops::dispatch {

// ---- kernels --------------------------------------------------------------------------------------

/// Stands for a missing kernel (every CUDA kernel, in a build without CUDA).
struct NoKernel {};

template <class Cpu, class Cuda>
struct Kernels {
  Cpu cpu;
  Cuda cuda;
};

#if LLMTRAIN_HAVE_CUDA
/// The cuBLASLt handle and workspace (cuda::matmul_workspace_bytes) every op's matmul runs with:
/// made on first use on the current device, kept for the process (as the compute stream, whose
/// order the shared workspace relies on), never destroyed (the driver reclaims both at exit;
/// destroying them from a static destructor can run after the CUDA runtime has shut down).
const cuda::Blas& matmul_blas();
#endif

// Each kernel is wrapped in a generic lambda, so that a template or an overload set (fp32 and bf16)
// can be passed around and a kernel that does not take the arguments is detected
// (std::is_invocable) rather than a compile error.
#define LLMTRAIN_CPU_KERNEL(name) \
  [](auto... kernel_args) -> decltype(::llmtrain::cpu::name(kernel_args...)) { \
    return ::llmtrain::cpu::name(kernel_args...);                               \
  }
#if LLMTRAIN_HAVE_CUDA
#define LLMTRAIN_CUDA_KERNEL(name)                                                       \
  [](auto... kernel_args) -> decltype(::llmtrain::cuda::name(kernel_args..., cudaStream_t{})) { \
    return ::llmtrain::cuda::name(kernel_args..., ::llmtrain::device::compute_stream());        \
  }
#define LLMTRAIN_CUDA_MATMUL_KERNEL(name)                                                                 \
  [](auto... kernel_args)                                                                                 \
      -> decltype(::llmtrain::cuda::name(kernel_args..., ::llmtrain::cuda::Blas{}, cudaStream_t{})) {     \
    return ::llmtrain::cuda::name(kernel_args..., ::llmtrain::ops::dispatch::matmul_blas(),               \
                                  ::llmtrain::device::compute_stream());                                  \
  }
#else
#define LLMTRAIN_CUDA_KERNEL(name) ::llmtrain::ops::dispatch::NoKernel{}
#define LLMTRAIN_CUDA_MATMUL_KERNEL(name) ::llmtrain::ops::dispatch::NoKernel{}
#endif
/// The CPU reference and the CUDA kernel of one name.
#define LLMTRAIN_KERNELS(name) ::llmtrain::ops::dispatch::Kernels{LLMTRAIN_CPU_KERNEL(name), LLMTRAIN_CUDA_KERNEL(name)}
/// The same for a matmul: its CUDA kernel also takes matmul_blas().
#define LLMTRAIN_MATMUL_KERNELS(name) \
  ::llmtrain::ops::dispatch::Kernels{LLMTRAIN_CPU_KERNEL(name), LLMTRAIN_CUDA_MATMUL_KERNEL(name)}

// ---- views ----------------------------------------------------------------------------------------

/// The device of an op's tensors (those with data: an absent bias has none).
class Devices {
 public:
  explicit Devices(const char* op) : op_(op) {}
  /// Throws if `t` is on another device than the tensors seen before.
  void see(const Tensor& t);
  /// True when the tensors are on the GPU; throws if they are, in a build without CUDA.
  bool on_cuda() const;

 private:
  const char* op_;
  bool seen_ = false;  // a tensor with data; then its device:
  Device device_ = Device::cpu;
};

/// The view that only looks at the tensors' devices.
struct DeviceProbe {
  Devices* devices;
  std::nullptr_t in(const Tensor& t) const { return see(t); }
  std::nullptr_t out(const Tensor& t) const { return see(t); }
  std::nullptr_t f32(const Tensor& t) const { return see(t); }
  std::nullptr_t i32(const Tensor& t) const { return see(t); }
  std::nullptr_t see(const Tensor& t) const {
    devices->see(t);
    return nullptr;
  }
};

/// The tensors' own data, activations as `Act`.
template <class Act>
struct Direct {
  Act* in(const Tensor& t) const { return t.as<Act>(); }
  Act* out(const Tensor& t) const { return t.as<Act>(); }
  float* f32(const Tensor& t) const { return t.as<float>(); }
  std::int32_t* i32(const Tensor& t) const { return t.as<std::int32_t>(); }
};

/// f32 copies of bf16 tensors for the CPU reference; the outputs are rounded back into their
/// tensors when this object goes. Accumulated outputs (+=) work, as their values are copied in.
class Widened {
 public:
  Widened() = default;
  Widened(const Widened&) = delete;
  Widened& operator=(const Widened&) = delete;
  ~Widened();

  float* in(const Tensor& t) { return widen(t, false); }
  float* out(const Tensor& t) { return widen(t, true); }

 private:
  struct Copy {
    Tensor target;
    std::vector<float> values;
    bool output;
  };
  float* widen(const Tensor& t, bool output);
  std::deque<Copy> copies_;  // a deque keeps each copy's address as more are added
};

/// The view over a Widened (the argument lambda takes its view by value; Widened is not copyable).
struct WidenedRef {
  Widened* w;
  float* in(const Tensor& t) const { return w->in(t); }
  float* out(const Tensor& t) const { return w->out(t); }
  float* f32(const Tensor& t) const { return t.as<float>(); }
  std::int32_t* i32(const Tensor& t) const { return t.as<std::int32_t>(); }
};

// ---- the op ---------------------------------------------------------------------------------------

/// Whether F can be called with the elements of a std::tuple.
template <class F, class Tuple>
struct Applicable : std::false_type {};
template <class F, class... A>
struct Applicable<F, std::tuple<A...>> : std::is_invocable<const F&, A...> {};

/// One call of one op: its name (in errors and the profile) and its timer.
class Op {
 public:
  explicit Op(const char* name) : name_(name), timer_(name) {}

  /// The precision of the op's activations: f32, or bf16 for mixed precision; else throws.
  DType activation(const Tensor& t) const;
  /// Throws unless `t` has data of `dtype` and `shape` (a -1 matches any size).
  void expect(const char* arg, const Tensor& t, DType dtype, std::vector<std::int64_t> shape) const;
  /// Elementwise ops: throws unless every tensor has data of one dtype and size; returns the dtype
  /// (the first tensor's: f32, or bf16 unless `f32_only`).
  DType expect_same_size(std::initializer_list<const Tensor*> tensors, bool f32_only = false) const;
  /// Throws RuntimeError("ops::NAME: what").
  [[noreturn]] void fail(const std::string& what) const;
  /// True when the tensors (with data) are on the GPU; throws as Devices::on_cuda.
  bool on_cuda(std::initializer_list<const Tensor*> tensors) const;

  /// Runs `kernel_call` (a call into the kernel library), turning a kernel's error into this op's
  /// RuntimeError ("ops::NAME: what"): the library knows nothing of the program's errors.
  template <class F>
  decltype(auto) guarded(F&& kernel_call) const {
    try {
      return kernel_call();
    } catch (const kernels::Error& e) {
      fail(e.what());
    }
  }

  /// Runs the op's kernels on the arguments `args_of(view)` (see the top of this file); returns
  /// what the kernel returns.
  template <class K, class ArgsOf>
  decltype(auto) run(const K& kernels, DType act, ArgsOf&& args_of) const {
    static_assert(Applicable<decltype(kernels.cpu), decltype(args_of(Direct<float>{}))>::value,
                  "the CPU reference does not take these arguments");
    Devices devices(name_);
    args_of(DeviceProbe{&devices});
    if (devices.on_cuda()) {
      if constexpr (!std::is_same_v<std::decay_t<decltype(kernels.cuda)>, NoKernel>) {
#if LLMTRAIN_HAVE_CUDA
        if (act == DType::bf16) return call(kernels.cuda, args_of(Direct<cuda::bf16>{}), "bf16 CUDA");
        return call(kernels.cuda, args_of(Direct<float>{}), "f32 CUDA");
#endif
      }
      fail("no CUDA kernel");
    }
    if (act == DType::bf16) {
      Widened widened;
      return call(kernels.cpu, args_of(WidenedRef{&widened}), "bf16 CPU");
    }
    return call(kernels.cpu, args_of(Direct<float>{}), "f32 CPU");
  }

 private:
  // The kernel on these arguments, or an error when it has no overload for them (cuDNN has no f32
  // attention): the result type is then the CPU reference's, which every op's kernels share.
  template <class F, class Tuple>
  decltype(auto) call(const F& kernel, Tuple&& args, const char* dtype) const {
    if constexpr (Applicable<F, std::decay_t<Tuple>>::value) {
      return guarded([&]() -> decltype(auto) { return std::apply(kernel, std::forward<Tuple>(args)); });
    } else {
      fail(std::string("no ") + dtype + " kernel");
    }
  }

  const char* name_;
  OpTimer timer_;
};

inline int as_int(std::int64_t x) { return static_cast<int>(x); }

}  // namespace llmtrain::ops::dispatch
