// cuDNN's fused flash attention (cudnn_attention.h) through the cuDNN 9 backend graph API, without
// cudnn_frontend. The graphs are written out node by node in the pattern that cuDNN's runtime-fusion
// SDPA engines recognise (the one cudnn_frontend's composite SDPA nodes lower to; the single SDPA
// operation descriptors of cuDNN 9.13+ take no causal mask before 9.21). A plan is built per shape
// from the heuristics' engine configs (the first that finalizes) and kept for the process.
//
// Forward (S the scores, (B,NH,T,T); virtual tensors fp32 unless said):
//   S = Q K^T;  S *= 1/sqrt(HS);  S = row >= col ? S : lowest    (GEN_INDEX x2, CMP_GE, BINARY_SELECT)
//   M = rowmax S;  E = exp(S - M);  Z = rowsum E;  Stats = M + log Z   (= our lse, written out)
//   P = E / Z (bf16);  O = P V
// Backward (the probabilities recomputed from Stats):
//   Dsum = rowsum(dO * O)           (a graph output the engine keeps in our scratch: softmax_sum)
//   P = exp(causal(Q K^T / sqrt(HS) - Stats));  dV = P^T dO
//   dS = (dO V^T - Dsum) * P / sqrt(HS);  dK = dS^T Q;  dQ = dS K (into an fp32 accumulator, then bf16)
// Q, K, V (and dQ, dK, dV) are strided views into the packed rows of width W = (NH + 2 NKV) HS:
// dims (B, heads, T, HS), strides (T W, HS, W, 1); K^T and V^T swap the last two dims and strides.
// GQA: K and V keep their NKV heads and cuDNN maps query head h to kv head h / (NH/NKV) (its
// "b (hk g)" grouping, our convention); dK and dV are formed per query head and summed over each
// group by a reduction node.
#include "llmtrain/kernels/cudnn_attention.h"

#include <string>

#include "llmtrain/kernels/error.h"

#if LLMTRAIN_HAVE_CUDNN
#include <cudnn.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "cuda_check.h"
#include "cudnn_graph.h"
#include "launch.cuh"
#include "vector_io.cuh"
#endif

#if LLMTRAIN_HAVE_CUDNN

namespace llmtrain::cuda {
namespace {

// cuDNN 9.16 is the oldest release whose SDPA backward needs no padding-mask workaround when T is
// not a multiple of 128 (cudnn_frontend adds one up to 9.15); 9.10.0/9.10.1 had forward bugs.
constexpr std::size_t kMinCudnnVersion = 91600;

std::string version_string(std::size_t v) {
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
}

using cudnn::Descriptor;
using cudnn::Desc;
using cudnn::Dims;
using cudnn::GraphBuilder;

// The tensors bound at execution (the variant pack); virtual tensors number from kFirstVirtual.
// kK and kV are K^T and V^T in the backward graph (the same memory, other dims and strides).
enum Uid : std::int64_t {
  // forward
  kQ = 1,
  kK,
  kV,
  kO,
  kStats,
  kScale,
  kLowest,
  // and backward
  kDO,
  kDQ,
  kDK,
  kDV,
  kDotSum,
  kDQAccum,
  kOne,
  kFirstVirtual = 100,
};

// One shape's dimensions, in cuDNN's int64.
struct Shape {
  std::int64_t B, T, NH, NKV, HS, C, W;
  Shape(int B_, int T_, int C_, int NH_, int NKV_)
      : B(B_), T(T_), NH(NH_), NKV(NKV_), HS(C_ / NH_), C(C_), W(std::int64_t(NH_ + 2 * NKV_) * (C_ / NH_)) {}
  Dims heads_strides() const { return {T * W, HS, W, 1}; }  // Q, K, V, dQ, dK, dV: heads of the packed rows
  Dims transposed_strides() const { return {T * W, HS, 1, W}; }  // K^T, V^T
  Dims out_strides() const { return {T * C, HS, C, 1}; }         // out, dout (B,T,C)
  Dims scores() const { return {B, NH, T, T}; }
  Dims scores_strides() const { return {NH * T * T, T * T, T, 1}; }
  Dims transposed_scores_strides() const { return {NH * T * T, T * T, 1, T}; }
  Dims rows() const { return {B, NH, T, 1}; }  // lse and the other per-row statistics
  Dims rows_strides() const { return {NH * T, T, 1, 1}; }
};

void build_forward(GraphBuilder& g, const Shape& s) {
  const Desc q = g.tensor(kQ, CUDNN_DATA_BFLOAT16, {s.B, s.NH, s.T, s.HS}, s.heads_strides());
  const Desc kt = g.tensor(kK, CUDNN_DATA_BFLOAT16, {s.B, s.NKV, s.HS, s.T}, s.transposed_strides());
  const Desc v = g.tensor(kV, CUDNN_DATA_BFLOAT16, {s.B, s.NKV, s.T, s.HS}, s.heads_strides());
  const Desc o = g.tensor(kO, CUDNN_DATA_BFLOAT16, {s.B, s.NH, s.T, s.HS}, s.out_strides());
  const Desc stats = g.tensor(kStats, CUDNN_DATA_FLOAT, s.rows(), s.rows_strides());
  const Desc scale = g.scalar(kScale), lowest = g.scalar(kLowest);
  const auto scores = [&](cudnnDataType_t type = CUDNN_DATA_FLOAT) {
    return g.intermediate(type, s.scores(), s.scores_strides());
  };
  const auto rows = [&] { return g.intermediate(CUDNN_DATA_FLOAT, s.rows(), s.rows_strides()); };

  const Desc s_raw = scores(), s_scaled = scores();
  g.matmul(s_raw, q, kt);
  g.pointwise(CUDNN_POINTWISE_MUL, s_scaled, s_raw, scale);
  const Desc s_masked = g.causal_mask(s_scaled, lowest, s.scores(), s.scores_strides());
  const Desc m = rows(), centered = scores(), e = scores(), z = rows(), log_z = rows();
  g.reduction(CUDNN_REDUCE_TENSOR_MAX, m, s_masked);
  g.pointwise(CUDNN_POINTWISE_SUB, centered, s_masked, m);
  g.pointwise(CUDNN_POINTWISE_EXP, e, centered);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, z, e);
  g.pointwise(CUDNN_POINTWISE_LOG, log_z, z);
  g.pointwise(CUDNN_POINTWISE_ADD, stats, m, log_z);
  const Desc p = scores(CUDNN_DATA_BFLOAT16);  // the second matmul's A in the I/O type, as cuDNN requires
  g.pointwise(CUDNN_POINTWISE_DIV, p, e, z);
  g.matmul(o, p, v);
}

// dK or dV: (B,NH,T,HS) per query head, summed over each group of NH/NKV heads into `grad`.
void per_group(GraphBuilder& g, const Shape& s, Desc grad, Desc a, Desc b) {
  if (s.NH == s.NKV) {
    g.matmul(grad, a, b);
    return;
  }
  const Desc full =
      g.intermediate(CUDNN_DATA_BFLOAT16, {s.B, s.NH, s.T, s.HS}, {s.NH * s.T * s.HS, s.T * s.HS, s.HS, 1});
  g.matmul(full, a, b);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, grad, full);
}

void build_backward(GraphBuilder& g, const Shape& s) {
  const Desc q = g.tensor(kQ, CUDNN_DATA_BFLOAT16, {s.B, s.NH, s.T, s.HS}, s.heads_strides());
  const Desc kt = g.tensor(kK, CUDNN_DATA_BFLOAT16, {s.B, s.NKV, s.HS, s.T}, s.transposed_strides());
  const Desc vt = g.tensor(kV, CUDNN_DATA_BFLOAT16, {s.B, s.NKV, s.HS, s.T}, s.transposed_strides());
  const Desc o = g.tensor(kO, CUDNN_DATA_BFLOAT16, {s.B, s.NH, s.T, s.HS}, s.out_strides());
  const Desc d_o = g.tensor(kDO, CUDNN_DATA_BFLOAT16, {s.B, s.NH, s.T, s.HS}, s.out_strides());
  const Desc stats = g.tensor(kStats, CUDNN_DATA_FLOAT, s.rows(), s.rows_strides());
  const Desc dq = g.tensor(kDQ, CUDNN_DATA_BFLOAT16, {s.B, s.NH, s.T, s.HS}, s.heads_strides());
  const Desc dk = g.tensor(kDK, CUDNN_DATA_BFLOAT16, {s.B, s.NKV, s.T, s.HS}, s.heads_strides());
  const Desc dv = g.tensor(kDV, CUDNN_DATA_BFLOAT16, {s.B, s.NKV, s.T, s.HS}, s.heads_strides());
  const Desc dot_sum = g.tensor(kDotSum, CUDNN_DATA_FLOAT, s.rows(), s.rows_strides());
  const Desc dq_accum =
      g.tensor(kDQAccum, CUDNN_DATA_FLOAT, {s.B, s.NH, s.T, s.HS}, {s.NH * s.T * s.HS, s.T * s.HS, s.HS, 1});
  const Desc scale = g.scalar(kScale), lowest = g.scalar(kLowest), one = g.scalar(kOne);
  const auto scores = [&](cudnnDataType_t type = CUDNN_DATA_FLOAT) {
    return g.intermediate(type, s.scores(), s.scores_strides());
  };

  // Dsum = rowsum(dO * O), times 1 (where dropout would scale it).
  const Desc do_o = g.intermediate(CUDNN_DATA_FLOAT, {s.B, s.NH, s.T, s.HS}, s.out_strides());
  const Desc do_o_sum = g.intermediate(CUDNN_DATA_FLOAT, s.rows(), s.rows_strides());
  g.pointwise(CUDNN_POINTWISE_MUL, do_o, d_o, o);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, do_o_sum, do_o);
  g.pointwise(CUDNN_POINTWISE_MUL, dot_sum, do_o_sum, one);

  // P = exp(causal(Q K^T scale - Stats)); dV = P^T dO.
  const Desc s_raw = scores(), s_scaled = scores(), centered = scores(), p = scores();
  g.matmul(s_raw, q, kt);
  g.pointwise(CUDNN_POINTWISE_MUL, s_scaled, s_raw, scale);
  g.pointwise(CUDNN_POINTWISE_SUB, centered, s_scaled, stats);
  const Desc masked = g.causal_mask(centered, lowest, s.scores(), s.scores_strides());
  g.pointwise(CUDNN_POINTWISE_EXP, p, masked);
  const Desc pt = g.intermediate(CUDNN_DATA_BFLOAT16, s.scores(), s.transposed_scores_strides());
  g.reshape(pt, p);
  per_group(g, s, dv, pt, d_o);

  // dS = (dO V^T - Dsum) * P * scale; dK = dS^T Q.
  const Desc dp = scores(), dp_centered = scores(), ds_unscaled = scores(), ds = scores();
  g.matmul(dp, d_o, vt);
  g.pointwise(CUDNN_POINTWISE_SUB, dp_centered, dp, dot_sum);
  g.pointwise(CUDNN_POINTWISE_MUL, ds_unscaled, dp_centered, p);
  g.pointwise(CUDNN_POINTWISE_MUL, ds, ds_unscaled, scale);
  const Desc dst = g.intermediate(CUDNN_DATA_BFLOAT16, s.scores(), s.transposed_scores_strides());
  g.reshape(dst, ds);
  per_group(g, s, dk, dst, q);

  // dQ = dS K, accumulated in fp32, then rounded to bf16.
  const Desc k = g.intermediate(CUDNN_DATA_FLOAT, {s.B, s.NKV, s.T, s.HS}, s.heads_strides());
  g.reshape(k, kt);
  g.matmul(dq_accum, ds, k);
  g.pointwise(CUDNN_POINTWISE_IDENTITY, dq, dq_accum);
}

// A finalized execution plan and everything it was built from, or why there is none.
struct Plan {
  std::vector<Descriptor> descriptors;  // graph, tensors, operations, engine config, plan
  Desc plan = nullptr;
  std::int64_t workspace_bytes = 0;
  std::string unsupported;  // empty when `plan` is usable
  // The by-value scalars; the variant pack points at them, so they live here.
  alignas(16) float scale = 0.0f;
  alignas(16) float lowest = std::numeric_limits<float>::lowest();
  alignas(16) float one = 1.0f;
};

std::string status_text(cudnnStatus_t status) {
  char detail[512] = {};
  cudnnGetLastErrorString(detail, sizeof detail);
  return std::string(cudnnGetErrorString(status)) +
         (detail[0] != '\0' ? std::string(" (") + detail + ")" : "");
}

// Finalizes the graph and takes the first engine config, in the heuristics' order (mode A, then
// the fallback list), whose execution plan finalizes; else records why not.
void make_plan(GraphBuilder& g, cudnnHandle_t handle, Plan& plan) {
  const Desc graph = g.make(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
  const auto& ops = g.operations();
  LLMTRAIN_CUDNN_SET(graph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
  LLMTRAIN_CUDNN_SET(graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                     std::int64_t(ops.size()), ops.data());
  if (const cudnnStatus_t status = cudnnBackendFinalize(graph); status != CUDNN_STATUS_SUCCESS) {
    plan.unsupported = "the operation graph did not finalize: " + status_text(status);
    return;
  }
  std::string tried;
  for (const cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
    const Desc heuristics = g.make(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
    LLMTRAIN_CUDNN_SET(heuristics, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
                       &graph);
    LLMTRAIN_CUDNN_SET(heuristics, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode);
    if (const cudnnStatus_t status = cudnnBackendFinalize(heuristics); status != CUDNN_STATUS_SUCCESS) {
      tried += " heuristics mode " + std::to_string(int(mode)) + ": " + status_text(status) + ";";
      continue;
    }
    std::int64_t count = 0;
    LLMTRAIN_CUDNN_CHECK(cudnnBackendGetAttribute(heuristics, CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                                  CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr));
    std::vector<Desc> configs;
    for (std::int64_t i = 0; i < count; ++i) configs.push_back(g.make(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR));
    if (count > 0) {
      LLMTRAIN_CUDNN_CHECK(cudnnBackendGetAttribute(heuristics, CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                                    CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &count,
                                                    configs.data()));
    }
    tried +=
        " heuristics mode " + std::to_string(int(mode)) + ": " + std::to_string(count) + " engine configs";
    for (std::int64_t i = 0; i < count; ++i) {
      const Desc candidate = g.make(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
      LLMTRAIN_CUDNN_SET(candidate, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
      LLMTRAIN_CUDNN_SET(candidate, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
                         &configs[std::size_t(i)]);
      // Finalizing compiles the engine's kernels where it is a runtime-compiled one.
      if (const cudnnStatus_t status = cudnnBackendFinalize(candidate); status != CUDNN_STATUS_SUCCESS) {
        if (i == 0) tried += " (the first: " + status_text(status) + ")";
        continue;
      }
      std::int64_t n = 0;
      LLMTRAIN_CUDNN_CHECK(cudnnBackendGetAttribute(candidate, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                                                    CUDNN_TYPE_INT64, 1, &n, &plan.workspace_bytes));
      plan.plan = candidate;
      return;
    }
    tried += ", none finalized;";
  }
  plan.unsupported = "no cuDNN engine runs this graph:" + tried;
}

enum class Pass { forward, backward };

struct State {
  std::mutex mutex;
  bool checked = false;
  bool refusal_logged = false;  // the first refusal goes to stderr
  std::string unavailable;         // why cuDNN attention cannot run here; empty when it can
  cudnnHandle_t handle = nullptr;  // one per process, made on the device current at the first call
  int device = -1;                 // the handle's
  std::map<std::array<int, 6>, std::unique_ptr<Plan>> plans;  // (pass, B, T, C, NH, NKV)
};

// The process's cuDNN state: created on first use, never destroyed (the driver reclaims the handle
// at exit, as the compute stream's).
State& state() {
  static State* const s = new State();
  return *s;
}

// Why cuDNN attention cannot run in this process (checked once, creating the handle), or "".
const std::string& environment_problem(State& st) {
  if (st.checked) return st.unavailable;
  st.checked = true;
  const std::size_t version = cudnnGetVersion();
  int count = 0, major = 0, minor = 0;
  if (version < kMinCudnnVersion) {
    st.unavailable =
        "cuDNN " + version_string(version) + " is older than " + version_string(kMinCudnnVersion);
    return st.unavailable;
  }
  if (const cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess || count == 0) {
    st.unavailable =
        std::string("no CUDA device: ") + (e != cudaSuccess ? cudaGetErrorString(e) : "none found");
    cudaGetLastError();  // not a sticky error; clear it
    return st.unavailable;
  }
  try {
    LLMTRAIN_CUDA_CHECK(cudaGetDevice(&st.device));
    LLMTRAIN_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, st.device));
    LLMTRAIN_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, st.device));
    if (major < 8) {
      st.unavailable = "cuDNN's fused attention needs compute capability 8.0 or newer, device " +
                       std::to_string(st.device) + " has " + std::to_string(major) + "." +
                       std::to_string(minor);
      return st.unavailable;
    }
    LLMTRAIN_CUDNN_CHECK(cudnnCreate(&st.handle));
  } catch (const kernels::Error& e) {
    st.unavailable = e.what();
  }
  return st.unavailable;
}

std::string shape_problem(int B, int T, int C, int NH, int NKV) {
  if (B <= 0 || T <= 0 || C <= 0 || NH <= 0 || NKV <= 0 || C % NH != 0 || NH % NKV != 0) {
    return "cudnn attention: bad shape B=" + std::to_string(B) + " T=" + std::to_string(T) +
           " C=" + std::to_string(C) + " NH=" + std::to_string(NH) + " NKV=" + std::to_string(NKV) +
           " (need positive sizes, NH dividing C, NKV dividing NH)";
  }
  if ((C / NH) % 8 != 0) {
    return "cudnn attention: head size " + std::to_string(C / NH) + " is not a multiple of 8";
  }
  return "";
}

// The plan of one pass and shape, built on first use; the caller holds st.mutex.
Plan& get_plan(State& st, Pass pass, int B, int T, int C, int NH, int NKV) {
  if (const std::string& why = environment_problem(st); !why.empty())
    throw kernels::Error("cudnn attention: " + why);
  if (const std::string why = shape_problem(B, T, C, NH, NKV); !why.empty()) throw kernels::Error(why);
  int device = 0;
  LLMTRAIN_CUDA_CHECK(cudaGetDevice(&device));
  if (device != st.device) {
    throw kernels::Error("cudnn attention: the process's cuDNN handle is on device " +
                       std::to_string(st.device) + ", the current device is " + std::to_string(device));
  }
  const std::array<int, 6> key{int(pass), B, T, C, NH, NKV};
  auto& slot = st.plans[key];
  if (!slot) {
    auto plan = std::make_unique<Plan>();
    const Shape shape(B, T, C, NH, NKV);
    plan->scale = float(1.0 / std::sqrt(double(shape.HS)));
    try {
      GraphBuilder g(kFirstVirtual, cudnnGetVersion());
      if (pass == Pass::forward) {
        build_forward(g, shape);
      } else {
        build_backward(g, shape);
      }
      make_plan(g, st.handle, *plan);
      plan->descriptors = g.take_descriptors();
    } catch (const kernels::Error& e) {  // a descriptor cuDNN refused: report it as this shape's problem
      plan->plan = nullptr;
      plan->descriptors.clear();
      plan->unsupported = std::string("building the graph failed: ") + e.what();
    }
    if (!plan->unsupported.empty()) {
      plan->unsupported = std::string("cudnn attention ") + (pass == Pass::forward ? "forward" : "backward") +
                          " (B=" + std::to_string(B) + " T=" + std::to_string(T) +
                          " NH=" + std::to_string(NH) + " NKV=" + std::to_string(NKV) +
                          " HS=" + std::to_string(C / NH) + "): " + plan->unsupported;
      if (!st.refusal_logged) {  // the first refusal, whoever asked and whatever they do with it
        st.refusal_logged = true;
        std::fprintf(stderr, "cuDNN %s refused a graph: %s\n", version_string(cudnnGetVersion()).c_str(),
                     plan->unsupported.c_str());
      }
    }
    slot = std::move(plan);
  }
  return *slot;
}

Plan& usable_plan(State& st, Pass pass, int B, int T, int C, int NH, int NKV) {
  Plan& plan = get_plan(st, pass, B, T, C, NH, NKV);
  if (plan.plan == nullptr) throw kernels::Error(plan.unsupported);
  return plan;
}

void check_aligned(std::initializer_list<const void*> pointers, const char* what) {
  if (!aligned16(pointers))
    throw kernels::Error(std::string("cudnn attention ") + what + ": every pointer must be 16-byte aligned");
}

// Runs `plan` on `stream` with these tensors and workspace.
void execute(State& st, const Plan& plan, cudaStream_t stream, const std::vector<std::int64_t>& uids,
             const std::vector<void*>& pointers, void* workspace) {
  Descriptor pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
  LLMTRAIN_CUDNN_SET(pack.get(), CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64,
                     std::int64_t(uids.size()), uids.data());
  LLMTRAIN_CUDNN_SET(pack.get(), CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR,
                     std::int64_t(pointers.size()), pointers.data());
  LLMTRAIN_CUDNN_SET(pack.get(), CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace);
  LLMTRAIN_CUDNN_CHECK(cudnnBackendFinalize(pack.get()));
  LLMTRAIN_CUDNN_CHECK(cudnnSetStream(st.handle, stream));
  LLMTRAIN_CUDNN_CHECK(cudnnBackendExecute(st.handle, plan.plan, pack.get()));
}

void* mut(const void* p) {
  return const_cast<void*>(p);  // cuDNN takes every data pointer as void*; it writes only the outputs
}

// dqkv += grad, 8 bf16 (one 16-byte access) per step; n8 = elements / 8.
__global__ void add_bf16_kernel(__nv_bfloat16* __restrict__ dqkv, const __nv_bfloat16* __restrict__ grad,
                                std::int64_t n8) {
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n8;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    Chunk<__nv_bfloat16, 8> acc = load_chunk<8>(dqkv + 8 * i);
    const Chunk<__nv_bfloat16, 8> add = load_chunk<8>(grad + 8 * i);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      acc.e[k] = __float2bfloat16_rn(__bfloat162float(acc.e[k]) + __bfloat162float(add.e[k]));
    }
    store_chunk<8>(dqkv + 8 * i, acc);
  }
}

}  // namespace

bool cudnn_attention_available(std::string* why_not) {
  State& st = state();
  const std::lock_guard<std::mutex> lock(st.mutex);
  const std::string& why = environment_problem(st);
  if (why_not != nullptr) *why_not = why;
  return why.empty();
}

bool cudnn_attention_supported(int B, int T, int C, int NH, int NKV, std::string* why_not) {
  State& st = state();
  const std::lock_guard<std::mutex> lock(st.mutex);
  std::string why = environment_problem(st);
  if (why.empty()) why = shape_problem(B, T, C, NH, NKV);
  for (const Pass pass : {Pass::forward, Pass::backward}) {
    if (why.empty()) why = get_plan(st, pass, B, T, C, NH, NKV).unsupported;
  }
  if (why_not != nullptr) *why_not = why;
  return why.empty();
}

void cudnn_attention_forward(__nv_bfloat16* out, float* lse, const __nv_bfloat16* qkv, int B, int T, int C,
                             int NH, int NKV, cudaStream_t stream) {
  State& st = state();
  const std::lock_guard<std::mutex> lock(st.mutex);
  Plan& plan = usable_plan(st, Pass::forward, B, T, C, NH, NKV);
  const Shape s(B, T, C, NH, NKV);
  const __nv_bfloat16* k = qkv + s.C;
  const __nv_bfloat16* v = k + s.NKV * s.HS;
  check_aligned({out, lse, qkv, k, v}, "forward");
  const StreamScratch workspace(std::size_t(plan.workspace_bytes), stream);
  execute(st, plan, stream, {kQ, kK, kV, kO, kStats, kScale, kLowest},
          {mut(qkv), mut(k), mut(v), out, lse, &plan.scale, &plan.lowest}, workspace.at<void>());
}

void cudnn_attention_backward(__nv_bfloat16* dqkv, const __nv_bfloat16* dout, const __nv_bfloat16* qkv,
                              const __nv_bfloat16* out, const float* lse, int B, int T, int C, int NH,
                              int NKV, bool accumulate, cudaStream_t stream) {
  State& st = state();
  const std::lock_guard<std::mutex> lock(st.mutex);
  Plan& plan = usable_plan(st, Pass::backward, B, T, C, NH, NKV);
  const Shape s(B, T, C, NH, NKV);
  const __nv_bfloat16* k = qkv + s.C;
  const __nv_bfloat16* v = k + s.NKV * s.HS;
  check_aligned({dqkv, dout, qkv, k, v, out, lse}, "backward");

  // One scratch: cuDNN's workspace, Dsum (B,NH,T), the dQ accumulator (B,NH,T,HS) and, when it
  // accumulates, dqkv's increment (the same layout as dqkv, so the plan serves both).
  const std::size_t rows = std::size_t(s.B * s.NH * s.T), n = std::size_t(s.B * s.T * s.W);
  const std::size_t ws_bytes = round_up_256(std::size_t(plan.workspace_bytes));
  const std::size_t sum_bytes = round_up_256(rows * sizeof(float));
  const std::size_t accum_bytes = round_up_256(rows * std::size_t(s.HS) * sizeof(float));
  const std::size_t grad_bytes = accumulate ? n * sizeof(__nv_bfloat16) : 0;
  const StreamScratch scratch(ws_bytes + sum_bytes + accum_bytes + grad_bytes, stream);
  float* dot_sum = scratch.at<float>(ws_bytes);
  float* dq_accum = scratch.at<float>(ws_bytes + sum_bytes);
  auto* grad = accumulate ? scratch.at<__nv_bfloat16>(ws_bytes + sum_bytes + accum_bytes) : dqkv;
  // cudnn_frontend zeroed the accumulator itself before cuDNN 9.6 and leaves it to cuDNN since; zeroing
  // it here too costs one memset of B NH T HS floats and does not depend on reading that right.
  LLMTRAIN_CUDA_CHECK(cudaMemsetAsync(dq_accum, 0, rows * std::size_t(s.HS) * sizeof(float), stream));
  __nv_bfloat16* dq = grad;
  __nv_bfloat16* dk = grad + s.C;
  __nv_bfloat16* dv = dk + s.NKV * s.HS;
  execute(st, plan, stream,
          {kQ, kK, kV, kO, kStats, kScale, kLowest, kDO, kDQ, kDK, kDV, kDotSum, kDQAccum, kOne},
          {mut(qkv), mut(k), mut(v), mut(out), mut(lse), &plan.scale, &plan.lowest, mut(dout), dq, dk, dv,
           dot_sum, dq_accum, &plan.one},
          ws_bytes > 0 ? scratch.at<void>() : nullptr);

  if (!accumulate) return;  // cuDNN wrote dqkv itself
  const std::int64_t n8 = std::int64_t(n / 8);  // W is a multiple of 8 (HS is)
  add_bf16_kernel<<<grid_for(n8, 256), 256, 0, stream>>>(dqkv, grad, n8);
  LLMTRAIN_CUDA_CHECK(cudaGetLastError());
}

}  // namespace llmtrain::cuda

#else  // a build without cuDNN

namespace llmtrain::cuda {
namespace {
const char* const kNoCudnn = "this build has no cuDNN (LLMTRAIN_CUDNN off, or cudnn.h/libcudnn not found)";
}  // namespace

bool cudnn_attention_available(std::string* why_not) {
  if (why_not != nullptr) *why_not = kNoCudnn;
  return false;
}

bool cudnn_attention_supported(int, int, int, int, int, std::string* why_not) {
  return cudnn_attention_available(why_not);
}

void cudnn_attention_forward(__nv_bfloat16*, float*, const __nv_bfloat16*, int, int, int, int, int,
                             cudaStream_t) {
  throw kernels::Error(std::string("cudnn attention: ") + kNoCudnn);
}

void cudnn_attention_backward(__nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*,
                              const __nv_bfloat16*, const float*, int, int, int, int, int, bool, cudaStream_t) {
  throw kernels::Error(std::string("cudnn attention: ") + kNoCudnn);
}

}  // namespace llmtrain::cuda

#endif
