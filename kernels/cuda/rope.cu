// Rotary position embedding (rotate_half layout). The angles (pos0 + t) theta^(-2i/HS) reach
// thousands of radians, where a float angle is off by ~1e-3 rad; so, as on the CPU, they are
// formed and turned into cos/sin in double, once per call into a (T, HS/2) table (a small kernel:
// T * HS/2 sincos), which the rotation kernel reads (L2-resident). The rotation handles W
// consecutive pairs per thread (128-bit loads of x[i..], x[i+HS/2..] and the table) when HS/2 is
// a multiple of the vector width and the pointers are aligned. Heads from n_rot on (the value
// heads of a packed qkv) pass through. bf16: the same kernels on bf16 activations, fp32
// arithmetic; the table stays fp32 (two 128-bit loads per 8 pairs). CPU reference:
// kernels/cpu/rope.cpp.
#include "cuda_check.h"
#include "instantiate.cuh"
#include "launch.cuh"
#include "llmtrain/kernels/cuda.h"
#include "vector_io.cuh"

namespace llmtrain::cuda {
namespace {

__global__ void rope_table_kernel(float* cosines /* (T, HS/2) */, float* sines /* (T, HS/2) */, int T, int HS,
                                  int pos0, float theta) {
  const int half = HS / 2;
  const std::int64_t total = std::int64_t(T) * half;
  const std::int64_t stride = std::int64_t(gridDim.x) * blockDim.x;
  for (std::int64_t idx = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < total; idx += stride) {
    const int t = int(idx / half), i = int(idx % half);
    // The CPU reference's expression, in double.
    const double angle = double(pos0 + t) * pow(double(theta), -2.0 * i / HS);
    double s = 0.0, c = 0.0;
    sincos(angle, &s, &c);
    cosines[idx] = float(c);
    sines[idx] = float(s);
  }
}

// Turns each pair (x_i, x_{i+HS/2}) of heads h < n_rot by +angle (direction 1) or -angle (-1,
// the transpose), W pairs per thread; heads from n_rot on go through the same formula with
// cos 1, sin 0, as on the CPU. Stores, or adds into out.
template <class Elem, int W, bool Accumulate>
__global__ void rope_kernel(Elem* out /* (B,T,H,HS) */, const Elem* inp /* (B,T,H,HS) */,
                            const float* cosines /* (T, HS/2) */, const float* sines /* (T, HS/2) */,
                            std::int64_t heads /* B T H */, int T, int H, int HS, int n_rot,
                            float direction) {
  const int half = HS / 2;
  const int chunks_per_head = half / W;
  const std::int64_t total = heads * chunks_per_head;
  const std::int64_t stride = std::int64_t(gridDim.x) * blockDim.x;
  for (std::int64_t idx = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < total; idx += stride) {
    const std::int64_t head = idx / chunks_per_head;  // (b, t, h) flattened
    const int i = int(idx % chunks_per_head) * W;
    const int t = int((head / H) % T);
    const bool rotate = int(head % H) < n_rot;
    const std::int64_t base = head * HS;
    const Chunk<Elem, W> x1 = load_chunk<W>(inp + base + i), x2 = load_chunk<W>(inp + base + half + i);
    float cv[W], sv[W];
    if (rotate) {
      load_floats<W>(cosines + std::int64_t(t) * half + i, cv);
      load_floats<W>(sines + std::int64_t(t) * half + i, sv);
    } else {
#pragma unroll
      for (int k = 0; k < W; ++k) {
        cv[k] = 1.0f;
        sv[k] = 0.0f;
      }
    }
    Chunk<Elem, W> y1, y2;
    if constexpr (Accumulate) {
      y1 = load_chunk<W>(out + base + i);
      y2 = load_chunk<W>(out + base + half + i);
    }
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const float c = cv[k], s = direction * sv[k];
      const float a = to_float(x1.e[k]), b = to_float(x2.e[k]);
      float r1 = a * c - b * s, r2 = b * c + a * s;
      if constexpr (Accumulate) {
        r1 += to_float(y1.e[k]);
        r2 += to_float(y2.e[k]);
      }
      y1.e[k] = from_float<Elem>(r1);
      y2.e[k] = from_float<Elem>(r2);
    }
    store_chunk<W>(out + base + i, y1);
    store_chunk<W>(out + base + half + i, y2);
  }
}

template <bool Accumulate, class Elem>
void rope_apply(Elem* out, const Elem* inp, int B, int T, int H, int HS, int n_rot, int pos0, float theta,
                float direction, cudaStream_t stream) {
  const int half = HS / 2;
  const std::int64_t heads = std::int64_t(B) * T * H;
  if (heads == 0 || half == 0) return;
  constexpr int block = 256;
  const std::size_t table_bytes = round_up_256(std::size_t(T) * half * sizeof(float));
  const StreamScratch table(2 * table_bytes, stream);
  float* cosines = table.at<float>();
  float* sines = table.at<float>(table_bytes);
  rope_table_kernel<<<grid_for(std::int64_t(T) * half, block), block, 0, stream>>>(cosines, sines, T, HS,
                                                                                   pos0, theta);
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
  constexpr int V = vec_width<Elem>;
  if (half % V == 0 && aligned16({out, inp})) {
    rope_kernel<Elem, V, Accumulate><<<grid_for(heads * (half / V), block), block, 0, stream>>>(
        out, inp, cosines, sines, heads, T, H, HS, n_rot, direction);
  } else {
    rope_kernel<Elem, 1, Accumulate><<<grid_for(heads * half, block), block, 0, stream>>>(
        out, inp, cosines, sines, heads, T, H, HS, n_rot, direction);
  }
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

template <class Act>
void rope_forward(Act* out, const Act* inp, int B, int T, int H, int HS, int n_rot, int pos0, float theta,
                  cudaStream_t stream) {
  rope_apply<false>(out, inp, B, T, H, HS, n_rot, pos0, theta, 1.0f, stream);
}
LLMTRAIN_INSTANTIATE_ACTIVATIONS(rope_forward)

template <class Act>
void rope_backward(Act* dinp, const Act* dout, int B, int T, int H, int HS, int n_rot, int pos0, float theta,
                   cudaStream_t stream) {
  rope_apply<true>(dinp, dout, B, T, H, HS, n_rot, pos0, theta, -1.0f, stream);
}
LLMTRAIN_INSTANTIATE_ACTIVATIONS(rope_backward)

}  // namespace llmtrain::cuda
