// Muon on the GPU against the CPU Muon (optim/muon.h, optim/newton_schulz.h): Newton-Schulz of
// square, tall, wide and odd matrices in f32 and bf16, one at a time and batched, and a few full
// updates of a tiny GPT-2 (its Muon matrices and its AdamW parameters) on the same inputs. Errors are
// normalised by the reference's largest entry, with tolerances scaled to the dtype; the results are checked
// not to be trivially zero, and Newton-Schulz's result to be near-orthogonal on its own (a wrong coefficient
// shared by both backends would pass the comparison alone). Without a GPU every case skips visibly.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "catch_compat.h"
#include "config/config.h"
#include "core/tensor.h"
#include "model/model.h"
#include "ops/buffer.h"
#include "optim/muon.h"
#include "optim/newton_schulz.h"
#include "optim/registry.h"

using namespace llmtrain;

namespace {

std::vector<float> random_normal(std::mt19937& rng, std::size_t n, float scale) {
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> out(n);
  for (float& x : out) x = normal(rng);
  return out;
}

Tensor host(std::vector<float>& v, std::initializer_list<std::int64_t> shape) {
  return Tensor(v.data(), DType::f32, Device::cpu, shape);
}

std::vector<float> to_host(const Tensor& t) {
  std::vector<float> out(std::size_t(t.numel()));
  if (t.dtype == DType::f32) {
    ops::copy(Tensor(out.data(), DType::f32, Device::cpu, {t.numel()}), t);
    return out;
  }
  const ops::Buffer wide(t.device, out.size() * sizeof(float));
  ops::convert(wide.view(DType::f32, {t.numel()}), t);
  ops::copy(Tensor(out.data(), DType::f32, Device::cpu, {t.numel()}), wide.view(DType::f32, {t.numel()}));
  return out;
}

// The largest |got - want| over the largest |want| (and that largest |want|, through `scale`).
double relative_error(const std::vector<float>& got, const std::vector<float>& want, double* scale = nullptr) {
  double err = 0.0, largest = 0.0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    err = std::max(err, std::abs(double(got[i]) - double(want[i])));
    largest = std::max(largest, std::abs(double(want[i])));
  }
  if (scale) *scale = largest;
  return largest > 0 ? err / largest : err;
}

}  // namespace

TEST_CASE("cuda Newton-Schulz matches the cpu reference: square, tall, wide and odd shapes, f32 and bf16",
          "[cuda][muon]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);
  std::mt19937 rng(11);
  optim::NewtonSchulzWork cpu_work(Device::cpu), cuda_work(Device::cuda);
  for (const bool bf16 : {false, true}) {
    for (const auto& [rows, cols] : std::vector<std::pair<std::int64_t, std::int64_t>>{
             {16, 16}, {48, 16}, {16, 48}, {7, 5}, {5, 7}, {33, 70}, {70, 33}, {1, 8}, {8, 1}}) {
      INFO((bf16 ? "bf16 " : "f32 ") << rows << "x" << cols);
      std::vector<float> u = random_normal(rng, std::size_t(rows * cols), 0.3f), want(u.size());
      optim::NewtonSchulz ns;
      ns.bf16 = bf16;
      optim::newton_schulz(host(u, {rows, cols}), host(want, {rows, cols}), ns, cpu_work);
      const ops::Buffer d_u(Device::cuda, u.size() * sizeof(float)), d_o(Device::cuda, u.size() * sizeof(float));
      ops::copy(d_u.view(DType::f32, {rows, cols}), host(u, {rows, cols}));
      optim::newton_schulz(d_u.view(DType::f32, {rows, cols}), d_o.view(DType::f32, {rows, cols}), ns, cuda_work);
      const std::vector<float> got = to_host(d_o.view(DType::f32, {rows * cols}));
      double largest = 0.0;
      const double err = relative_error(got, want, &largest);
      CAPTURE(err, largest);
      CHECK(err < (bf16 ? 3e-2 : 1e-4));
      CHECK(largest > 0.1);  // not trivially zero
      // O O^T (the smaller Gram matrix) near the identity: singular values in the quintic's band,
      // about [0.68, 1.13] (a single row ends at a + b + c = 0.70 after an odd number of steps),
      // so squares within 0.6 of 1.
      const std::int64_t m = std::min(rows, cols), n = std::max(rows, cols);
      double worst = 0.0;
      for (std::int64_t i = 0; i < m; ++i) {
        for (std::int64_t j = 0; j < m; ++j) {
          double dot = 0.0;
          for (std::int64_t k = 0; k < n; ++k) {
            const auto at = [&](std::int64_t r, std::int64_t c) {  // O^T's (r, c) for a tall O
              return rows > cols ? got[std::size_t(c * cols + r)] : got[std::size_t(r * cols + c)];
            };
            dot += double(at(i, k)) * at(j, k);
          }
          worst = std::max(worst, std::abs(dot - (i == j ? 1.0 : 0.0)));
        }
      }
      CAPTURE(worst);
      CHECK(worst < 0.6);
    }
  }
}

TEST_CASE("cuda Newton-Schulz batched over matrices of one shape matches the cpu reference, f32 and bf16",
          "[cuda][muon]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);
  // B matrices lying apart in one device array (the gaps must stay untouched), in one batch and in
  // batches of two (the last one short), against the CPU's single-matrix results.
  std::mt19937 rng(13);
  optim::NewtonSchulzWork cpu_work(Device::cpu), cuda_work(Device::cuda);
  for (const bool bf16 : {false, true}) {
    for (const auto& [rows, cols, B] : std::vector<std::tuple<std::int64_t, std::int64_t, std::int64_t>>{
             {16, 48, 3}, {48, 16, 3}, {7, 5, 5}, {33, 70, 2}, {16, 16, 4}}) {
      for (const bool in_twos : {false, true}) {
        INFO((bf16 ? "bf16 " : "f32 ")
             << B << " x " << rows << "x" << cols << (in_twos ? " in batches of two" : ""));
        const std::int64_t gap = 3, stride = rows * cols + gap, total = B * stride;
        std::vector<float> u = random_normal(rng, std::size_t(total), 0.3f);
        optim::NewtonSchulz ns;
        ns.bf16 = bf16;
        if (in_twos) {
          const std::int64_t m = std::min(rows, cols);
          ns.batch_bytes = std::size_t(2 * (3 * rows * cols + 3 * m * m)) * (bf16 ? 2 : 4);
        }
        const ops::Buffer d_u(Device::cuda, u.size() * sizeof(float)),
            d_o(Device::cuda, u.size() * sizeof(float));
        ops::copy(d_u.view(DType::f32, {total}), host(u, {total}));
        std::vector<float> sentinel(u.size(), 7.0f);
        ops::copy(d_o.view(DType::f32, {total}), host(sentinel, {total}));
        std::vector<Tensor> us, os;
        for (std::int64_t b = 0; b < B; ++b) {
          us.push_back(
              Tensor(static_cast<float*>(d_u.data()) + b * stride, DType::f32, Device::cuda, {rows, cols}));
          os.push_back(
              Tensor(static_cast<float*>(d_o.data()) + b * stride, DType::f32, Device::cuda, {rows, cols}));
        }
        optim::newton_schulz(us, os, ns, cuda_work);
        const std::vector<float> got = to_host(d_o.view(DType::f32, {total}));
        for (std::int64_t b = 0; b < B; ++b) {
          INFO("matrix " << b);
          std::vector<float> want(std::size_t(rows * cols));
          optim::newton_schulz(Tensor(u.data() + b * stride, DType::f32, Device::cpu, {rows, cols}),
                               host(want, {rows, cols}), ns, cpu_work);
          const std::vector<float> mine(got.begin() + b * stride, got.begin() + b * stride + rows * cols);
          double largest = 0.0;
          const double err = relative_error(mine, want, &largest);
          CAPTURE(err, largest);
          CHECK(err < (bf16 ? 3e-2 : 1e-4));
          CHECK(largest > 0.1);  // not trivially zero
          for (std::int64_t g = 0; g < gap; ++g)
            CHECK(got[std::size_t(b * stride + rows * cols + g)] == 7.0f);
        }
      }
    }
  }
}

TEST_CASE("cuda Muon: updates of a tiny GPT-2 (Muon matrices and AdamW parameters) match the cpu Muon, f32 and bf16",
          "[cuda][muon]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);
  const config::Config c = config::parse_config(
      R"({"model": {"arch": "gpt2", "vocab_size": 32, "context_length": 8, "n_layer": 1, "n_head": 2, "d_model": 16},
          "optim": {"name": "muon", "lr": 0.01, "weight_decay": 0.1, "muon": {"lr": 0.05, "weight_decay": 0.2}}})",
      "c.json", {});
  const auto model = model::make_model(c.model, Device::cpu);
  const std::vector<model::ParamInfo>& infos = model->param_infos();
  std::int64_t P = 0;
  for (const model::ParamInfo& info : infos) P = std::max(P, info.offset + info.numel);
  const std::vector<optim::MuonMatrix> matrices = optim::muon_matrices(infos);
  REQUIRE(!matrices.empty());
  for (const bool bf16 : {false, true}) {
    INFO((bf16 ? "bf16" : "f32"));
    std::mt19937 rng(5);
    std::vector<float> params = random_normal(rng, std::size_t(P), 0.1f), start = params;
    auto cpu = optim::make_optimizer(c.optim, infos, {optim::Piece{{0, P}, 0}}, Device::cpu);
    auto gpu = optim::make_optimizer(c.optim, infos, {optim::Piece{{0, P}, 0}}, Device::cuda);
    const ops::Buffer d_params(Device::cuda, std::size_t(P) * sizeof(float)),
        d_grads(Device::cuda, std::size_t(P) * sizeof(float));
    const ops::Buffer d_working(Device::cuda, bf16 ? std::size_t(P) * 2 : 0), h_working(Device::cpu, bf16 ? std::size_t(P) * 2 : 0);
    const Tensor cuda_params = d_params.view(DType::f32, {P}), cuda_grads = d_grads.view(DType::f32, {P});
    const Tensor cuda_working = bf16 ? d_working.view(DType::bf16, {P}) : Tensor();
    const Tensor cpu_working = bf16 ? h_working.view(DType::bf16, {P}) : Tensor();
    ops::copy(cuda_params, host(params, {P}));
    for (std::int64_t step = 1; step <= 3; ++step) {
      std::vector<float> grads = random_normal(rng, std::size_t(P), 1.0f);
      ops::copy(cuda_grads, host(grads, {P}));
      // grad_norm above grad_clip: the gradients are scaled, on both sides alike.
      cpu->update({infos, host(params, {P}), host(grads, {P}), 2.0, 1.0, 0.01, step, cpu_working});
      gpu->update({infos, cuda_params, cuda_grads, 2.0, 1.0, 0.01, step, cuda_working});
    }
    // The change of every parameter, over the largest change.
    std::vector<float> got = to_host(cuda_params), want = params;
    for (std::size_t i = 0; i < got.size(); ++i) {
      got[i] -= start[i];
      want[i] -= start[i];
    }
    double largest = 0.0;
    const double err = relative_error(got, want, &largest);
    CAPTURE(err, largest);
    CHECK(err < (bf16 ? 3e-2 : 1e-4));
    CHECK(largest > 1e-3);
    // Each Muon matrix and the AdamW parameters between them moved.
    for (const optim::MuonMatrix& mat : matrices) {
      double moved = 0.0;
      for (std::int64_t i = mat.offset; i < mat.offset + mat.numel(); ++i) moved = std::max(moved, std::abs(double(got[std::size_t(i)])));
      INFO(mat.name);
      CHECK(moved > 1e-3);
    }
    CHECK(std::abs(got[0]) + std::abs(got[std::size_t(P - 1)]) > 0.0);  // wte's first, the last norm's last element
    const std::vector<float> got_momentum = to_host(dynamic_cast<optim::Muon&>(*gpu).momentum());
    const std::vector<float> want_momentum = to_host(dynamic_cast<optim::Muon&>(*cpu).momentum());
    CHECK(relative_error(got_momentum, want_momentum) < 1e-5);
    if (bf16) {
      const std::vector<float> got_working = to_host(cuda_working), want_working = to_host(cpu_working);
      CHECK(relative_error(got_working, want_working) < 3e-2);
    }
  }
}
