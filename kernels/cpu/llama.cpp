// The ops Llama adds to GPT-2's: RMSNorm, rotary embeddings, SwiGLU.
#include <cmath>
#include <vector>

#include "llmtrain/kernels/cpu.h"
#include "llmtrain/kernels/vec_math.h"

namespace llmtrain::cpu {

void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, std::int64_t N, int C, float eps) {
#pragma omp parallel for if (worth_threads(N * C * 3))
  for (std::int64_t i = 0; i < N; ++i) {
    const float* x = inp + i * C;
    double sum_squares = 0.0;
    for (int c = 0; c < C; ++c) sum_squares += double(x[c]) * x[c];
    const float s = 1.0f / std::sqrt(float(sum_squares / C) + eps);
    float* y = out + i * C;
    for (int c = 0; c < C; ++c) y[c] = x[c] * s * weight[c];
    rstd[i] = s;
  }
}

void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                      const float* rstd, std::int64_t N, int C) {
  // y = w n, n = x s, s = (mean(x^2) + eps)^-1/2: dx = s (w dy - n mean(w dy n)).
#pragma omp parallel for if (worth_threads(N * C * 6))
  for (std::int64_t i = 0; i < N; ++i) {
    const float* x = inp + i * C;
    const float* dy = dout + i * C;
    float dot = 0.0f;
    for (int c = 0; c < C; ++c) dot += weight[c] * dy[c] * x[c] * rstd[i];
    dot /= C;
    float* dx = dinp + i * C;
    for (int c = 0; c < C; ++c) dx[c] += rstd[i] * (weight[c] * dy[c] - x[c] * rstd[i] * dot);
  }
  // dweight: each thread owns channels and sums over rows in order (deterministic).
#pragma omp parallel for if (worth_threads(N * C * 3))
  for (int c = 0; c < C; ++c) {
    float dw = 0.0f;
    for (std::int64_t i = 0; i < N; ++i) dw += inp[i * C + c] * rstd[i] * dout[i * C + c];
    dweight[c] += dw;
  }
}

namespace {

// cos and sin of position t's angles, (HS/2) each: angle_i = t * theta^(-2i/HS).
void rope_angles(int t, int HS, float theta, std::vector<float>& cosines, std::vector<float>& sines) {
  const int half = HS / 2;
  cosines.resize(std::size_t(half));
  sines.resize(std::size_t(half));
  for (int i = 0; i < half; ++i) {
    const double angle = double(t) * std::pow(double(theta), -2.0 * i / HS);
    cosines[std::size_t(i)] = float(std::cos(angle));
    sines[std::size_t(i)] = float(std::sin(angle));
  }
}

// Turns each (x_i, x_{i+HS/2}) pair of heads [0, n_rot) by +angle (forward) or -angle (backward,
// the transpose); heads [n_rot, H) pass through unchanged.
void rope_apply(float* out, const float* inp, int B, int T, int H, int HS, int n_rot, int pos0, float theta,
                float direction, bool accumulate) {
  const int half = HS / 2;
#pragma omp parallel for if (worth_threads(std::int64_t(T) * (HS * 20 + std::int64_t(B) * H * HS * 2)))
  for (int t = 0; t < T; ++t) {
    std::vector<float> cosines, sines;
    rope_angles(pos0 + t, HS, theta, cosines, sines);
    for (int b = 0; b < B; ++b) {
      for (int h = 0; h < H; ++h) {
        const std::int64_t base = ((std::int64_t(b) * T + t) * H + h) * HS;
        for (int i = 0; i < half; ++i) {
          const bool rotate = h < n_rot;
          const float c = rotate ? cosines[std::size_t(i)] : 1.0f;
          const float s = rotate ? direction * sines[std::size_t(i)] : 0.0f;
          const float x1 = inp[base + i], x2 = inp[base + i + half];
          const float y1 = x1 * c - x2 * s, y2 = x2 * c + x1 * s;
          if (accumulate) {
            out[base + i] += y1;
            out[base + i + half] += y2;
          } else {
            out[base + i] = y1;
            out[base + i + half] = y2;
          }
        }
      }
    }
  }
}

}  // namespace

void rope_forward(float* out, const float* inp, int B, int T, int H, int HS, int n_rot, int pos0, float theta) {
  rope_apply(out, inp, B, T, H, HS, n_rot, pos0, theta, 1.0f, false);
}

void rope_backward(float* dinp, const float* dout, int B, int T, int H, int HS, int n_rot, int pos0, float theta) {
  rope_apply(dinp, dout, B, T, H, HS, n_rot, pos0, theta, -1.0f, true);
}

void swiglu_forward(float* out, const float* gate, const float* up, std::int64_t N) {
#pragma omp parallel for simd if (worth_threads(N * 14))
  for (std::int64_t i = 0; i < N; ++i) out[i] = gate[i] / (1.0f + exp_vec(-gate[i])) * up[i];
}

void swiglu_backward(float* dgate, float* dup, const float* dout, const float* gate, const float* up, std::int64_t N) {
#pragma omp parallel for simd if (worth_threads(N * 18))
  for (std::int64_t i = 0; i < N; ++i) {
    const float s = 1.0f / (1.0f + exp_vec(-gate[i]));
    const float silu = gate[i] * s;
    dgate[i] += dout[i] * up[i] * s * (1.0f + gate[i] * (1.0f - s));
    dup[i] += dout[i] * silu;
  }
}

}  // namespace llmtrain::cpu
