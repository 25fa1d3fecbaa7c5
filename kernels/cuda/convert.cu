// fp32 <-> bf16 conversion (the master weights to their bf16 working copy, bf16 results back to
// fp32). Memory-bound, one pass (elementwise_launch.cuh): each thread moves 8 elements, one
// 128-bit access of bf16 and two of fp32, when both pointers are 16-byte aligned. float -> bf16
// rounds to nearest even with __float2bfloat16_rn (NaN stays NaN, beyond the bf16 range +-inf);
// bf16 -> float is exact.
#include "cuda_check.h"
#include "elementwise_launch.cuh"
#include "llmtrain/kernels/cuda.h"
#include "vector_io.cuh"

namespace llmtrain::cuda {
namespace {

template <class Out, class In>
struct Convert {
  Out* out;      // (N)
  const In* in;  // (N)
  template <int W>
  __device__ void apply(std::int64_t i) const {
    float x[W];
    load_floats<W>(in + i, x);
    store_floats<W>(out + i, x);
  }
};

}  // namespace

// The launcher's vector width is bf16's (8) in both directions: the fp32 side takes two accesses.
template <class To, class From>
void convert(To* out, const From* in, std::int64_t N, cudaStream_t stream) {
  launch_elementwise<bf16>(Convert<To, From>{out, in}, N, aligned16({out, in}), stream);
}
template void convert<bf16, float>(bf16*, const float*, std::int64_t, cudaStream_t);
template void convert<float, bf16>(float*, const bf16*, std::int64_t, cudaStream_t);

}  // namespace llmtrain::cuda
