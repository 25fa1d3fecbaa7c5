// CPU flash attention on packed sequences: forward and backward with the document mask
// (data.document_mask) against plain causal attention on the same (B,T) qkv. Documents of random
// lengths, uniform in 1 .. 2 MEAN - 1 (mean MEAN), cut at T. Prints the median of REPS timings of
// each, their ratio, and the ideal ratio from the work alone (T^2 over the sum of the squared
// document lengths, per sequence, summed). scripts/bench_documents.sh runs it.
// Usage: bench_documents [T] [MEAN] [B] [NH] [HS] [REPS]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <vector>

#include "core/tensor.h"
#include "ops/ops.h"

using namespace llmtrain;

namespace {

double seconds_of(const std::function<void()>& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const auto arg = [&](int i, int fallback) { return argc > i ? std::atoi(argv[i]) : fallback; };
  const int T = arg(1, 4096), mean = arg(2, T / 8), B = arg(3, 4), NH = arg(4, 4), HS = arg(5, 64), reps = arg(6, 3);
  const int C = NH * HS, W = 3 * C;
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> value(-1.0f, 1.0f);
  std::vector<float> qkv(std::size_t(B) * T * W), dout(std::size_t(B) * T * C), out(dout.size()),
      lse(std::size_t(B) * NH * T), dqkv(qkv.size());
  for (float& x : qkv) x = value(rng);
  for (float& x : dout) x = value(rng);
  std::vector<std::int32_t> seg(std::size_t(B) * T);
  std::uniform_int_distribution<int> length(1, 2 * mean - 1);
  double squares = 0.0;
  int documents = 0;
  for (int b = 0; b < B; ++b) {
    for (int t = 0, id = 0; t < T; ++id) {
      const int n = std::min(length(rng), T - t);
      std::fill_n(seg.begin() + std::ptrdiff_t(b) * T + t, n, id);
      squares += double(n) * n;
      ++documents;
      t += n;
    }
  }
  const auto tensor = [](std::vector<float>& v, std::initializer_list<std::int64_t> shape) {
    return Tensor(v.data(), DType::f32, Device::cpu, shape);
  };
  const Tensor segments(seg.data(), DType::i32, Device::cpu, {B, T});
  struct Timing {
    double forward, backward;
  };
  const auto time_of = [&](const Tensor& s) {
    std::vector<double> f, bw;
    for (int r = 0; r < reps; ++r) {
      f.push_back(seconds_of([&] {
        ops::flash_attention_forward(tensor(out, {B, T, C}), tensor(lse, {B, NH, T}), tensor(qkv, {B, T, W}), NH, NH,
                                     ops::AttentionKernels::flash, s);
      }));
      bw.push_back(seconds_of([&] {
        ops::flash_attention_backward(tensor(dqkv, {B, T, W}), tensor(dout, {B, T, C}), tensor(qkv, {B, T, W}),
                                      tensor(out, {B, T, C}), tensor(lse, {B, NH, T}), NH, NH,
                                      ops::AttentionKernels::flash, ops::Accumulate::no, s);
      }));
    }
    return Timing{median(f), median(bw)};
  };
  const Timing causal = time_of(Tensor()), masked = time_of(segments);
  std::printf("flash attention, CPU: B=%d T=%d NH=%d HS=%d, %d documents (mean length %.0f), median of %d\n", B, T,
              NH, HS, documents, double(B) * T / documents, reps);
  std::printf("%-16s %12s %12s %12s\n", "", "forward ms", "backward ms", "total ms");
  std::printf("%-16s %12.1f %12.1f %12.1f\n", "causal", 1e3 * causal.forward, 1e3 * causal.backward,
              1e3 * (causal.forward + causal.backward));
  std::printf("%-16s %12.1f %12.1f %12.1f\n", "document mask", 1e3 * masked.forward, 1e3 * masked.backward,
              1e3 * (masked.forward + masked.backward));
  std::printf("speed-up: forward %.2fx, backward %.2fx, total %.2fx; work ratio T^2 / sum(length^2) = %.2fx\n",
              causal.forward / masked.forward, causal.backward / masked.backward,
              (causal.forward + causal.backward) / (masked.forward + masked.backward), double(B) * T * T / squares);
  return 0;
}
