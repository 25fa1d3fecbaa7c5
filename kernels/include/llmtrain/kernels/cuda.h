// CUDA twins of the CPU reference ops (kernels/include/llmtrain/kernels/cpu.h): the same names, the same arguments in
// the same order, plus the stream to run on; the same semantics, fp32. All pointers are device
// memory. Every backward op ACCUMULATES (+=) into its outputs, as on the CPU.
//
// Mixed precision: each op also has a bf16 overload (at the end). Activations, their gradients
// and the working copy of the weights are bf16; weight gradients (dweight, dbias, dwte, dwpe)
// and statistics (mean, rstd, lse, losses) stay fp32. Inside, every kernel loads bf16 as float,
// computes and accumulates in fp32, and rounds to nearest even once on each store (a bf16
// output that is accumulated into is read, added to in fp32, and rounded).
//
// B batch, T time, C channels, V vocabulary, NH heads, HS = C / NH head size, OC output
// channels, N = B * T rows. Pointers need only their element alignment: each launcher takes a
// 128-bit path when the pointers (and row lengths) allow it, a scalar one otherwise.
//
// Full causal attention (forward and backward) is not here: it has its own kernels (flash
// attention); attention_decode, for generation, is.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "llmtrain/kernels/context_attention.h"
#include "llmtrain/kernels/elementwise.h"

namespace llmtrain::cuda {

/// The 16-bit storage type of mixed precision: bfloat16 (8 exponent bits, 7 mantissa bits).
using bf16 = __nv_bfloat16;

// kernels/cuda/encoder.cu
/// out (B,T,C) = wte[inp] + wpe[t]; inp (B,T); wte (V,C); wpe (maxT,C) or null (no position table).
void encoder_forward(float* out, const std::int32_t* inp, const float* wte, const float* wpe, int B, int T,
                     int C, cudaStream_t stream);
/// dwte (V,C) and dwpe (maxT,C, or null) += from dout (B,T,C); inp (B,T). Deterministic (no atomics).
void encoder_backward(float* dwte, float* dwpe, const float* dout, const std::int32_t* inp, int B, int T,
                      int C, cudaStream_t stream);

// kernels/cuda/layernorm.cu
/// out (N,C) = (inp (N,C) - mean) * rstd * weight (C) + bias (C); mean, rstd (N) saved.
void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                       const float* bias, std::int64_t N, int C, cudaStream_t stream);
/// dinp (N,C), dweight (C), dbias (C) += from dout (N,C), inp (N,C), weight (C), mean, rstd (N).
void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, std::int64_t N, int C,
                        cudaStream_t stream);
/// residual (N,C) = a + b (N,C), then out, mean, rstd as layernorm_forward of residual, one kernel.
void layernorm_residual_forward(float* residual, float* out, float* mean, float* rstd, const float* a, const float* b,
                                const float* weight, const float* bias, std::int64_t N, int C, cudaStream_t stream);

// kernels/cuda/matmul.cu (cuBLASLt)
/// out (N,OC) = inp (N,C) weight^T + bias; weight (OC,C); bias (OC) or null. Rows of out are
/// `ld` >= OC elements apart (the padded logits); the columns past OC are not written.
void matmul_forward(float* out, const float* inp, const float* weight, const float* bias, std::int64_t N,
                    int C, int OC, std::int64_t ld, cudaStream_t stream);
/// dinp (N,C), dweight (OC,C), dbias (OC, may be null) += from dout (N,OC; rows ld >= OC apart),
/// inp (N,C), weight (OC,C); dinp is written instead (beta = 0: not read) when !accumulate.
void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, std::int64_t N, int C, int OC, std::int64_t ld, bool accumulate,
                     cudaStream_t stream);
/// pre (N,OC) = inp (N,C) weight^T + bias, out (N,OC) = GELU(pre): cuBLASLt's GELU_AUX_BIAS
/// epilogue (pre is its aux output) where OC % 8 == 0, else the plain matmul and the GELU kernel.
void matmul_gelu_forward(float* out, float* pre, const float* inp, const float* weight, const float* bias,
                         std::int64_t N, int C, int OC, cudaStream_t stream);
/// dpre (N,C) = GELU'(pre) (dout weight) WRITTEN (DGELU_BGRAD epilogue, whose bias gradient is
/// dpre_bias's increment), dweight (OC,C), dbias (OC), dpre_bias (C) +=; biases may be null.
void matmul_backward_dgelu(float* dpre, float* dweight, float* dbias, float* dpre_bias, const float* dout,
                           const float* inp, const float* pre, const float* weight, std::int64_t N, int C, int OC,
                           cudaStream_t stream);
/// Lets fp32 matmuls use TF32 tensor cores (about 8x faster, 10-bit mantissa inputs). Off by
/// default, so that results match the CPU reference to fp32 accuracy.
void set_matmul_tf32(bool allow);

// kernels/cuda/context_attention.cu: context parallelism's attention pieces (the CPU twins in
// cpu.h say what each computes), fp32 and bf16 activations; outputs other than kv_pack's and
// qkv_join's are fp32.
void attention_block_forward(float* out, float* lse, const float* qkv, const float* kv, int B, int Tq, int Tk, int C,
                             int NH, int NKV, int kv_width, kernels::Chunks q_at, kernels::Chunks k_at,
                             cudaStream_t stream);
void attention_block_forward(float* out, float* lse, const bf16* qkv, const bf16* kv, int B, int Tq, int Tk, int C,
                             int NH, int NKV, int kv_width, kernels::Chunks q_at, kernels::Chunks k_at,
                             cudaStream_t stream);
void attention_block_backward(float* dq, float* dkv, const float* dout, const float* qkv, const float* out,
                              const float* lse, const float* kv, int B, int Tq, int Tk, int C, int NH, int NKV,
                              int kv_width, kernels::Chunks q_at, kernels::Chunks k_at, cudaStream_t stream);
void attention_block_backward(float* dq, float* dkv, const bf16* dout, const bf16* qkv, const bf16* out,
                              const float* lse, const bf16* kv, int B, int Tq, int Tk, int C, int NH, int NKV,
                              int kv_width, kernels::Chunks q_at, kernels::Chunks k_at, cudaStream_t stream);
void attention_lse_merge(float* out, float* lse, const float* block_out, const float* block_lse, int B, int T, int C,
                         int NH, cudaStream_t stream);
void kv_pack(float* kv, const float* qkv, std::int64_t N, int C, int KVC, cudaStream_t stream);
void kv_pack(bf16* kv, const bf16* qkv, std::int64_t N, int C, int KVC, cudaStream_t stream);
void qkv_join(float* dqkv, const float* dq, const float* dkv, std::int64_t N, int C, int KVC, cudaStream_t stream);
void qkv_join(bf16* dqkv, const float* dq, const float* dkv, std::int64_t N, int C, int KVC, cudaStream_t stream);

// kernels/cuda/attention_decode.cu
/// One new position `pos` of one sequence: out (C) from q (C) and the caches k_cache, v_cache
/// (maxT, NKV HS) of positions 0..pos; NH query heads, query head h reads cached head h / (NH / NKV).
void attention_decode(float* out, const float* q, const float* k_cache, const float* v_cache, int pos, int C,
                      int NH, int NKV, cudaStream_t stream);

// kernels/cuda/elementwise.cu, kernels/cuda/llama.cu: the elementwise ops of kernels/include/llmtrain/kernels/elementwise.def,
// (outputs..., inputs..., N, stream), fp32 and bf16.
#define LLMTRAIN_ELEMENTWISE(name, outputs, inputs)                                                  \
  void name(LLMTRAIN_EW_LIST(LLMTRAIN_EW_F32_OUT, outputs), LLMTRAIN_EW_LIST(LLMTRAIN_EW_F32_IN, inputs), \
            std::int64_t N, cudaStream_t stream);                                                   \
  void name(LLMTRAIN_EW_LIST(LLMTRAIN_EW_BF16_OUT, outputs), LLMTRAIN_EW_LIST(LLMTRAIN_EW_BF16_IN, inputs), \
            std::int64_t N, cudaStream_t stream);
#include "llmtrain/kernels/elementwise.def"
#undef LLMTRAIN_ELEMENTWISE

// kernels/cuda/llama.cu
/// out (N,C) = inp (N,C) / sqrt(mean(inp^2) + eps) * weight (C); rstd (N) saved.
void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, std::int64_t N, int C,
                     float eps, cudaStream_t stream);
/// dinp (N,C), dweight (C) += from dout (N,C), inp (N,C), weight (C), rstd (N).
void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                      const float* rstd, std::int64_t N, int C, cudaStream_t stream);
/// out (B,T,H,HS) = inp (B,T,H,HS) with heads h < n_rot turned by the angles
/// (pos0 + t) theta^(-2i/HS) (rotate_half layout), the other heads copied; HS even.
void rope_forward(float* out, const float* inp, int B, int T, int H, int HS, int n_rot, int pos0, float theta,
                  cudaStream_t stream);
/// dinp (B,T,H,HS) += the inverse rotation of dout (B,T,H,HS) (heads below n_rot; the others pass through).
void rope_backward(float* dinp, const float* dout, int B, int T, int H, int HS, int n_rot, int pos0,
                   float theta, cudaStream_t stream);
// kernels/cuda/classifier.cu
/// losses (N) = -log softmax(logits (N,V))[targets (N)]; with dlogits_scale > 0 the logits are
/// overwritten by (softmax - onehot) * dlogits_scale. Returns the loss sum (synchronises the
/// stream); with loss_sum (a double in device memory) the sum is added there instead, on the
/// stream, and 0 is returned. A target outside [0, V) gives a NaN loss (the CPU reference reads
/// out of bounds). Every classifier kernel takes rows `ld` >= V elements apart (the padded
/// vocabulary: ld a multiple of 8 makes every row 16-byte aligned, so the 128-bit path applies to
/// any V); the padding [V, ld) is never read, and with a gradient it becomes 0.
double fused_classifier(float* logits, float* losses, const std::int32_t* targets, std::int64_t N, int V,
                        std::int64_t ld, float dlogits_scale, double* loss_sum, cudaStream_t stream);
/// The vocabulary-parallel cross-entropy (logits (N,V): columns [vocab_begin, vocab_begin + V) of
/// the vocabulary), as the CPU reference's three steps; the caller all-reduces between them.
/// 1. row_max (N) = each row's local max (NaNs skipped).
void classifier_row_max(float* row_max, const float* logits, std::int64_t N, int V, std::int64_t ld,
                        cudaStream_t stream);
/// 2. sum_exp (N) = the local sum of exp(logit - row_max); target_logit (N) = the target's logit
///    where this rank holds it, else 0 (NaN for a negative target).
void classifier_row_stats(float* sum_exp, float* target_logit, const float* logits, const float* row_max,
                          const std::int32_t* targets, std::int64_t N, int V, std::int64_t ld, std::int64_t vocab_begin,
                          cudaStream_t stream);
/// 3. losses (N) = log(sum_exp) + row_max - target_logit; with dlogits_scale > 0 the logits become
///    (softmax - onehot) * dlogits_scale. Returns the loss sum (synchronises the stream), or adds
///    it into loss_sum (device memory) as fused_classifier.
double classifier_parallel_finish(float* logits, float* losses, const float* row_max, const float* sum_exp,
                                  const float* target_logit, const std::int32_t* targets, std::int64_t N, int V,
                                  std::int64_t ld, std::int64_t vocab_begin, float dlogits_scale, double* loss_sum,
                                  cudaStream_t stream);

// kernels/cuda/optimizer.cu
/// Sum of squares of x (N), accumulated in double, deterministic (synchronises the stream); with
/// `into` (device memory) added there on the stream instead, returning 0.
double sum_squares(const float* x, std::int64_t N, double* into, cudaStream_t stream);
/// AdamW on param, grad, m, v (N), as cpu::adamw_update.
void adamw_update(float* param, const float* grad, float* m, float* v, std::int64_t N, float lr, float beta1,
                  float beta2, float eps, float weight_decay, int step, float grad_scale,
                  cudaStream_t stream);
/// One block's work in adamw_update_chunks: elements [begin, begin + length) of the arrays
/// (length <= adamw_chunk_elements), decayed or not.
struct AdamWChunk {
  std::int64_t begin;
  std::int32_t length;
  std::int32_t decay;  // 1: weight decay applies
};
/// Elements per AdamWChunk (the host cuts every run into chunks of at most this many).
inline constexpr std::int32_t adamw_chunk_elements = 4096;
/// AdamW on every chunk of `chunks` (n_chunks, in device memory) in one launch, as
/// cpu::adamw_update per run, with weight_decay where a chunk's decay is set and 0 elsewhere; on
/// param, grad, m, v (f32) and, unless null, working (bf16): the updated param rounded to nearest
/// even, as convert() would give.
void adamw_update_chunks(float* param, const float* grad, float* m, float* v, bf16* working,
                         const AdamWChunk* chunks, std::int64_t n_chunks, float lr, float beta1, float beta2,
                         float eps, float weight_decay, int step, float grad_scale, cudaStream_t stream);

// ---- mixed precision (bf16): the same ops, conventions above -----------------------------------
// Pointers of 16-bit elements need only 2-byte alignment; the 128-bit paths move 8 bf16 and need
// the pointers 16-byte aligned and the row lengths multiples of 8.

// kernels/cuda/convert.cu
/// out (N) = in (N) rounded to bf16, to nearest even (NaN stays NaN; beyond the bf16 range, +-inf).
void convert(bf16* out, const float* in, std::int64_t N, cudaStream_t stream);
/// out (N) = in (N) widened to float (exact).
void convert(float* out, const bf16* in, std::int64_t N, cudaStream_t stream);

// kernels/cuda/encoder.cu
/// out (B,T,C) = wte[inp] + wpe[t]; wte (V,C), wpe (maxT,C) or null; the sum in fp32.
void encoder_forward(bf16* out, const std::int32_t* inp, const bf16* wte, const bf16* wpe, int B, int T,
                     int C, cudaStream_t stream);
/// dwte (V,C) and dwpe (maxT,C, or null), fp32, += from dout (B,T,C). Deterministic.
void encoder_backward(float* dwte, float* dwpe, const bf16* dout, const std::int32_t* inp, int B, int T,
                      int C, cudaStream_t stream);

// kernels/cuda/layernorm.cu
/// out (N,C) from inp (N,C), weight, bias (C); mean, rstd (N) fp32.
void layernorm_forward(bf16* out, float* mean, float* rstd, const bf16* inp, const bf16* weight,
                       const bf16* bias, std::int64_t N, int C, cudaStream_t stream);
/// dinp (N,C) bf16 and dweight, dbias (C) fp32 += from dout, inp (N,C), weight (C), mean, rstd (N).
void layernorm_backward(bf16* dinp, float* dweight, float* dbias, const bf16* dout, const bf16* inp,
                        const bf16* weight, const float* mean, const float* rstd, std::int64_t N, int C,
                        cudaStream_t stream);
/// residual (N,C) = a + b rounded to bf16, then its LayerNorm as layernorm_forward (of the rounded sum).
void layernorm_residual_forward(bf16* residual, bf16* out, float* mean, float* rstd, const bf16* a, const bf16* b,
                                const bf16* weight, const bf16* bias, std::int64_t N, int C, cudaStream_t stream);

// kernels/cuda/matmul.cu (cuBLASLt: bf16 inputs, fp32 accumulation, CUBLAS_COMPUTE_32F)
/// out (N,OC) = inp (N,C) weight^T + bias; weight (OC,C); bias (OC) or null; rounded once; rows
/// of out ld apart.
void matmul_forward(bf16* out, const bf16* inp, const bf16* weight, const bf16* bias, std::int64_t N, int C,
                    int OC, std::int64_t ld, cudaStream_t stream);
/// dinp (N,C) bf16 += (one rounding of the sum), dweight (OC,C) and dbias (OC, may be null) fp32 +=,
/// from dout (N,OC; rows ld apart), inp (N,C), weight (OC,C).
void matmul_backward(bf16* dinp, float* dweight, float* dbias, const bf16* dout, const bf16* inp,
                     const bf16* weight, std::int64_t N, int C, int OC, std::int64_t ld, bool accumulate,
                     cudaStream_t stream);
/// The GELU_AUX_BIAS forward: out and pre (N,OC) bf16, each rounded once from fp32.
void matmul_gelu_forward(bf16* out, bf16* pre, const bf16* inp, const bf16* weight, const bf16* bias,
                         std::int64_t N, int C, int OC, cudaStream_t stream);
/// The DGELU backward: dpre (N,C) bf16 written; dpre_bias (fp32) from the bf16 dpre by a column sum
/// (DGELU_BGRAD would give it in bf16, D's type).
void matmul_backward_dgelu(bf16* dpre, float* dweight, float* dbias, float* dpre_bias, const bf16* dout,
                           const bf16* inp, const bf16* pre, const bf16* weight, std::int64_t N, int C, int OC,
                           cudaStream_t stream);

// kernels/cuda/attention_decode.cu
/// out (C) from q (C) and the caches k_cache, v_cache (maxT, NKV HS), positions 0..pos.
void attention_decode(bf16* out, const bf16* q, const bf16* k_cache, const bf16* v_cache, int pos, int C,
                      int NH, int NKV, cudaStream_t stream);

// kernels/cuda/llama.cu
/// out (N,C) from inp (N,C), weight (C); rstd (N) fp32.
void rmsnorm_forward(bf16* out, float* rstd, const bf16* inp, const bf16* weight, std::int64_t N, int C,
                     float eps, cudaStream_t stream);
/// dinp (N,C) bf16 and dweight (C) fp32 += from dout, inp (N,C), weight (C), rstd (N).
void rmsnorm_backward(bf16* dinp, float* dweight, const bf16* dout, const bf16* inp, const bf16* weight,
                      const float* rstd, std::int64_t N, int C, cudaStream_t stream);
/// out (B,T,H,HS) = inp (B,T,H,HS) rotated (heads below n_rot), angles in double as in fp32.
void rope_forward(bf16* out, const bf16* inp, int B, int T, int H, int HS, int n_rot, int pos0, float theta,
                  cudaStream_t stream);
/// dinp (B,T,H,HS) += the inverse rotation of dout (B,T,H,HS).
void rope_backward(bf16* dinp, const bf16* dout, int B, int T, int H, int HS, int n_rot, int pos0,
                   float theta, cudaStream_t stream);
// kernels/cuda/classifier.cu
/// losses (N) fp32 from logits (N,V) bf16, softmax in fp32; with dlogits_scale > 0 the logits are
/// overwritten by the gradient, rounded to bf16. Returns the loss sum (synchronises the stream).
double fused_classifier(bf16* logits, float* losses, const std::int32_t* targets, std::int64_t N, int V,
                        std::int64_t ld, float dlogits_scale, double* loss_sum, cudaStream_t stream);
/// The vocabulary-parallel steps on bf16 logits, in fp32; the gradient is rounded to bf16.
void classifier_row_max(float* row_max, const bf16* logits, std::int64_t N, int V, std::int64_t ld,
                        cudaStream_t stream);
void classifier_row_stats(float* sum_exp, float* target_logit, const bf16* logits, const float* row_max,
                          const std::int32_t* targets, std::int64_t N, int V, std::int64_t ld, std::int64_t vocab_begin,
                          cudaStream_t stream);
double classifier_parallel_finish(bf16* logits, float* losses, const float* row_max, const float* sum_exp,
                                  const float* target_logit, const std::int32_t* targets, std::int64_t N, int V,
                                  std::int64_t ld, std::int64_t vocab_begin, float dlogits_scale, double* loss_sum,
                                  cudaStream_t stream);

}  // namespace llmtrain::cuda
