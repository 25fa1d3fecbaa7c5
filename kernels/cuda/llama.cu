// The ops Llama adds to GPT-2's: RMSNorm, rotary embeddings (rotate_half layout), SwiGLU.
//  - RMSNorm: one warp per row, 8 rows per block, 128-bit loads when C % 4 == 0 and aligned;
//    float sums with warp shuffles; the weight gradient is a deterministic column sum
//    (reduce.cuh), as in layernorm.cu.
//  - RoPE: the angles (pos0 + t) theta^(-2i/HS) reach thousands of radians, where a float angle
//    is off by ~1e-3 rad; so, as on the CPU, they are formed and turned into cos/sin in double,
//    once per call into a (T, HS/2) table (a small kernel: T * HS/2 sincos), which the rotation
//    kernel reads (L2-resident). The rotation handles W consecutive pairs per thread (128-bit
//    loads of x[i..], x[i+HS/2..] and the table) when HS/2 % 4 == 0 and the pointers are
//    aligned. Heads from n_rot on (the value heads of a packed qkv) pass through.
//  - SwiGLU: elementwise (elementwise_launch.cuh), the CPU reference's formulas.
//  - bf16 (mixed precision): the same kernels on bf16 activations and weight (8 per 128-bit
//    access), fp32 rstd, arithmetic and weight gradient; the RoPE table stays fp32 (two 128-bit
//    loads per 8 pairs).
#include "cuda_check.h"
#include "elementwise_launch.cuh"
#include "launch.cuh"
#include "llmtrain/kernels/cuda.h"
#include "reduce.cuh"
#include "vector_io.cuh"

namespace llmtrain::cuda {
namespace {

constexpr int rows_per_block = 8;  // one warp each

unsigned row_blocks(std::int64_t N) {
  return unsigned((N + rows_per_block - 1) / rows_per_block);
}

// ---- RMSNorm ------------------------------------------------------------------------------------

template <class Elem, int W>
__global__ void rmsnorm_forward_kernel(Elem* out /* (N,C) */, float* rstd /* (N) */,
                                       const Elem* inp /* (N,C) */, const Elem* weight /* (C) */,
                                       std::int64_t N, int C, float eps) {
  const std::int64_t row = std::int64_t(blockIdx.x) * rows_per_block + threadIdx.x / warp_size;
  if (row >= N) return;  // the whole warp: the shuffles below always see 32 lanes
  const int lane = threadIdx.x % warp_size;
  const Elem* x = inp + row * C;
  float sum_squares = 0.0f;
  for (int c = lane * W; c < C; c += warp_size * W) {
    const Chunk<Elem, W> v = load_chunk<W>(x + c);
#pragma unroll
    for (int k = 0; k < W; ++k) sum_squares += to_float(v.e[k]) * to_float(v.e[k]);
  }
  const float s = 1.0f / sqrtf(warp_reduce(sum_squares, SumOp{}) / float(C) + eps);
  Elem* y = out + row * C;
  for (int c = lane * W; c < C; c += warp_size * W) {
    const Chunk<Elem, W> v = load_chunk<W>(x + c), w = load_chunk<W>(weight + c);
    Chunk<Elem, W> r;
#pragma unroll
    for (int k = 0; k < W; ++k) r.e[k] = from_float<Elem>(to_float(v.e[k]) * s * to_float(w.e[k]));
    store_chunk<W>(y + c, r);
  }
  if (lane == 0) rstd[row] = s;
}

// y = w n, n = x s: dx = s (w dy - n mean(w dy n)).
template <class Elem, int W>
__global__ void rmsnorm_backward_kernel(Elem* dinp /* (N,C) */, const Elem* dout /* (N,C) */,
                                        const Elem* inp /* (N,C) */, const Elem* weight /* (C) */,
                                        const float* rstd /* (N) */, std::int64_t N, int C) {
  const std::int64_t row = std::int64_t(blockIdx.x) * rows_per_block + threadIdx.x / warp_size;
  if (row >= N) return;  // the whole warp
  const int lane = threadIdx.x % warp_size;
  const Elem* x = inp + row * C;
  const Elem* dy = dout + row * C;
  const float s = rstd[row];
  float dot = 0.0f;
  for (int c = lane * W; c < C; c += warp_size * W) {
    const Chunk<Elem, W> xv = load_chunk<W>(x + c), gv = load_chunk<W>(dy + c),
                         wv = load_chunk<W>(weight + c);
#pragma unroll
    for (int k = 0; k < W; ++k) dot += to_float(wv.e[k]) * to_float(gv.e[k]) * to_float(xv.e[k]) * s;
  }
  dot = warp_reduce(dot, SumOp{}) / float(C);
  Elem* dx = dinp + row * C;
  for (int c = lane * W; c < C; c += warp_size * W) {
    const Chunk<Elem, W> xv = load_chunk<W>(x + c), gv = load_chunk<W>(dy + c),
                         wv = load_chunk<W>(weight + c);
    Chunk<Elem, W> r = load_chunk<W>(dx + c);
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const float g = s * (to_float(wv.e[k]) * to_float(gv.e[k]) - to_float(xv.e[k]) * s * dot);
      r.e[k] = from_float<Elem>(to_float(r.e[k]) + g);
    }
    store_chunk<W>(dx + c, r);
  }
}

// Per (row, channel): the weight gradient term x rstd dy.
template <class Elem>
struct RmsnormWeightGrad {
  const Elem* dout;   // (N,C)
  const Elem* inp;    // (N,C)
  const float* rstd;  // (N)
  int C;
  __device__ void operator()(std::int64_t i, int c, float (&v)[1]) const {
    const std::int64_t at = i * C + c;
    v[0] = to_float(inp[at]) * rstd[i] * to_float(dout[at]);
  }
};

// ---- RoPE -----------------------------------------------------------------------------------------

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

// ---- SwiGLU ---------------------------------------------------------------------------------------

template <class Elem>
struct SwigluForward {
  Elem* out;         // (N)
  const Elem* gate;  // (N)
  const Elem* up;    // (N)
  template <int W>
  __device__ void apply(std::int64_t i) const {
    const Chunk<Elem, W> g = load_chunk<W>(gate + i), u = load_chunk<W>(up + i);
    Chunk<Elem, W> y;
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const float x = to_float(g.e[k]);
      y.e[k] = from_float<Elem>(x / (1.0f + expf(-x)) * to_float(u.e[k]));
    }
    store_chunk<W>(out + i, y);
  }
};

template <class Elem>
struct SwigluBackward {
  Elem* dgate;       // (N)
  Elem* dup;         // (N)
  const Elem* dout;  // (N)
  const Elem* gate;  // (N)
  const Elem* up;    // (N)
  template <int W>
  __device__ void apply(std::int64_t i) const {
    const Chunk<Elem, W> dy = load_chunk<W>(dout + i), g = load_chunk<W>(gate + i), u = load_chunk<W>(up + i);
    float d_gate[W], d_up[W];
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const float x = to_float(g.e[k]);
      const float s = 1.0f / (1.0f + expf(-x));
      d_gate[k] = to_float(dy.e[k]) * to_float(u.e[k]) * s * (1.0f + x * (1.0f - s));
      d_up[k] = to_float(dy.e[k]) * (x * s);
    }
    Chunk<Elem, W> acc = load_chunk<W>(dgate + i);
#pragma unroll
    for (int k = 0; k < W; ++k) acc.e[k] = from_float<Elem>(to_float(acc.e[k]) + d_gate[k]);
    store_chunk<W>(dgate + i, acc);
    acc = load_chunk<W>(dup + i);  // after the store, as the CPU loop (dgate == dup adds both)
#pragma unroll
    for (int k = 0; k < W; ++k) acc.e[k] = from_float<Elem>(to_float(acc.e[k]) + d_up[k]);
    store_chunk<W>(dup + i, acc);
  }
};

template <class Elem>
void rmsnorm_forward_dispatch(Elem* out, float* rstd, const Elem* inp, const Elem* weight, std::int64_t N,
                              int C, float eps, cudaStream_t stream) {
  if (N <= 0) return;
  constexpr int block = rows_per_block * warp_size;
  if (C % vec_width<Elem> == 0 && aligned16({out, inp, weight})) {
    rmsnorm_forward_kernel<Elem, vec_width<Elem>>
        <<<row_blocks(N), block, 0, stream>>>(out, rstd, inp, weight, N, C, eps);
  } else {
    rmsnorm_forward_kernel<Elem, 1><<<row_blocks(N), block, 0, stream>>>(out, rstd, inp, weight, N, C, eps);
  }
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
}

template <class Elem>
void rmsnorm_backward_dispatch(Elem* dinp, float* dweight, const Elem* dout, const Elem* inp,
                               const Elem* weight, const float* rstd, std::int64_t N, int C,
                               cudaStream_t stream) {
  if (N <= 0) return;
  constexpr int block = rows_per_block * warp_size;
  if (C % vec_width<Elem> == 0 && aligned16({dinp, dout, inp, weight})) {
    rmsnorm_backward_kernel<Elem, vec_width<Elem>>
        <<<row_blocks(N), block, 0, stream>>>(dinp, dout, inp, weight, rstd, N, C);
  } else {
    rmsnorm_backward_kernel<Elem, 1>
        <<<row_blocks(N), block, 0, stream>>>(dinp, dout, inp, weight, rstd, N, C);
  }
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
  column_sums<1>(ColumnOutputs<1>{{dweight}}, RmsnormWeightGrad<Elem>{dout, inp, rstd, C}, N, C, stream);
}

}  // namespace

void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, std::int64_t N, int C,
                     float eps, cudaStream_t stream) {
  rmsnorm_forward_dispatch(out, rstd, inp, weight, N, C, eps, stream);
}

void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                      const float* rstd, std::int64_t N, int C, cudaStream_t stream) {
  rmsnorm_backward_dispatch(dinp, dweight, dout, inp, weight, rstd, N, C, stream);
}

void rope_forward(float* out, const float* inp, int B, int T, int H, int HS, int n_rot, int pos0, float theta,
                  cudaStream_t stream) {
  rope_apply<false>(out, inp, B, T, H, HS, n_rot, pos0, theta, 1.0f, stream);
}

void rope_backward(float* dinp, const float* dout, int B, int T, int H, int HS, int n_rot, int pos0,
                   float theta, cudaStream_t stream) {
  rope_apply<true>(dinp, dout, B, T, H, HS, n_rot, pos0, theta, -1.0f, stream);
}

void swiglu_forward(float* out, const float* gate, const float* up, std::int64_t N, cudaStream_t stream) {
  launch_elementwise<float>(SwigluForward<float>{out, gate, up}, N, aligned16({out, gate, up}), stream);
}

void swiglu_backward(float* dgate, float* dup, const float* dout, const float* gate, const float* up,
                     std::int64_t N, cudaStream_t stream) {
  launch_elementwise<float>(SwigluBackward<float>{dgate, dup, dout, gate, up}, N,
                            aligned16({dgate, dup, dout, gate, up}), stream);
}

void rmsnorm_forward(bf16* out, float* rstd, const bf16* inp, const bf16* weight, std::int64_t N, int C,
                     float eps, cudaStream_t stream) {
  rmsnorm_forward_dispatch(out, rstd, inp, weight, N, C, eps, stream);
}

void rmsnorm_backward(bf16* dinp, float* dweight, const bf16* dout, const bf16* inp, const bf16* weight,
                      const float* rstd, std::int64_t N, int C, cudaStream_t stream) {
  rmsnorm_backward_dispatch(dinp, dweight, dout, inp, weight, rstd, N, C, stream);
}

void rope_forward(bf16* out, const bf16* inp, int B, int T, int H, int HS, int n_rot, int pos0, float theta,
                  cudaStream_t stream) {
  rope_apply<false>(out, inp, B, T, H, HS, n_rot, pos0, theta, 1.0f, stream);
}

void rope_backward(bf16* dinp, const bf16* dout, int B, int T, int H, int HS, int n_rot, int pos0,
                   float theta, cudaStream_t stream) {
  rope_apply<true>(dinp, dout, B, T, H, HS, n_rot, pos0, theta, -1.0f, stream);
}

void swiglu_forward(bf16* out, const bf16* gate, const bf16* up, std::int64_t N, cudaStream_t stream) {
  launch_elementwise<bf16>(SwigluForward<bf16>{out, gate, up}, N, aligned16({out, gate, up}), stream);
}

void swiglu_backward(bf16* dgate, bf16* dup, const bf16* dout, const bf16* gate, const bf16* up,
                     std::int64_t N, cudaStream_t stream) {
  launch_elementwise<bf16>(SwigluBackward<bf16>{dgate, dup, dout, gate, up}, N,
                           aligned16({dgate, dup, dout, gate, up}), stream);
}

}  // namespace llmtrain::cuda
