// The matmul's cuBLASLt algorithm choice (kernels/cuda/matmul.cu, AlgoCache) against the
// emulated cuBLASLt, whose heuristic is told (llmtrain_emu/cublaslt_control.h) to offer several
// algorithms of which the first few are turned down: the matmul must still be right, the chosen
// algorithm must be cached and reused, and a shape that nothing runs must be an error naming it.
// Every case uses shapes of its own: the algorithm cache lives as long as the process.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "catch_compat.h"
#include "llmtrain_emu/cublaslt_control.h"
#include "llmtrain/kernels/cpu.h"
#include "llmtrain/kernels/cuda.h"
#include "llmtrain/kernels/error.h"

using namespace llmtrain;
using llmtrain_emu::CublasLtCandidates;
using llmtrain_emu::CublasLtCounts;
using llmtrain_emu::cublaslt_counts;

namespace {

// Sets what the emulated heuristic offers for the life of the object.
class OfferedAlgorithms {
 public:
  OfferedAlgorithms(int offered, int rejected) : saved_(llmtrain_emu::cublaslt_candidates()) {
    llmtrain_emu::set_cublaslt_candidates(CublasLtCandidates{offered, rejected});
  }
  ~OfferedAlgorithms() { llmtrain_emu::set_cublaslt_candidates(saved_); }
  OfferedAlgorithms(const OfferedAlgorithms&) = delete;
  OfferedAlgorithms& operator=(const OfferedAlgorithms&) = delete;

 private:
  CublasLtCandidates saved_;
};

template <class T>
class DeviceArray {
 public:
  explicit DeviceArray(std::size_t n) : n_(n) {
    REQUIRE(cudaMalloc(reinterpret_cast<void**>(&data_), n * sizeof(T)) == cudaSuccess);
  }
  explicit DeviceArray(const std::vector<T>& host) : DeviceArray(host.size()) {
    REQUIRE(cudaMemcpy(data_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice) == cudaSuccess);
  }
  ~DeviceArray() { cudaFree(data_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  T* get() const { return data_; }
  std::vector<T> read() const {
    std::vector<T> host(n_);
    REQUIRE(cudaMemcpy(host.data(), data_, n_ * sizeof(T), cudaMemcpyDeviceToHost) == cudaSuccess);
    return host;
  }

 private:
  T* data_ = nullptr;
  std::size_t n_;
};

// Small integers: every product and sum is exact in fp32, so GPU and CPU agree bit for bit.
std::vector<float> integers(std::size_t n, int seed) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = float(int((i * 7 + std::size_t(seed) * 13) % 5) - 2);
  return v;
}

CublasLtCounts since(const CublasLtCounts& before) {
  CublasLtCounts now = cublaslt_counts();
  now.heuristic_calls -= before.heuristic_calls;
  now.matmul_calls -= before.matmul_calls;
  now.rejected_calls -= before.rejected_calls;
  return now;
}

// The cuBLASLt handle and workspace every case's matmuls run with (as the op layer keeps one).
const cuda::Blas& blas() {
  static const cuda::Blas made = cuda::create_blas();
  return made;
}

// The message of the kernel library's error that `f` throws ("" when it throws none).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const kernels::Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("cuBLASLt fallback: the first algorithm that runs does the matmul, and is cached", "[cuda][matmul]") {
  const std::int64_t N = 5;
  const int C = 7, OC = 6;
  const auto inp = integers(std::size_t(N) * C, 1), weight = integers(std::size_t(OC) * C, 2),
             bias = integers(OC, 3), dout = integers(std::size_t(N) * OC, 4);
  std::vector<float> out_ref(std::size_t(N) * OC), dinp_ref = integers(std::size_t(N) * C, 5),
      dweight_ref = integers(std::size_t(OC) * C, 6), dbias_ref(OC, 0.0f);
  const DeviceArray<float> d_inp(inp), d_weight(weight), d_bias(bias), d_dout(dout), d_out(out_ref.size()),
      d_dinp(dinp_ref), d_dweight(dweight_ref), d_dbias(dbias_ref);
  cpu::matmul_forward(out_ref.data(), inp.data(), weight.data(), bias.data(), N, C, OC, OC);
  cpu::matmul_backward(dinp_ref.data(), dweight_ref.data(), dbias_ref.data(), dout.data(), inp.data(),
                       weight.data(), N, C, OC, OC, true);

  const OfferedAlgorithms offered(8, 3);  // of 8 algorithms, #0-#2 are turned down
  CublasLtCounts before = cublaslt_counts();
  cuda::matmul_forward(d_out.get(), d_inp.get(), d_weight.get(), d_bias.get(), N, C, OC, OC, blas(), nullptr);
  CHECK(d_out.read() == out_ref);
  CublasLtCounts counts = since(before);
  CHECK(counts.heuristic_calls == 1);
  CHECK(counts.rejected_calls == 3);
  CHECK(counts.matmul_calls == 4);
  CHECK(counts.last_rank == 3);

  // Backward accumulates (beta = 1) into dinp and dweight: the turned-down algorithms must have
  // left them alone. Two products, so two choices.
  before = cublaslt_counts();
  cuda::matmul_backward(d_dinp.get(), d_dweight.get(), d_dbias.get(), d_dout.get(), d_inp.get(), d_weight.get(),
                        N, C, OC, OC, true, blas(), nullptr);
  CHECK(d_dinp.read() == dinp_ref);
  CHECK(d_dweight.read() == dweight_ref);
  CHECK(d_dbias.read() == dbias_ref);
  counts = since(before);
  CHECK(counts.heuristic_calls == 2);
  CHECK(counts.rejected_calls == 6);
  CHECK(counts.last_rank == 3);

  // The same shape again: the cached algorithm, no heuristic, nothing turned down; and still #3
  // when the heuristic would now offer #0 as working (one algorithm per shape per process).
  const OfferedAlgorithms all_run(8, 0);
  before = cublaslt_counts();
  cuda::matmul_forward(d_out.get(), d_inp.get(), d_weight.get(), d_bias.get(), N, C, OC, OC, blas(), nullptr);
  CHECK(d_out.read() == out_ref);
  counts = since(before);
  CHECK(counts.heuristic_calls == 0);
  CHECK(counts.matmul_calls == 1);
  CHECK(counts.rejected_calls == 0);
  CHECK(counts.last_rank == 3);
}

TEST_CASE("cuBLASLt fallback: a matmul shape that no algorithm runs is an error naming it", "[cuda][matmul]") {
  SECTION("every algorithm offered is turned down") {
    const std::int64_t N = 3;
    const int C = 9, OC = 11;
    const auto inp = integers(std::size_t(N) * C, 1), weight = integers(std::size_t(OC) * C, 2),
               bias = integers(OC, 3);
    const DeviceArray<float> d_inp(inp), d_weight(weight), d_bias(bias), d_out(std::size_t(N) * OC);
    const auto forward = [&] {
      cuda::matmul_forward(d_out.get(), d_inp.get(), d_weight.get(), d_bias.get(), N, C, OC, OC, blas(), nullptr);
    };
    {
      const OfferedAlgorithms offered(4, 4);
      const CublasLtCounts before = cublaslt_counts();
      const std::string message = error_of(forward);
      INFO(message);
      CHECK(message.find("cuBLASLt has no algorithm") != std::string::npos);
      CHECK(message.find("forward out = inp W^T (N=3, C=9, OC=11)") != std::string::npos);
      CHECK(message.find("fp32 inputs, fp32 output") != std::string::npos);
      CHECK(message.find("m=11 n=3 k=9, A transposed, B not transposed") != std::string::npos);
      CHECK(message.find("bias epilogue") != std::string::npos);
      CHECK(message.find("alignment A/B/D/bias 256/256/256/256 bytes") != std::string::npos);
      CHECK(message.find("offered 4 algorithm(s)") != std::string::npos);
      CHECK(message.find("#3: CUBLAS_STATUS_NOT_SUPPORTED") != std::string::npos);
      CHECK(since(before).rejected_calls == 4);
    }
    // Nothing was cached for the shape: once an algorithm runs, it works.
    forward();
    std::vector<float> out_ref(std::size_t(N) * OC);
    cpu::matmul_forward(out_ref.data(), inp.data(), weight.data(), bias.data(), N, C, OC, OC);
    CHECK(d_out.read() == out_ref);
  }
  SECTION("the heuristic has none (bf16, an odd alignment)") {
    const std::int64_t N = 2;
    const int C = 13, OC = 5;
    const DeviceArray<cuda::bf16> d_inp(std::size_t(N) * C + 1), d_weight(std::size_t(OC) * C),
        d_out(std::size_t(N) * OC);
    const OfferedAlgorithms offered(0, 0);
    const std::string message = error_of([&] {
      // inp one element in: 2-byte aligned.
      cuda::matmul_forward<cuda::bf16>(d_out.get(), d_inp.get() + 1, d_weight.get(), nullptr, N, C, OC, OC, blas(),
                                       nullptr);
    });
    INFO(message);
    CHECK(message.find("forward out = inp W^T (N=2, C=13, OC=5)") != std::string::npos);
    CHECK(message.find("bf16 inputs, bf16 output") != std::string::npos);
    CHECK(message.find("no epilogue") != std::string::npos);
    CHECK(message.find("alignment A/B/D/bias 256/2/256/- bytes") != std::string::npos);
    CHECK(message.find("the heuristic returned CUBLAS_STATUS_NOT_SUPPORTED") != std::string::npos);
  }
}
