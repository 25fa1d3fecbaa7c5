// bench_kernels: every op GPT-2 124M's training step runs, timed on the GPU at the model's shapes
// (B x T tokens, C channels, NH heads, V vocabulary rows), each against its ceiling: achieved
// bytes/s against the memory bandwidth for the memory-bound ops, achieved FLOP/s against the
// matrix peak for the matmuls and attention. Each op runs through ops:: (the model's own entry
// points, with their dispatch), `--warmup` times untimed, then `--reps` times between two CUDA
// events on the compute stream; the row is the mean. Fused ops have their unfused sequence beside
// them, so that each fusion's saving reads off the table; in bf16 the flash attention backward has
// its single pass (train.deterministic false: S and dP computed once, dQ by atomics) beside it.
//
// The bytes of a row are the least the op must move (each input read once, each output written
// once; an accumulated output read and written), so "fraction" is of the roofline, not of what
// the kernel actually moves. FLOPs: 2 per multiply-add; causal attention counts the half of the
// T x T scores below the diagonal (forward 2 matmuls, backward 5 of them).
//
//   bench_kernels [--batch 8] [--seq 1024] [--channels 768] [--heads 12] [--vocab 50304]
//                 [--dtype bf16|fp32] [--warmup 3] [--reps 20] [--peak-gbps 4300] [--peak-tflops T]
//                 [--only SUBSTRING] [--json FILE] [--tiny]
// --tiny: B=1, T=64, C=128, NH=2 (head size 64), V=512, one repetition and no warm-up: for the CUDA emulator
// (dev/cuda_emu), which checks every launch but cannot time. --peak-tflops defaults to 790 (H200
// bf16, measured by dense GEMMs) in bf16 and 51 (H200 fp32 without tensor cores) in fp32.
// Exit status: 0 when every row ran, 1 when one failed (its row says why), 2 bad usage.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/tensor.h"
#include "ops/buffer.h"
#include "device/runtime.h"
#include "device/stream.h"
#include "ops/ops.h"

namespace {

using llmtrain::Device;
using llmtrain::DType;
using llmtrain::Tensor;
namespace ops = llmtrain::ops;

struct Options {
  std::int64_t B = 8, T = 1024, C = 768, NH = 12, V = 50257;  // V: the true vocabulary; the logits are padded
  DType dtype = DType::bf16;
  int warmup = 3, reps = 20;
  double peak_gbps = 4300.0, peak_tflops = 0.0;  // 0: by dtype
  std::string only, json;
};

struct Row {
  std::string op, shape;
  double ms = 0.0, bytes = 0.0, flops = 0.0;
  std::string error;
};

void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
  }
}

// Device tensors, filled with uniform values in [lo, hi) (rounded once to bf16 where bf16).
class Arena {
 public:
  explicit Arena(DType act) : act_(act) {}
  Tensor act(std::initializer_list<std::int64_t> dims, float lo = -1.0f, float hi = 1.0f) {
    return make(act_, dims, lo, hi);
  }
  Tensor f32(std::initializer_list<std::int64_t> dims, float lo = -1.0f, float hi = 1.0f) {
    return make(DType::f32, dims, lo, hi);
  }
  Tensor tokens(std::initializer_list<std::int64_t> dims, std::int64_t V) {
    Tensor t = allocate(DType::i32, dims);
    std::vector<std::int32_t> host(std::size_t(t.numel()));
    for (auto& x : host) x = std::int32_t(rng_() % std::uint64_t(V));
    ops::copy(t, Tensor(host.data(), DType::i32, Device::cpu, {t.numel()}).reshape(dims));
    return t;
  }

 private:
  Tensor allocate(DType dtype, std::initializer_list<std::int64_t> dims) {
    std::int64_t n = 1;
    for (const auto d : dims) n *= d;
    buffers_.emplace_back(Device::cuda, std::size_t(n) * llmtrain::dtype_size(dtype));
    return Tensor(buffers_.back().data(), dtype, Device::cuda, dims);
  }
  Tensor make(DType dtype, std::initializer_list<std::int64_t> dims, float lo, float hi) {
    Tensor t = allocate(dtype, dims);
    std::vector<float> host(std::size_t(t.numel()));
    std::uniform_real_distribution<float> u(lo, hi);
    for (auto& x : host) x = u(rng_);
    const Tensor src(host.data(), DType::f32, Device::cpu, {t.numel()});
    if (dtype == DType::f32) {
      ops::copy(t.reshape({t.numel()}), src);
    } else {  // f32 on the device, then rounded there
      ops::Buffer wide(Device::cuda, host.size() * sizeof(float));
      const Tensor w(wide.data(), DType::f32, Device::cuda, {t.numel()});
      ops::copy(w, src);
      ops::convert(t.reshape({t.numel()}), w);
      llmtrain::device::synchronize();
    }
    return t;
  }

  DType act_;
  std::mt19937_64 rng_{20240520};
  std::vector<ops::Buffer> buffers_;
};

class Bench {
 public:
  explicit Bench(const Options& o) : o_(o) {
    check_cuda(cudaEventCreate(&start_), "cudaEventCreate");
    check_cuda(cudaEventCreate(&stop_), "cudaEventCreate");
  }
  ~Bench() {
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
  }
  Bench(const Bench&) = delete;
  Bench& operator=(const Bench&) = delete;

  /// Times f (one run of the op) and adds its row; a throw becomes the row's error.
  void time(const std::string& op, const std::string& shape, double bytes, double flops,
            const std::function<void()>& f) {
    if (!o_.only.empty() && op.find(o_.only) == std::string::npos) return;
    Row row{op, shape, 0.0, bytes, flops, ""};
    try {
      for (int i = 0; i < o_.warmup; ++i) f();
      cudaStream_t stream = llmtrain::device::compute_stream();
      check_cuda(cudaEventRecord(start_, stream), "cudaEventRecord");
      for (int i = 0; i < o_.reps; ++i) f();
      check_cuda(cudaEventRecord(stop_, stream), "cudaEventRecord");
      check_cuda(cudaEventSynchronize(stop_), "cudaEventSynchronize");
      float ms = 0.0f;
      check_cuda(cudaEventElapsedTime(&ms, start_, stop_), "cudaEventElapsedTime");
      row.ms = double(ms) / o_.reps;
      check_cuda(cudaGetLastError(), op.c_str());
    } catch (const std::exception& e) {
      row.error = e.what();
    }
    rows_.push_back(row);
  }
  void skip(const std::string& op, const std::string& shape, const std::string& why) {
    if (!o_.only.empty() && op.find(o_.only) == std::string::npos) return;
    rows_.push_back(Row{op, shape, 0.0, 0.0, 0.0, "skipped: " + why});
  }
  const std::vector<Row>& rows() const { return rows_; }

 private:
  const Options& o_;
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
  std::vector<Row> rows_;
};

std::string dims(std::initializer_list<std::pair<const char*, std::int64_t>> named) {
  std::string s;
  for (const auto& [name, value] : named) {
    if (!s.empty()) s += ' ';
    s.append(name).append("=").append(std::to_string(value));
  }
  return s;
}

void run_all(const Options& o, Bench& bench) {
  const std::int64_t B = o.B, T = o.T, C = o.C, NH = o.NH, V = o.V, N = B * T, F = 4 * C;
  const std::int64_t Vp = ops::logits_stride(V);  // the model's padded logits rows
  const double e = double(llmtrain::dtype_size(o.dtype));  // bytes per activation
  const double nc = double(N) * double(C), nf = double(N) * double(F);
  Arena arena(o.dtype);

  // ---- embeddings --------------------------------------------------------------------------------
  {
    const Tensor inp = arena.tokens({B, T}, V), wte = arena.act({V, C}), wpe = arena.act({T, C});
    const Tensor out = arena.act({B, T, C}), dwte = arena.f32({V, C}, 0, 0), dwpe = arena.f32({T, C}, 0, 0);
    const std::string s = dims({{"B", B}, {"T", T}, {"C", C}});
    bench.time("encoder_forward", s, 2 * nc * e + double(T * C) * e, 0, [&] { ops::encoder_forward(out, inp, wte, wpe); });
    bench.time("encoder_backward", s, nc * e + 2 * nc * 4 + 2 * double(T * C) * 4, 0,
               [&] { ops::encoder_backward(dwte, dwpe, out, inp); });
  }
  // ---- LayerNorm, with and without its residual add ------------------------------------------------
  {
    const Tensor a = arena.act({N, C}, -2, 3), b = arena.act({N, C}), w = arena.act({C}, 0.5f, 1.5f), bias = arena.act({C});
    const Tensor res = arena.act({N, C}), out = arena.act({N, C}), mean = arena.f32({N}), rstd = arena.f32({N});
    const Tensor dinp = arena.act({N, C}), dw = arena.f32({C}, 0, 0), db = arena.f32({C}, 0, 0);
    const std::string s = dims({{"N", N}, {"C", C}});
    bench.time("layernorm_forward", s, 2 * nc * e, 0, [&] { ops::layernorm_forward(out, mean, rstd, a, w, bias); });
    bench.time("residual_forward", s, 3 * nc * e, 0, [&] { ops::residual_forward(res, a, b); });
    bench.time("residual+layernorm (unfused)", s, 5 * nc * e, 0, [&] {
      ops::residual_forward(res, a, b);
      ops::layernorm_forward(out, mean, rstd, res, w, bias);
    });
    bench.time("layernorm_residual_forward", s, 4 * nc * e, 0,
               [&] { ops::layernorm_residual_forward(res, out, mean, rstd, a, b, w, bias); });
    // dinp accumulated (read and written), dout and inp read; the weight gradients in the same pass.
    bench.time("layernorm_backward", s, 4 * nc * e, 0,
               [&] { ops::layernorm_backward(dinp, dw, db, b, a, w, mean, rstd); });
  }
  // ---- the matmuls of one layer and the head -------------------------------------------------------
  {
    struct Mm {
      const char* name;
      std::int64_t in, out;
      bool bias;
      std::int64_t ld;  // the row stride of out and dout
    };
    // The head as the model runs it (logits rows padded to a multiple of 128) and unpadded, so
    // that a GPU run shows what the padding buys.
    for (const Mm& m : {Mm{"qkv", C, 3 * C, true, 3 * C}, Mm{"attproj", C, C, true, C}, Mm{"fc", C, F, true, F},
                        Mm{"fcproj", F, C, true, C}, Mm{"lm_head", C, V, false, Vp},
                        Mm{"lm_head (unpadded rows)", C, V, false, V}}) {
      const Tensor inp = arena.act({N, m.in}), w = arena.act({m.out, m.in}, -0.05f, 0.05f);
      const Tensor bias = m.bias ? arena.act({m.out}) : Tensor(), out = arena.act({N, m.ld});
      const Tensor dout = arena.act({N, m.ld}, -0.01f, 0.01f), dinp = arena.act({N, m.in});
      const Tensor dw = arena.f32({m.out, m.in}, 0, 0), db = m.bias ? arena.f32({m.out}, 0, 0) : Tensor();
      const std::string s = dims({{"N", N}, {"C", m.in}, {"OC", m.out}, {"ld", m.ld}});
      const double flops = 2.0 * double(N) * double(m.in) * double(m.out);
      bench.time(std::string("matmul_forward ") + m.name, s, 0, flops, [&] { ops::matmul_forward(out, inp, w, bias); });
      bench.time(std::string("matmul_backward ") + m.name, s, 0, 2 * flops,
                 [&] { ops::matmul_backward(dinp, dw, db, dout, inp, w, ops::Accumulate::no); });
    }
  }
  // ---- the MLP's GELU: in the matmuls' epilogues, and apart ------------------------------------------
  {
    const Tensor ln = arena.act({N, C}), fc_w = arena.act({F, C}, -0.05f, 0.05f), fc_b = arena.act({F});
    const Tensor pre = arena.act({N, F}), act = arena.act({N, F}), proj_w = arena.act({C, F}, -0.05f, 0.05f);
    const Tensor dout = arena.act({N, C}, -0.01f, 0.01f), dact = arena.act({N, F}), dpre = arena.act({N, F});
    const Tensor dproj_w = arena.f32({C, F}, 0, 0), dproj_b = arena.f32({C}, 0, 0), dfc_b = arena.f32({F}, 0, 0);
    const std::string s = dims({{"N", N}, {"C", C}, {"F", F}});
    const double flops = 2.0 * double(N) * double(C) * double(F);
    bench.time("gelu_forward", dims({{"N", N}, {"F", F}}), 2 * nf * e, 0, [&] { ops::gelu_forward(act, pre); });
    bench.time("gelu_backward", dims({{"N", N}, {"F", F}}), 4 * nf * e, 0, [&] { ops::gelu_backward(dpre, pre, dact); });
    bench.time("fc + gelu (unfused)", s, 0, flops, [&] {
      ops::matmul_forward(pre, ln, fc_w, fc_b);
      ops::gelu_forward(act, pre);
    });
    bench.time("matmul_gelu_forward (GELU_AUX_BIAS)", s, 0, flops,
               [&] { ops::matmul_gelu_forward(act, pre, ln, fc_w, fc_b); });
    bench.time("fcproj backward + gelu_backward (unfused)", s, 0, 2 * flops, [&] {
      ops::zero(dpre);
      ops::matmul_backward(dact, dproj_w, dproj_b, dout, act, proj_w, ops::Accumulate::no);
      ops::gelu_backward(dpre, pre, dact);
    });
    bench.time("matmul_backward_dgelu (DGELU)", s, 0, 2 * flops,
               [&] { ops::matmul_backward_dgelu(dpre, dproj_w, dproj_b, dfc_b, dout, act, pre, proj_w); });
  }
  // ---- attention: ours and cuDNN's ------------------------------------------------------------------
  {
    const std::int64_t HS = C / NH;
    const Tensor qkv = arena.act({B, T, 3 * C}), out = arena.act({B, T, C}), lse = arena.f32({B, NH, T});
    const Tensor dout = arena.act({B, T, C}, -0.01f, 0.01f), dqkv = arena.act({B, T, 3 * C});
    const std::string s = dims({{"B", B}, {"T", T}, {"NH", NH}, {"HS", HS}});
    // Causal: about half of the T x T scores; forward 2 matmuls (QK^T, PV), backward 5.
    const double pair = 2.0 * double(B) * double(NH) * double(T) * double(T + 1) / 2.0 * double(HS);
    std::string why;
    std::vector<std::pair<const char*, ops::AttentionKernels>> kinds = {{"flash", ops::AttentionKernels::flash}};
    if (o.dtype != DType::bf16) {
      bench.skip("attention_forward cudnn", s, "cuDNN attention is bf16 only");
      bench.skip("attention_backward cudnn", s, "cuDNN attention is bf16 only");
    } else if (!ops::cudnn_attention_available(&why) ||
               !ops::cudnn_attention_supported(int(B), int(T), int(C), int(NH), int(NH), &why)) {
      bench.skip("attention_forward cudnn", s, why);
      bench.skip("attention_backward cudnn", s, why);
    } else {
      kinds.emplace_back("cudnn", ops::AttentionKernels::cudnn);
    }
    for (const auto& [name, kernels] : kinds) {
      const auto k = kernels;
      bench.time(std::string("attention_forward ") + name, s, 0, 2 * pair,
                 [&] { ops::flash_attention_forward(out, lse, qkv, int(NH), int(NH), k); });
      ops::flash_attention_forward(out, lse, qkv, int(NH), int(NH), k);  // the lse its backward needs
      bench.time(std::string("attention_backward ") + name, s, 0, 5 * pair,
                 [&] { ops::flash_attention_backward(dqkv, dout, qkv, out, lse, int(NH), int(NH), k); });
      if (k != ops::AttentionKernels::flash) continue;
      // train.deterministic false: the tensor-core kernels' single pass (S and dP once, dQ by
      // atomics); the same FLOPs counted, so the rows compare by time.
      const char* single = "attention_backward flash single-pass";
      if (o.dtype != DType::bf16 || (HS != 64 && HS != 128)) {
        bench.skip(single, s, "the single pass is for the bf16 tensor-core kernels (head size 64 or 128)");
        continue;
      }
      ops::set_deterministic(false);
      bench.time(single, s, 0, 5 * pair,
                 [&] { ops::flash_attention_backward(dqkv, dout, qkv, out, lse, int(NH), int(NH), k); });
      ops::set_deterministic(true);
    }
  }
  // ---- the classifier: softmax, loss and its gradient over the logits, in place ----------------------
  {
    const Tensor losses = arena.f32({N}), targets = arena.tokens({N}, V);
    for (const std::int64_t ld : {Vp, V}) {
      const Tensor logits = arena.act({N, ld}, -4, 4);
      const std::string s = dims({{"N", N}, {"V", V}, {"ld", ld}});
      // Reads the logits, writes their gradient: the in-place repeats time the same work.
      bench.time(ld == V ? "fused_classifier (unpadded rows)" : "fused_classifier", s, 2 * double(N) * double(V) * e,
                 0, [&] { ops::fused_classifier(logits, losses, targets, 1.0f / float(N), nullptr, V); });
    }
  }
  // ---- the optimizer over GPT-2 124M's parameters ------------------------------------------------------
  {
    const std::int64_t P = 12 * (12 * C * C + 13 * C) + (V + T) * C + 2 * C;  // GPT-2 with this C and V
    const Tensor param = arena.f32({P}, -0.05f, 0.05f), grad = arena.f32({P}, -1e-3f, 1e-3f);
    const Tensor m = arena.f32({P}, 0, 0), v = arena.f32({P}, 0, 0);
    const ops::AdamWParams p{6e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 1, 1.0f};
    const std::string s = dims({{"params", P}});
    bench.time("adamw_update", s, 7.0 * 4 * double(P), 0, [&] { ops::adamw_update(param, grad, m, v, p); });
    bench.time("sum_squares (grad norm)", s, 4.0 * double(P), 0, [&] { ops::sum_squares(grad); });
  }
}

void print_usage() {
  std::fputs(
      "usage: bench_kernels [--batch B] [--seq T] [--channels C] [--heads NH] [--vocab V] [--dtype bf16|fp32]\n"
      "                     [--warmup N] [--reps N] [--peak-gbps G] [--peak-tflops T] [--only SUBSTRING]\n"
      "                     [--json FILE] [--tiny]\n",
      stderr);
}

bool parse(int argc, char** argv, Options& o) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
      return argv[++i];
    };
    const auto integer = [&]() {
      const std::string v = value();
      std::size_t used = 0;
      const long long x = std::stoll(v, &used);
      if (used != v.size() || x < 0) throw std::invalid_argument(a + ": expected a number >= 0, got " + v);
      return std::int64_t(x);
    };
    if (a == "--batch") o.B = integer();
    else if (a == "--seq") o.T = integer();
    else if (a == "--channels") o.C = integer();
    else if (a == "--heads") o.NH = integer();
    else if (a == "--vocab") o.V = integer();
    else if (a == "--warmup") o.warmup = int(integer());
    else if (a == "--reps") o.reps = int(integer());
    else if (a == "--peak-gbps") o.peak_gbps = std::stod(value());
    else if (a == "--peak-tflops") o.peak_tflops = std::stod(value());
    else if (a == "--only") o.only = value();
    else if (a == "--json") o.json = value();
    else if (a == "--dtype") {
      const std::string d = value();
      if (d != "bf16" && d != "fp32") throw std::invalid_argument("--dtype: expected bf16 or fp32, got " + d);
      o.dtype = d == "bf16" ? DType::bf16 : DType::f32;
    } else if (a == "--tiny") {
      o.B = 1, o.T = 64, o.C = 128, o.NH = 2, o.V = 512, o.warmup = 0, o.reps = 1;
    } else if (a == "-h" || a == "--help") {
      print_usage();
      std::exit(0);
    } else {
      throw std::invalid_argument("unknown option " + a);
    }
  }
  if (o.B < 1 || o.T < 1 || o.C < 1 || o.NH < 1 || o.C % o.NH != 0 || o.V < 1 || o.reps < 1) {
    throw std::invalid_argument("need B, T, C, NH, V, reps >= 1 and NH dividing C");
  }
  if (o.peak_tflops <= 0.0) o.peak_tflops = o.dtype == DType::bf16 ? 790.0 : 51.0;
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  try {
    parse(argc, argv, o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_kernels: %s\n", e.what());
    print_usage();
    return 2;
  }
  std::string why;
  if (!ops::cuda_available(&why)) {
    std::fprintf(stderr, "bench_kernels: no CUDA device: %s\n", why.c_str());
    return 1;
  }
  const auto devices = llmtrain::device::query_devices().devices;
  const std::string device = devices.empty() ? "unknown" : devices.front().name;
  const char* dtype = o.dtype == DType::bf16 ? "bf16" : "fp32";
  std::vector<Row> rows;
  try {
    Bench bench(o);
    run_all(o, bench);
    rows = bench.rows();
  } catch (const std::exception& e) {  // the set-up (allocation, events) failed: no table
    std::fprintf(stderr, "bench_kernels: %s\n", e.what());
    return 1;
  }

  std::printf("bench_kernels on %s: %s, B=%lld T=%lld C=%lld NH=%lld V=%lld, mean of %d runs after %d warm-up; "
              "ceilings %.0f GB/s, %.0f TFLOP/s\n",
              device.c_str(), dtype, (long long)o.B, (long long)o.T, (long long)o.C, (long long)o.NH,
              (long long)o.V, o.reps, o.warmup, o.peak_gbps, o.peak_tflops);
  std::printf("%-42s %-26s %10s %14s %9s\n", "op", "shape", "ms", "achieved", "ceiling");
  nlohmann::json out_rows = nlohmann::json::array();
  int failed = 0;
  for (const Row& r : rows) {
    nlohmann::json j = {{"op", r.op}, {"shape", r.shape}};
    if (!r.error.empty()) {
      const bool skipped = r.error.rfind("skipped", 0) == 0;
      failed += skipped ? 0 : 1;
      std::printf("%-42s %-26s %s\n", r.op.c_str(), r.shape.c_str(), (skipped ? r.error : "FAILED: " + r.error).c_str());
      j[skipped ? "skipped" : "error"] = r.error;
      out_rows.push_back(j);
      continue;
    }
    const bool compute = r.flops > 0.0;
    const double achieved = r.ms > 0.0 ? (compute ? r.flops / (r.ms * 1e-3) / 1e12 : r.bytes / (r.ms * 1e-3) / 1e9) : 0.0;
    const double fraction = achieved / (compute ? o.peak_tflops : o.peak_gbps);
    char achieved_text[32];
    std::snprintf(achieved_text, sizeof achieved_text, compute ? "%.1f TFLOP/s" : "%.0f GB/s", achieved);
    std::printf("%-42s %-26s %10.4f %14s %8.1f%%\n", r.op.c_str(), r.shape.c_str(), r.ms, achieved_text,
                100.0 * fraction);
    j["ms"] = r.ms;
    j["bound"] = compute ? "compute" : "memory";
    if (compute) {
      j["flops"] = r.flops;
      j["tflops"] = achieved;
    } else {
      j["bytes"] = r.bytes;
      j["gbps"] = achieved;
    }
    j["fraction"] = fraction;
    out_rows.push_back(j);
  }
  if (!o.json.empty()) {
    const nlohmann::json doc = {{"device", device},
                                {"dtype", dtype},
                                {"shape", {{"B", o.B}, {"T", o.T}, {"C", o.C}, {"NH", o.NH}, {"V", o.V}}},
                                {"warmup", o.warmup},
                                {"reps", o.reps},
                                {"ceilings", {{"gbps", o.peak_gbps}, {"tflops", o.peak_tflops}}},
                                {"failed", failed},
                                {"rows", out_rows}};
    std::ofstream f(o.json);
    f << doc.dump(1) << "\n";
    if (!f) {
      std::fprintf(stderr, "bench_kernels: cannot write %s\n", o.json.c_str());
      return 1;
    }
  }
  return failed ? 1 : 0;
}
