// bench_kernels: every op GPT-2 124M's training step runs, timed on the GPU at the model's shapes
// (B x T tokens, C channels, NH heads, V vocabulary rows), each against its ceiling: achieved
// bytes/s against the memory bandwidth for the memory-bound ops, achieved FLOP/s against the
// matrix peak for the matmuls and attention. The ops are the timing mode of the op case registry
// (op_cases/op_cases.h, the cases test_cuda_ops checks against the CPU): each step of a case is one
// row. Each runs through ops:: (the model's own entry points, with their dispatch), `--warmup`
// times untimed, then `--reps` times between two CUDA events on the compute stream; the row is
// the mean. Fused ops have their unfused sequence beside them, so that each fusion's saving reads
// off the table; in bf16 the flash attention backward has its single pass (train.deterministic
// false: S and dP computed once, dQ by atomics) beside it.
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
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/tensor.h"
#include "device/runtime.h"
#include "device/stream.h"
#include "op_cases.h"
#include "ops/buffer.h"
#include "ops/ops.h"

namespace {

using llmtrain::Device;
using llmtrain::DType;
using llmtrain::Tensor;
namespace ops = llmtrain::ops;
namespace op_cases = llmtrain::op_cases;

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

// The tensors of one case on the device: uniform values in each tensor's range (rounded once to
// bf16 where bf16), token ids in theirs; an absent tensor is a Tensor without data.
class DeviceCase {
 public:
  DeviceCase(const op_cases::OpCase& c, DType act, std::mt19937_64& rng) {
    buffers_.reserve(c.args.size());
    for (const op_cases::Arg& a : c.args) {
      if (a.role == op_cases::Role::absent) {
        args_.add(a.name, Tensor());
        continue;
      }
      const DType dtype = op_cases::dtype_in_run(a, act);
      buffers_.emplace_back(Device::cuda, op_cases::numel(a.shape) * llmtrain::dtype_size(dtype));
      const Tensor t = op_cases::view(buffers_.back().data(), dtype, Device::cuda, a.shape);
      fill(t, a, rng);
      args_.add(a.name, t);
    }
  }
  const op_cases::Args& args() const { return args_; }

 private:
  static void fill(const Tensor& t, const op_cases::Arg& a, std::mt19937_64& rng) {
    const std::int64_t n = t.numel();
    const Tensor flat = t.reshape({n});
    if (t.dtype == DType::i32) {
      std::vector<std::int32_t> host(std::size_t(n), 0);
      std::uniform_int_distribution<std::int64_t> u(std::int64_t(a.lo), std::int64_t(a.hi) - 1);
      for (auto& x : host) x = std::int32_t(u(rng));
      ops::copy(flat, Tensor(host.data(), DType::i32, Device::cpu, {n}));
      return;
    }
    std::vector<float> host(std::size_t(n), a.lo);
    if (a.lo != a.hi) {
      std::uniform_real_distribution<float> u(a.lo, a.hi);
      for (auto& x : host) x = u(rng);
    }
    const Tensor src(host.data(), DType::f32, Device::cpu, {n});
    if (t.dtype == DType::f32) {
      ops::copy(flat, src);
    } else {  // f32 on the device, then rounded there
      ops::Buffer wide(Device::cuda, host.size() * sizeof(float));
      const Tensor w(wide.data(), DType::f32, Device::cuda, {n});
      ops::copy(w, src);
      ops::convert(flat, w);
      llmtrain::device::synchronize();
    }
  }

  std::vector<ops::Buffer> buffers_;
  op_cases::Args args_;
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
    if (!wants(op)) return;
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
  /// Adds the row of an op that did not run: skipped (and why), or failed before it could.
  void skip(const std::string& op, const std::string& shape, const std::string& why) {
    not_run(op, shape, "skipped: " + why);
  }
  void fail(const std::string& op, const std::string& shape, const std::string& error) {
    not_run(op, shape, error);
  }
  /// Whether `--only` selects the row `op`.
  bool wants(const std::string& op) const {
    return o_.only.empty() || op.find(o_.only) != std::string::npos;
  }
  const std::vector<Row>& rows() const { return rows_; }

 private:
  void not_run(const std::string& op, const std::string& shape, const std::string& error) {
    if (wants(op)) rows_.push_back(Row{op, shape, 0.0, 0.0, 0.0, error});
  }

  const Options& o_;
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
  std::vector<Row> rows_;
};

// Every timing case of the registry at the model's shapes, each step a row, in the registry's order.
void run_all(const Options& o, Bench& bench) {
  const op_cases::ModelShape model{o.B, o.T, o.C, o.NH, o.V, o.dtype};
  std::mt19937_64 rng(20240520);
  for (const op_cases::OpCase& c : op_cases::timing_cases(model)) {
    std::vector<const op_cases::Step*> rows;
    for (const op_cases::Step& s : c.steps) {
      if (s.timed) rows.push_back(&s);
    }
    const auto wanted = [&](const op_cases::Step* s) { return bench.wants(s->name); };
    if (std::none_of(rows.begin(), rows.end(), wanted)) continue;
    if (!c.skip.empty()) {
      for (const op_cases::Step* s : rows) bench.skip(s->name, c.shape, c.skip);
      continue;
    }
    // The case's tensors live until its last row; an allocation or an untimed step that fails
    // fails the rows still to come.
    std::optional<DeviceCase> tensors;
    try {
      tensors.emplace(c, o.dtype, rng);
    } catch (const std::exception& e) {
      for (const op_cases::Step* s : rows) bench.fail(s->name, c.shape, e.what());
      continue;
    }
    for (std::size_t k = 0; k < c.steps.size(); ++k) {
      const op_cases::Step& s = c.steps[k];
      if (s.timed) {
        bench.time(s.name, c.shape, s.bytes(o.dtype), s.flops, [&] { s.call(tensors->args()); });
        continue;
      }
      try {
        s.call(tensors->args());
      } catch (const std::exception& e) {
        for (std::size_t j = k + 1; j < c.steps.size(); ++j) {
          if (c.steps[j].timed) bench.fail(c.steps[j].name, c.shape, s.name + ": " + e.what());
        }
        break;
      }
    }
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
