// Rotary position embedding (rotate_half layout): each position's angles in double, then the
// pairs of every head turned in float.
#include <cmath>
#include <vector>

#include "llmtrain/kernels/cpu.h"
#include "llmtrain/kernels/vec_math.h"

namespace llmtrain::cpu {

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

}  // namespace llmtrain::cpu
