// CUDA twins of the CPU reference ops (kernels/include/llmtrain/kernels/cpu.h): the same names,
// the same arguments in the same order, plus what the caller hands down to run them: the stream,
// and for the matmuls the cuBLASLt handle and workspace before it (a Blas). The same semantics.
// All pointers are device memory. Every backward op ACCUMULATES (+=) into its outputs, as on the
// CPU.
//
// Precision: each op is declared once, a template on `Act`, the element type of its activations:
// float (fp32, matching the CPU reference to fp32 accuracy) or bf16 (mixed precision); the
// library defines each for those two only. Activations, their gradients and the working copy of
// the weights are Act; weight gradients (dweight, dbias, dwte, dwpe) and statistics (mean, rstd,
// lse, losses) are always float. Inside, every kernel loads bf16 as float, computes and
// accumulates in fp32, and rounds to nearest even once on each store (a bf16 output that is
// accumulated into is read, added to in fp32, and rounded).
//
// B batch, T time, C channels, V vocabulary, NH heads, HS = C / NH head size, OC output
// channels, N = B * T rows. Pointers need only their element alignment: each launcher takes a
// 128-bit path when the pointers (and row lengths) allow it, a scalar one otherwise (bf16: the
// 128-bit paths move 8 elements and need 16-byte aligned pointers, row lengths multiples of 8).
//
// Full causal attention (forward and backward) is not here: it has its own kernels
// (flash_attention.h, cudnn_attention.h); attention_decode, for generation, is.
#pragma once

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "llmtrain/kernels/context_attention.h"
#include "llmtrain/kernels/elementwise.h"

namespace llmtrain::cuda {

/// The 16-bit storage type of mixed precision: bfloat16 (8 exponent bits, 7 mantissa bits).
using bf16 = __nv_bfloat16;

// kernels/cuda/cublaslt_context.cu
/// What a matmul runs with, made and owned by the caller: a cuBLASLt handle and a workspace of
/// device memory. The workspace is shared by every matmul given this Blas, so those matmuls must
/// be ordered (one stream, or events). allow_tf32 lets fp32 matmuls use TF32 tensor cores (about
/// 8x faster, 10-bit mantissa inputs); off, they match the CPU reference to fp32 accuracy.
struct Blas {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  bool allow_tf32 = false;
};
/// 32 MiB: what NVIDIA recommends for cuBLASLt on Hopper (4 MiB would do before it); the large
/// split-K and stream-K algorithms need it.
inline constexpr std::size_t matmul_workspace_bytes = std::size_t(32) << 20;
/// A new handle and a workspace of `workspace_bytes` on the current device.
Blas create_blas(std::size_t workspace_bytes = matmul_workspace_bytes);
/// Frees what create_blas made (after the matmuls queued with it have run).
void destroy_blas(const Blas& blas);

// kernels/cuda/convert.cu
/// out (N) = in (N) as To: float -> bf16 rounds to nearest even (NaN stays NaN; beyond the bf16
/// range, +-inf), bf16 -> float widens exactly. Defined for those two directions.
template <class To, class From>
void convert(To* out, const From* in, std::int64_t N, cudaStream_t stream);

// kernels/cuda/encoder.cu
/// out (B,T,C) = wte[inp] + wpe[t]; inp (B,T); wte (V,C); wpe (maxT,C) or null (no position
/// table); the sum in fp32.
template <class Act>
void encoder_forward(Act* out, const std::int32_t* inp, const Act* wte, const Act* wpe, int B, int T, int C,
                     cudaStream_t stream);
/// dwte (V,C) and dwpe (maxT,C, or null), fp32, += from dout (B,T,C); inp (B,T). Deterministic
/// (no atomics).
template <class Act>
void encoder_backward(float* dwte, float* dwpe, const Act* dout, const std::int32_t* inp, int B, int T, int C,
                      cudaStream_t stream);

// kernels/cuda/layernorm.cu
/// out (N,C) = (inp (N,C) - mean) * rstd * weight (C) + bias (C); mean, rstd (N) saved.
template <class Act>
void layernorm_forward(Act* out, float* mean, float* rstd, const Act* inp, const Act* weight, const Act* bias,
                       std::int64_t N, int C, cudaStream_t stream);
/// dinp (N,C), dweight (C), dbias (C) += from dout (N,C), inp (N,C), weight (C), mean, rstd (N).
template <class Act>
void layernorm_backward(Act* dinp, float* dweight, float* dbias, const Act* dout, const Act* inp, const Act* weight,
                        const float* mean, const float* rstd, std::int64_t N, int C, cudaStream_t stream);
/// residual (N,C) = a + b (N,C) (in bf16: rounded), then out, mean, rstd as layernorm_forward of
/// that residual, in one kernel.
template <class Act>
void layernorm_residual_forward(Act* residual, Act* out, float* mean, float* rstd, const Act* a, const Act* b,
                                const Act* weight, const Act* bias, std::int64_t N, int C, cudaStream_t stream);

// kernels/cuda/matmul.cu (cuBLASLt; fp32 accumulation, CUBLAS_COMPUTE_32F, also for bf16 inputs)
/// out (N,OC) = inp (N,C) weight^T + bias, rounded once; weight (OC,C); bias (OC) or null. Rows
/// of out are `ld` >= OC elements apart (the padded logits); the columns past OC are not written.
template <class Act>
void matmul_forward(Act* out, const Act* inp, const Act* weight, const Act* bias, std::int64_t N, int C, int OC,
                    std::int64_t ld, const Blas& blas, cudaStream_t stream);
/// dinp (N,C) += (one rounding of the sum), dweight (OC,C) and dbias (OC, may be null) fp32 +=,
/// from dout (N,OC; rows ld >= OC apart), inp (N,C), weight (OC,C); dinp is written instead
/// (beta = 0: not read) when !accumulate.
template <class Act>
void matmul_backward(Act* dinp, float* dweight, float* dbias, const Act* dout, const Act* inp, const Act* weight,
                     std::int64_t N, int C, int OC, std::int64_t ld, bool accumulate, const Blas& blas,
                     cudaStream_t stream);
/// pre (N,OC) = inp (N,C) weight^T + bias, out (N,OC) = GELU(pre), each rounded once: cuBLASLt's
/// GELU_AUX_BIAS epilogue (pre is its aux output) where OC % 8 == 0, else the plain matmul and
/// the GELU kernel.
template <class Act>
void matmul_gelu_forward(Act* out, Act* pre, const Act* inp, const Act* weight, const Act* bias, std::int64_t N,
                         int C, int OC, const Blas& blas, cudaStream_t stream);
/// dpre (N,C) = GELU'(pre) (dout weight) WRITTEN (the DGELU epilogue), dweight (OC,C), dbias
/// (OC), dpre_bias (C) fp32 +=; biases may be null. fp32: dpre_bias is DGELU_BGRAD's bias
/// gradient; bf16: a column sum of the bf16 dpre (DGELU_BGRAD would give it in bf16, D's type).
template <class Act>
void matmul_backward_dgelu(Act* dpre, float* dweight, float* dbias, float* dpre_bias, const Act* dout, const Act* inp,
                           const Act* pre, const Act* weight, std::int64_t N, int C, int OC, const Blas& blas,
                           cudaStream_t stream);
/// out (B,M,N) = inp (B,M,K) weight^T for each of B matrices, weight (B,N,K); or, when
/// !transpose_weight, inp weight with weight (B,K,N); each rounded once. One strided-batched
/// cuBLASLt matmul (Newton-Schulz's products over matrices of one shape).
template <class Act>
void batched_matmul(Act* out, const Act* inp, const Act* weight, std::int64_t B, int M, int N, int K,
                    bool transpose_weight, const Blas& blas, cudaStream_t stream);

// kernels/cuda/context_attention.cu: context parallelism's attention pieces (the CPU twins in
// cpu.h say what each computes); outputs other than kv_pack's and qkv_join's are fp32.
// seg (B,T) (may be null): the document mask, as the CPU's.
template <class Act>
void attention_block_forward(float* out, float* lse, const Act* qkv, const Act* kv, int B, int Tq, int Tk, int C,
                             int NH, int NKV, int kv_width, kernels::Chunks q_at, kernels::Chunks k_at,
                             const std::int32_t* seg, int T, cudaStream_t stream);
template <class Act>
void attention_block_backward(float* dq, float* dkv, const Act* dout, const Act* qkv, const Act* out,
                              const float* lse, const Act* kv, int B, int Tq, int Tk, int C, int NH, int NKV,
                              int kv_width, kernels::Chunks q_at, kernels::Chunks k_at, const std::int32_t* seg,
                              int T, cudaStream_t stream);
/// fp32 only (block results are fp32 at every precision).
void attention_lse_merge(float* out, float* lse, const float* block_out, const float* block_lse, int B, int T, int C,
                         int NH, cudaStream_t stream);
template <class Act>
void kv_pack(Act* kv, const Act* qkv, std::int64_t N, int C, int KVC, cudaStream_t stream);
template <class Act>
void qkv_join(Act* dqkv, const float* dq, const float* dkv, std::int64_t N, int C, int KVC, cudaStream_t stream);

// kernels/cuda/attention_decode.cu
/// One new position `pos` of one sequence: out (C) from q (C) and the caches k_cache, v_cache
/// (maxT, NKV HS) of positions 0..pos; NH query heads, query head h reads cached head h / (NH / NKV).
template <class Act>
void attention_decode(Act* out, const Act* q, const Act* k_cache, const Act* v_cache, int pos, int C, int NH, int NKV,
                      cudaStream_t stream);

// The elementwise ops of kernels/include/llmtrain/kernels/elementwise.def, (outputs..., inputs...,
// N, stream); each line there names the file of its kernels.
#define LLMTRAIN_ELEMENTWISE(name, outputs, inputs)                                                   \
  template <class Act>                                                                               \
  void name(LLMTRAIN_EW_LIST(LLMTRAIN_EW_ACT_OUT, outputs), LLMTRAIN_EW_LIST(LLMTRAIN_EW_ACT_IN, inputs), \
            std::int64_t N, cudaStream_t stream);
#include "llmtrain/kernels/elementwise.def"
#undef LLMTRAIN_ELEMENTWISE

// kernels/cuda/rmsnorm.cu
/// out (N,C) = inp (N,C) / sqrt(mean(inp^2) + eps) * weight (C); rstd (N) saved.
template <class Act>
void rmsnorm_forward(Act* out, float* rstd, const Act* inp, const Act* weight, std::int64_t N, int C, float eps,
                     cudaStream_t stream);
/// dinp (N,C), dweight (C) += from dout (N,C), inp (N,C), weight (C), rstd (N).
template <class Act>
void rmsnorm_backward(Act* dinp, float* dweight, const Act* dout, const Act* inp, const Act* weight,
                      const float* rstd, std::int64_t N, int C, cudaStream_t stream);

/// Per-head RMSNorm of a packed qkv (N, (NH + 2 NKV) HS): query heads by q_weight (HS), key heads
/// by k_weight (HS), value heads copied; rstd (N, NH + NKV) saved.
template <class Act>
void qk_norm_forward(Act* out, float* rstd, const Act* inp, const Act* q_weight, const Act* k_weight, std::int64_t N,
                     int NH, int NKV, int HS, float eps, cudaStream_t stream);
/// Its backward: dinp written (value heads: dout's); dq_weight, dk_weight (HS) +=.
template <class Act>
void qk_norm_backward(Act* dinp, float* dq_weight, float* dk_weight, const Act* dout, const Act* inp,
                      const Act* q_weight, const Act* k_weight, const float* rstd, std::int64_t N, int NH, int NKV,
                      int HS, cudaStream_t stream);

// kernels/cuda/rope.cu
/// out (B,T,H,HS) = inp (B,T,H,HS) with heads h < n_rot turned by the angles
/// (pos0 + t) theta^(-2i/HS) (rotate_half layout, angles in double), the other heads copied; HS even.
template <class Act>
void rope_forward(Act* out, const Act* inp, int B, int T, int H, int HS, int n_rot, int pos0, float theta,
                  cudaStream_t stream);
/// dinp (B,T,H,HS) += the inverse rotation of dout (B,T,H,HS) (heads below n_rot; the others pass through).
template <class Act>
void rope_backward(Act* dinp, const Act* dout, int B, int T, int H, int HS, int n_rot, int pos0, float theta,
                   cudaStream_t stream);

// kernels/cuda/classifier.cu
/// losses (N) = -log softmax(logits (N,V))[targets (N)], softmax in fp32; with dlogits_scale > 0
/// the logits are overwritten by (softmax - onehot) * dlogits_scale (rounded, in bf16). Returns
/// the loss sum (synchronises the stream); with loss_sum (a double in device memory) the sum is
/// added there instead, on the stream, and 0 is returned. A target outside [0, V) gives a NaN loss
/// (the CPU reference reads out of bounds). Every classifier kernel takes rows `ld` >= V elements
/// apart (the padded vocabulary: ld a multiple of 8 makes every row 16-byte aligned, so the 128-bit
/// path applies to any V); the padding [V, ld) is never read, and with a gradient it becomes 0.
template <class Act>
double fused_classifier(Act* logits, float* losses, const std::int32_t* targets, std::int64_t N, int V,
                        std::int64_t ld, float dlogits_scale, double* loss_sum, cudaStream_t stream);
/// The vocabulary-parallel cross-entropy (logits (N,V): columns [vocab_begin, vocab_begin + V) of
/// the vocabulary), as the CPU reference's three steps, in fp32; the caller all-reduces between them.
/// 1. row_max (N) = each row's local max (NaNs skipped).
template <class Act>
void classifier_row_max(float* row_max, const Act* logits, std::int64_t N, int V, std::int64_t ld,
                        cudaStream_t stream);
/// 2. sum_exp (N) = the local sum of exp(logit - row_max); target_logit (N) = the target's logit
///    where this rank holds it, else 0 (NaN for a negative target).
template <class Act>
void classifier_row_stats(float* sum_exp, float* target_logit, const Act* logits, const float* row_max,
                          const std::int32_t* targets, std::int64_t N, int V, std::int64_t ld, std::int64_t vocab_begin,
                          cudaStream_t stream);
/// 3. losses (N) = log(sum_exp) + row_max - target_logit; with dlogits_scale > 0 the logits become
///    (softmax - onehot) * dlogits_scale. Returns the loss sum (synchronises the stream), or adds
///    it into loss_sum (device memory) as fused_classifier.
template <class Act>
double classifier_parallel_finish(Act* logits, float* losses, const float* row_max, const float* sum_exp,
                                  const float* target_logit, const std::int32_t* targets, std::int64_t N, int V,
                                  std::int64_t ld, std::int64_t vocab_begin, float dlogits_scale, double* loss_sum,
                                  cudaStream_t stream);

// kernels/cuda/optimizer.cu (fp32 only: the master weights, their gradients and the moments)
/// Sum of squares of x (N), accumulated in double, deterministic (synchronises the stream); with
/// `into` (device memory) added there on the stream instead, returning 0.
double sum_squares(const float* x, std::int64_t N, double* into, cudaStream_t stream);
/// AdamW on param, grad, m, v (N), as cpu::adamw_update.
void adamw_update(float* param, const float* grad, float* m, float* v, std::int64_t N, float lr, float beta1,
                  float beta2, float eps, float weight_decay, int step, float grad_scale, cudaStream_t stream);
/// One block's work in adamw_update_chunks: elements [begin, begin + length) of param, grad and
/// working, whose moments are [state, state + length) of m and v (length <= adamw_chunk_elements),
/// decayed or not.
struct AdamWChunk {
  std::int64_t begin;
  std::int64_t state;
  std::int32_t length;
  std::int32_t decay;  // 1: weight decay applies
};
/// Elements per AdamWChunk (the host cuts every run into chunks of at most this many).
inline constexpr std::int32_t adamw_chunk_elements = 4096;
/// AdamW on every chunk of `chunks` (n_chunks, in device memory) in one launch, as
/// cpu::adamw_update per run, with weight_decay where a chunk's decay is set and 0 elsewhere; on
/// param, grad, m, v (f32; m and v at each chunk's `state`) and, unless null, working (bf16): the updated param rounded to nearest
/// even, as convert() would give.
void adamw_update_chunks(float* param, const float* grad, float* m, float* v, bf16* working,
                         const AdamWChunk* chunks, std::int64_t n_chunks, float lr, float beta1, float beta2,
                         float eps, float weight_decay, int step, float grad_scale, cudaStream_t stream);
/// Muon's momentum on buf, grad, u (N, f32) in one pass, as cpu::muon_momentum.
void muon_momentum(float* buf, const float* grad, float* u, std::int64_t N, float momentum, int nesterov,
                   float grad_scale, cudaStream_t stream);
/// Muon's weight update on param, o (N, f32), as cpu::muon_apply; unless null, working (bf16)
/// gets the updated param rounded to nearest even, as convert() would give.
void muon_apply(float* param, const float* o, bf16* working, std::int64_t N, float keep, float step,
                cudaStream_t stream);

// ---- Newton-Schulz (kernels/cuda/newton_schulz.cu; optim/newton_schulz.h) -----------------------
// As cpu.h's: a (rows, cols) matrix worked on as (m, n), m = min(rows, cols), n = max(rows, cols).
/// x (m,n) Act = u (rows,cols) f32, transposed when rows > cols, times 1 / max(sqrt(*squares),
/// eps); squares (device memory) is u's sum of squares.
template <class Act>
void newton_schulz_normalise(Act* x, const float* u, const double* squares, std::int64_t rows, std::int64_t cols,
                             double eps, cudaStream_t stream);
/// out (C,N) = inp (N,C)^T.
template <class Act>
void transpose(Act* out, const Act* inp, std::int64_t N, std::int64_t C, cudaStream_t stream);
/// out (N) = alpha x + beta y, in fp32, rounded once.
template <class Act>
void scaled_sum(Act* out, const Act* x, const Act* y, std::int64_t N, float alpha, float beta, cudaStream_t stream);

// ---- Mixture of Experts (kernels/cuda/moe.cu, grouped_matmul.cu; docs/moe.md) -------------------
// As cpu.h's: E experts, k per token, N tokens, N k slots; every result a gather (no atomics).
/// probs (N,E), experts (N,k), weights (N,k), counts (E), pbar (E), losses (3) from logits (N,E)
/// and bias (E, or null).
template <class Act>
void moe_router_forward(float* probs, std::int32_t* experts, float* weights, float* counts, float* pbar,
                        float* losses, const Act* logits, const Act* bias, std::int64_t N, int E, int k, bool sigmoid,
                        bool normalize, float route_scale, cudaStream_t stream);
/// dlogits (N,E) WRITTEN.
template <class Act>
void moe_router_backward(Act* dlogits, const float* dweights, const Act* logits, const float* probs,
                         const std::int32_t* experts, const float* counts, std::int64_t N, int E, int k,
                         bool sigmoid, bool normalize, float route_scale, float aux_scale, float z_scale,
                         cudaStream_t stream);
/// The dispatch plan: offsets (E+1), row_slot, slot_row (N k), dropped (1); capacity 0: dropless.
void moe_dispatch(std::int32_t* offsets, std::int32_t* row_slot, std::int32_t* slot_row, float* dropped,
                  const std::int32_t* experts, std::int64_t N, int E, int k, std::int64_t capacity,
                  cudaStream_t stream);
template <class Act>
void moe_permute_forward(Act* xp, const Act* x, const std::int32_t* row_slot, const std::int32_t* offsets,
                         std::int64_t N, int E, int k, int C, cudaStream_t stream);
template <class Act>
void moe_permute_backward(Act* dx, const Act* dxp, const std::int32_t* slot_row, std::int64_t N, int k, int C,
                          bool accumulate, cudaStream_t stream);
template <class Act>
void moe_unpermute_forward(Act* out, const Act* y, const float* weights, const std::int32_t* slot_row,
                           std::int64_t N, int k, int C, cudaStream_t stream);
/// dy (N k, C) rows below offsets[E] and dweights (N,k) WRITTEN.
template <class Act>
void moe_unpermute_backward(Act* dy, float* dweights, const Act* dout, const Act* y, const float* weights,
                            const std::int32_t* row_slot, const std::int32_t* slot_row, const std::int32_t* offsets,
                            std::int64_t N, int E, int k, int C, cudaStream_t stream);
void moe_bias_update(float* bias, const float* loads, float mean_load, std::int64_t n, float rate,
                     cudaStream_t stream);
/// out (R,OC): each expert's rows of inp (R,C) times weight (E,OC,C)[e]^T, one launch.
template <class Act>
void grouped_matmul_forward(Act* out, const Act* inp, const Act* weight, const std::int32_t* offsets, int E, int C,
                            int OC, cudaStream_t stream);
/// dweight (E,OC,C) +=; dinp (R,C) += (or, accumulate false, =).
template <class Act>
void grouped_matmul_backward(Act* dinp, float* dweight, const Act* dout, const Act* inp, const Act* weight,
                             const std::int32_t* offsets, int E, int C, int OC, bool accumulate,
                             cudaStream_t stream);

}  // namespace llmtrain::cuda
