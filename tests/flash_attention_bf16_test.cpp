// The bf16 flash-attention kernels (CUDA-core and tensor-core, the single-pass backward included)
// and cuDNN's fused attention, called directly in a CUDA build, against the CPU reference.
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "catch_compat.h"
#include "core/error.h"
#include "cuda_compare.h"
#include "flash_attention_check.h"
#include "grad_check.h"
#include "ops/buffer.h"
#include "ops/ops.h"
#if LLMTRAIN_HAVE_CUDA
#include "llmtrain/kernels/cudnn_attention.h"
#include "llmtrain/kernels/flash_attention.h"
#include "device/stream.h"
#endif

using namespace llmtrain;
using namespace llmtrain::test;

#if LLMTRAIN_HAVE_CUDA
namespace {

// A device array of bf16 as the kernels take it.
cuda::bf16* bf(const DeviceArray<Bf16>& a) { return reinterpret_cast<cuda::bf16*>(a.data()); }

// One shape through the tensor-core kernels (16-byte aligned tensors, head size 64 or 128): the
// forward, then the backward that set_flash_attention_deterministic chose, onto a pre-filled
// dqkv, against the CPU reference run on the same bf16-rounded inputs. Same tolerances as the
// CUDA-core bf16 kernels; P and dS are rounded to bf16 as matrix operands here, which they stay
// well within.
void check_tensor_core_flash(const AttnShape& s, std::mt19937& rng) {
  constexpr double bf16_tol = 1e-2, lse_tol = 2e-3;
  const int B = s.B, T = s.T, NH = s.NH, NKV = s.NKV, HS = s.HS, C = s.C(), W = s.width();
  Vec qkv = round_bf16(random_vec(rng, s.n_qkv(), 1.5f)), dout = round_bf16(random_vec(rng, s.n_out()));
  // Pre-filled, smaller than what the backward adds, so that each part's error is measured
  // against its gradient rather than against the starting values (a backward that overwrote
  // instead of adding would still be off by far more than the tolerance).
  const Vec dqkv0 = round_bf16(random_vec(rng, s.n_qkv(), 0.1f));
  const FlashResult want = cpu_flash(s, qkv, dout, dqkv0);

  // 8 elements (16 bytes) of leading guard: aligned, with sentinels on both sides.
  constexpr std::size_t guard = 8;
  const DeviceArray<Bf16> d_qkv(to_bf16(qkv), guard), d_dout(to_bf16(dout), guard), d_dqkv(to_bf16(dqkv0), guard),
      d_out(to_bf16(nan_vec(s.n_out())), guard);
  const DeviceArray<float> d_lse(nan_vec(s.n_lse()), 4);
  REQUIRE(cuda::flash_attention_uses_tensor_cores(HS, d_qkv.data(), d_out.data()));
  const cudaStream_t stream = device::compute_stream();
  cuda::flash_attention_forward(bf(d_out), d_lse.data(), bf(d_qkv), B, T, C, NH, NKV, stream);
  require_close("out", to_float(d_out.to_host()), want.out, bf16_tol);
  require_close("lse", d_lse.to_host(), want.lse, lse_tol);
  cuda::flash_attention_backward(bf(d_dqkv), bf(d_dout), bf(d_qkv), bf(d_out), d_lse.data(), B, T, C, NH, NKV,
                                 true, stream);
  const Vec dqkv = to_float(d_dqkv.to_host());
  const Vec zeros(dqkv.size(), 0.0f);
  require_close("dq", increment(dqkv, zeros, W, 0, C), increment(want.dqkv, zeros, W, 0, C), bf16_tol);
  require_close("dk", increment(dqkv, zeros, W, C, C + NKV * HS), increment(want.dqkv, zeros, W, C, C + NKV * HS),
                bf16_tol);
  require_close("dv", increment(dqkv, zeros, W, C + NKV * HS, W), increment(want.dqkv, zeros, W, C + NKV * HS, W),
                bf16_tol);
  if (T > 1) CHECK_FALSE(all_zero(increment(dqkv, dqkv0, W, 0, C)));  // dq changed
  for (const auto* a : {&d_qkv, &d_dout, &d_dqkv, &d_out}) require_guards("tensor-core flash attention", *a);
  require_guards("lse", d_lse);
}

// check_tensor_core_flash at head sizes 64 and 128, each of these T, and GQA groups of 1, 2 and 4
// (4 query heads); B = 2 for the short sequences.
void check_tensor_core_shapes(std::initializer_list<int> Ts, std::mt19937& rng) {
  const int NH = 4;
  for (const int HS : {64, 128}) {
    for (const int T : Ts) {
      for (const int NKV : {NH, NH / 2, 1}) {
        const int B = T <= 65 ? 2 : 1;
        CAPTURE(B, T, HS, NKV);
        check_tensor_core_flash(AttnShape{B, T, NH, NKV, HS}, rng);
      }
    }
  }
}

// train.deterministic false for one scope (ops::set_deterministic, as the trainer sets it), the
// default again after it, also when a check fails.
struct SinglePassBackward {
  SinglePassBackward() { ops::set_deterministic(false); }
  ~SinglePassBackward() { ops::set_deterministic(true); }
  SinglePassBackward(const SinglePassBackward&) = delete;
  SinglePassBackward& operator=(const SinglePassBackward&) = delete;
};

}  // namespace
#endif

TEST_CASE("cuda bf16 flash attention matches the cpu reference", "[cuda][bf16][flash]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);
#if LLMTRAIN_HAVE_CUDA
  // bf16 outputs: a few ulps (2^-8 relative) of the largest element; lse is fp32 from the same
  // bf16 inputs as the reference.
  constexpr double bf16_tol = 1e-2, lse_tol = 2e-3;
  std::mt19937 rng(223);
  const int NH = 4;
  std::size_t offset = 0;
  for (const int B : {1, 2}) {
    for (const int T : {1, 7, 64, 65, 300}) {
      for (const int HS : {16, 64, 128}) {
        for (const int NKV : {NH, NH / 2, 1}) {
          const AttnShape s{B, T, NH, NKV, HS};
          const int C = s.C(), W = s.width();
          offset = 1 - offset;  // every other case 2 bytes off 16-byte alignment
          CAPTURE(B, T, HS, NKV, offset);
          Vec qkv = round_bf16(random_vec(rng, s.n_qkv(), 1.5f)),
              dout = round_bf16(random_vec(rng, s.n_out()));
          // Pre-filled, smaller than what the backward adds, so that each part's error is measured
          // against its gradient rather than against the starting values.
          const Vec dqkv0 = round_bf16(random_vec(rng, s.n_qkv(), 0.1f));
          const FlashResult want = cpu_flash(s, qkv, dout, dqkv0);

          // Outputs start as NaN: an element never written fails the NaN check.
          const DeviceArray<Bf16> d_qkv(to_bf16(qkv), offset), d_dout(to_bf16(dout), offset),
              d_dqkv(to_bf16(dqkv0), offset), d_out(to_bf16(nan_vec(s.n_out())), offset);
          const DeviceArray<float> d_lse(nan_vec(s.n_lse()), offset);
          const cudaStream_t stream = device::compute_stream();
          cuda::flash_attention_forward(bf(d_out), d_lse.data(), bf(d_qkv), B, T, C, NH, NKV, stream);
          cuda::flash_attention_backward(bf(d_dqkv), bf(d_dout), bf(d_qkv), bf(d_out), d_lse.data(), B, T, C,
                                         NH, NKV, true, stream);
          require_close("out", to_float(d_out.to_host()), want.out, bf16_tol);
          require_close("lse", d_lse.to_host(), want.lse, lse_tol);
          const Vec dqkv = to_float(d_dqkv.to_host());
          require_changed("dqkv", dqkv, dqkv0);
          // dq, dk and dv (totals, after the +=) each against its own largest element.
          const Vec zeros(dqkv.size(), 0.0f);
          require_close("dq", increment(dqkv, zeros, W, 0, C), increment(want.dqkv, zeros, W, 0, C),
                        bf16_tol);
          require_close("dk", increment(dqkv, zeros, W, C, C + NKV * HS),
                        increment(want.dqkv, zeros, W, C, C + NKV * HS), bf16_tol);
          require_close("dv", increment(dqkv, zeros, W, C + NKV * HS, W),
                        increment(want.dqkv, zeros, W, C + NKV * HS, W), bf16_tol);
          // With T = 1 the q and k parts add nothing (one key: a constant softmax); else each part
          // must have changed.
          if (T > 1) {
            CHECK_FALSE(all_zero(increment(dqkv, dqkv0, W, 0, C)));             // dq
            CHECK_FALSE(all_zero(increment(dqkv, dqkv0, W, C, C + NKV * HS)));  // dk
          }
          CHECK_FALSE(all_zero(increment(dqkv, dqkv0, W, C + NKV * HS, W)));  // dv
          for (const auto* a : {&d_qkv, &d_dout, &d_dqkv, &d_out}) require_guards("bf16 flash attention", *a);
          require_guards("lse", d_lse);
        }
      }
    }
  }
#endif
}

TEST_CASE("cuda bf16 tensor-core flash attention matches the cpu reference", "[cuda][bf16][flash]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);
#if LLMTRAIN_HAVE_CUDA
  // The mma.sync kernels and the default (deterministic, two-kernel) backward: T not a multiple
  // of the 64-row tiles, one and several key tiles, GQA groups of 1, 2 and 4.
  REQUIRE(cuda::flash_attention_deterministic());
  std::mt19937 rng(227);
  check_tensor_core_shapes({1, 17, 64, 65, 130, 257}, rng);
#endif
}

TEST_CASE("cuda bf16 tensor-core single-pass flash backward (train.deterministic false) matches the cpu reference",
          "[cuda][bf16][flash]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);
#if LLMTRAIN_HAVE_CUDA
  // dQ by atomics into the fp32 accumulator, then added into dqkv: T not a multiple of the tiles
  // (64 keys per block, 64 or 32 queries per step), B = 2, GQA groups of 1, 2 and 4 (the block
  // loops over the group's query heads), dqkv pre-filled.
  const SinglePassBackward single_pass;
  REQUIRE_FALSE(cuda::flash_attention_deterministic());
  std::mt19937 rng(229);
  check_tensor_core_shapes({1, 17, 65, 130}, rng);
#endif
}

TEST_CASE("cuda bf16 tensor-core flash backward is bitwise repeatable by default, also after single-pass runs",
          "[cuda][bf16][flash]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);
#if LLMTRAIN_HAVE_CUDA
  // The default backward twice, then the single pass, then the default again, each from the same
  // pre-filled dqkv: every default run gives the same bytes, and so the switch leaves no trace.
  // (Under the emulator the single pass repeats too, blocks running in a fixed order; on a GPU
  // its dQ may differ in the last bits, so it is only compared within tolerance.)
  std::mt19937 rng(231);
  for (const int HS : {64, 128}) {
    const AttnShape s{2, 130, 4, 2, HS};
    const int B = s.B, T = s.T, NH = s.NH, NKV = s.NKV, C = s.C(), W = s.width();
    CAPTURE(HS);
    const Vec qkv = round_bf16(random_vec(rng, s.n_qkv(), 1.5f)), dout = round_bf16(random_vec(rng, s.n_out()));
    const std::vector<Bf16> dqkv0 = to_bf16(round_bf16(random_vec(rng, s.n_qkv(), 0.1f)));
    const DeviceArray<Bf16> d_qkv(to_bf16(qkv)), d_dout(to_bf16(dout)), d_out(to_bf16(nan_vec(s.n_out())));
    const DeviceArray<float> d_lse(nan_vec(s.n_lse()));
    REQUIRE(cuda::flash_attention_uses_tensor_cores(HS, d_qkv.data(), d_out.data()));
    const cudaStream_t stream = device::compute_stream();
    cuda::flash_attention_forward(bf(d_out), d_lse.data(), bf(d_qkv), B, T, C, NH, NKV, stream);
    const auto backward = [&] {
      const DeviceArray<Bf16> d_dqkv(dqkv0);
      cuda::flash_attention_backward(bf(d_dqkv), bf(d_dout), bf(d_qkv), bf(d_out), d_lse.data(), B, T, C, NH, NKV,
                                     true, stream);
      require_guards("dqkv", d_dqkv);
      return to_float(d_dqkv.to_host());
    };
    const auto same_bytes = [](const Vec& a, const Vec& b) {
      return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
    };
    REQUIRE(cuda::flash_attention_deterministic());
    const Vec first = backward();
    CHECK(same_bytes(backward(), first));
    Vec single;
    {
      const SinglePassBackward single_pass;
      single = backward();
    }
    REQUIRE(cuda::flash_attention_deterministic());
    CHECK(same_bytes(backward(), first));
    // The single pass's dK and dV come from another instantiation of the dK/dV kernel (the one that
    // also adds dQ): the same sums in the same order, but nvcc may contract them into FMAs
    // differently, so they agree within a few bf16 ulps, not bit for bit; its dQ agrees within the
    // bf16 tolerance. (The bitwise checks above run the same kernel twice.)
    const Vec zeros(first.size(), 0.0f);
    require_close("dk and dv, single pass against the default", increment(single, zeros, W, C, W),
                  increment(first, zeros, W, C, W), 1e-2);
    require_close("dq, single pass against the default", increment(single, zeros, W, 0, C),
                  increment(first, zeros, W, 0, C), 1e-2);
  }
#endif
}

TEST_CASE("cudnn fused attention matches the cpu reference and the bf16 kernels", "[cuda][cudnn][flash]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);
#if LLMTRAIN_HAVE_CUDA
  if (!cuda::cudnn_attention_available(&why)) LLMTRAIN_SKIP("no cuDNN attention here: " + why);
  // As the bf16 kernels' test: bf16 outputs to a few ulps of the largest element, lse fp32.
  constexpr double bf16_tol = 1e-2, lse_tol = 2e-3;
  const cudaStream_t stream = device::compute_stream();
  std::mt19937 rng(224);
  const int NH = 4;
  for (const int B : {1, 2}) {
    for (const int T : {1, 64, 257}) {
      for (const int HS : {64, 128}) {
        for (const int NKV : {NH, NH / 2}) {
          const AttnShape s{B, T, NH, NKV, HS};
          const int C = s.C(), W = s.width();
          CAPTURE(B, T, HS, NKV);
          if (!cuda::cudnn_attention_supported(B, T, C, NH, NKV, &why)) {
            // cuDNN may lack an engine for an edge shape (say T = 1), but a graph it refuses at
            // the plainest shape is a mistake in the graph, not a gap in cuDNN.
            if (B == 1 && T == 64 && HS == 64 && NKV == NH) FAIL("cuDNN refuses the plainest shape: " << why);
            WARN("cuDNN has no engine for this shape, not compared: " << why);
            continue;
          }
          Vec qkv = round_bf16(random_vec(rng, s.n_qkv(), 1.5f)),
              dout = round_bf16(random_vec(rng, s.n_out()));
          const Vec dqkv0 = round_bf16(random_vec(rng, s.n_qkv(), 0.1f));  // the backward adds to this
          const FlashResult want = cpu_flash(s, qkv, dout, dqkv0);

          // 16-byte aligned (cuDNN's requirement); outputs start as NaN, so an element never written
          // fails the NaN check, and sentinels frame every array.
          const DeviceArray<Bf16> d_qkv(to_bf16(qkv)), d_dout(to_bf16(dout)), d_dqkv(to_bf16(dqkv0)),
              d_out(to_bf16(nan_vec(s.n_out())));
          const DeviceArray<float> d_lse(nan_vec(s.n_lse()));
          cuda::cudnn_attention_forward(bf(d_out), d_lse.data(), bf(d_qkv), B, T, C, NH, NKV, stream);
          cuda::cudnn_attention_backward(bf(d_dqkv), bf(d_dout), bf(d_qkv), bf(d_out), d_lse.data(), B, T, C,
                                         NH, NKV, true, stream);
          const Vec out = to_float(d_out.to_host()), lse = d_lse.to_host(), dqkv = to_float(d_dqkv.to_host());
          require_close("out", out, want.out, bf16_tol);
          require_close("lse", lse, want.lse, lse_tol);
          require_changed("dqkv", dqkv, dqkv0);
          // dq, dk and dv (totals, after the +=) each against its own largest element.
          const Vec zeros(dqkv.size(), 0.0f);
          require_close("dq", increment(dqkv, zeros, W, 0, C), increment(want.dqkv, zeros, W, 0, C),
                        bf16_tol);
          require_close("dk", increment(dqkv, zeros, W, C, C + NKV * HS),
                        increment(want.dqkv, zeros, W, C, C + NKV * HS), bf16_tol);
          require_close("dv", increment(dqkv, zeros, W, C + NKV * HS, W),
                        increment(want.dqkv, zeros, W, C + NKV * HS, W), bf16_tol);
          if (T > 1) {  // with one key the softmax is constant: dq and dk add nothing
            CHECK_FALSE(all_zero(increment(dqkv, dqkv0, W, 0, C)));
            CHECK_FALSE(all_zero(increment(dqkv, dqkv0, W, C, C + NKV * HS)));
          }
          CHECK_FALSE(all_zero(increment(dqkv, dqkv0, W, C + NKV * HS, W)));
          for (const auto* a : {&d_qkv, &d_dout, &d_dqkv, &d_out}) require_guards("cudnn attention", *a);
          require_guards("lse", d_lse);

          // Against our bf16 kernels directly, on the same inputs (and cuDNN's out and lse for the
          // backward, so that only the backward differs).
          const DeviceArray<Bf16> k_out(to_bf16(nan_vec(s.n_out()))), k_dqkv(to_bf16(dqkv0));
          const DeviceArray<float> k_lse(nan_vec(s.n_lse()));
          cuda::flash_attention_forward(bf(k_out), k_lse.data(), bf(d_qkv), B, T, C, NH, NKV, stream);
          cuda::flash_attention_backward(bf(k_dqkv), bf(d_dout), bf(d_qkv), bf(d_out), d_lse.data(), B, T, C,
                                         NH, NKV, true, stream);
          require_close("out, cuDNN against the bf16 kernel", out, to_float(k_out.to_host()), bf16_tol);
          require_close("lse, cuDNN against the bf16 kernel", lse, k_lse.to_host(), lse_tol);
          const Vec k_dqkv_host = to_float(k_dqkv.to_host());
          for (const auto& [name, from, to] : {std::tuple{"dq", 0, C}, std::tuple{"dk", C, C + NKV * HS},
                                               std::tuple{"dv", C + NKV * HS, W}}) {
            require_close(std::string(name) + ", cuDNN against the bf16 kernel",
                          increment(dqkv, zeros, W, from, to), increment(k_dqkv_host, zeros, W, from, to),
                          bf16_tol);
          }
        }
      }
    }
  }

  // A pointer off 16-byte alignment is refused, not passed to cuDNN.
  const AttnShape s{1, 64, NH, NH, 64};
  const DeviceArray<Bf16> d_qkv(to_bf16(round_bf16(random_vec(rng, s.n_qkv()))), 1),
      d_out(to_bf16(nan_vec(s.n_out())));
  const DeviceArray<float> d_lse(nan_vec(s.n_lse()));
  std::string message;
  try {
    cuda::cudnn_attention_forward(bf(d_out), d_lse.data(), bf(d_qkv), s.B, s.T, s.C(), NH, NH, stream);
  } catch (const RuntimeError& e) {
    message = e.what();
  }
  CHECK(message.find("16-byte aligned") != std::string::npos);
#endif
}
