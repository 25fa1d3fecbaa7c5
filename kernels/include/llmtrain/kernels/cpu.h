// CPU reference implementations of the Transformer ops, fp32. The CUDA twins
// (llmtrain/kernels/cuda.h) take the same arguments in the same order, plus a stream (the
// matmuls: a cuBLASLt handle and workspace, then a stream); kernels/cpu/NAME.cpp and
// kernels/cuda/NAME.cu hold an op's twins under one file name.
//
// Conventions: B batch, T time, C channels, V vocabulary, NH heads, HS = C / NH head size,
// OC output channels, N = B * T rows. Every backward op ACCUMULATES (+=) into its outputs, both
// parameter and activation gradients; the caller zeroes them when a new accumulation starts.
// Loops are parallelised over rows with OpenMP, above a grain of work only (vec_math.h: smaller
// work runs on the calling thread); reductions over rows (weight gradients) sum per-thread
// partials in a fixed order, so results are deterministic for a fixed thread count.
#pragma once

#include <cstdint>

#include "llmtrain/kernels/context_attention.h"
#include "llmtrain/kernels/elementwise.h"

namespace llmtrain::cpu {

/// out (B,T,C) = wte[inp] + wpe[t]; inp (B,T); wte (V,C); wpe (maxT,C), or null for no position
/// table (Llama: positions enter through the rotary embedding).
void encoder_forward(float* out, const std::int32_t* inp, const float* wte, const float* wpe, int B, int T, int C);
/// dwte (V,C) and dwpe (maxT,C, or null) += from dout (B,T,C).
void encoder_backward(float* dwte, float* dwpe, const float* dout, const std::int32_t* inp, int B, int T, int C);

/// out (N,C) = (inp - mean) * rstd * weight + bias; mean, rstd (N) saved for backward.
void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                       const float* bias, std::int64_t N, int C);
void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, std::int64_t N, int C);
/// residual (N,C) = a + b, then out, mean, rstd as layernorm_forward of residual.
void layernorm_residual_forward(float* residual, float* out, float* mean, float* rstd, const float* a, const float* b,
                                const float* weight, const float* bias, std::int64_t N, int C);

/// out (N,OC) = inp (N,C) weight^T + bias; weight (OC,C); bias (OC) or null. OpenBLAS sgemm.
/// Rows of out are `ld` >= OC elements apart (a padded row, as the logits'); the columns past OC
/// are not touched.
void matmul_forward(float* out, const float* inp, const float* weight, const float* bias, std::int64_t N, int C,
                    int OC, std::int64_t ld);
/// dweight (OC,C), dbias (OC, may be null) += from dout (N,OC; rows `ld` >= OC apart, the columns
/// past OC not read); dinp (N,C) += too, or is written when !accumulate (its first writer).
void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, std::int64_t N, int C, int OC, std::int64_t ld, bool accumulate);
/// pre (N,OC) = inp (N,C) weight^T + bias (pre-activation, kept for backward); out (N,OC) = GELU(pre).
void matmul_gelu_forward(float* out, float* pre, const float* inp, const float* weight, const float* bias,
                         std::int64_t N, int C, int OC);
/// Backward of out = inp weight^T + bias with inp = GELU(pre) (N,C), through the GELU: dpre (N,C) =
/// GELU'(pre) (dout weight) is WRITTEN (not accumulated); dweight (OC,C), dbias (OC, may be null)
/// and dpre_bias (C, may be null: the column sums of dpre, the bias gradient of the matmul that
/// made pre) += .
void matmul_backward_dgelu(float* dpre, float* dweight, float* dbias, float* dpre_bias, const float* dout,
                           const float* inp, const float* pre, const float* weight, std::int64_t N, int C, int OC);

/// Causal self-attention with NKV key/value heads (NKV divides NH; GPT-2: NKV = NH). qkv
/// (B,T,(NH+2NKV)HS): NH query heads, NKV key heads, NKV value heads, each a contiguous HS slice;
/// C = NH HS. out (B,T,C); att (B,NH,T,T) keeps the probabilities for backward (row t: keys 0..t).
/// Not an op: the model uses flash attention; this textbook form is the tests' independent check of it.
void attention_forward(float* out, float* att, const float* qkv, int B, int T, int C, int NH, int NKV);
/// dqkv (B,T,(NH+2NKV)HS) += from dout (B,T,C).
void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* att, int B, int T, int C,
                        int NH, int NKV);

/// The same attention without the probabilities (flash-attention interface): out (B,T,C) and
/// lse (B,NH,T), the log-sum-exp of each row's scaled scores, from qkv (B,T,(NH+2NKV)HS).
/// seg (B,T), nondecreasing along each sequence (may be null: plain causal): a document mask, row
/// t sees the keys s <= t with seg[s] = seg[t] (on the GPU: the ops run the block kernels).
void flash_attention_forward(float* out, float* lse, const float* qkv, int B, int T, int C, int NH, int NKV,
                             const std::int32_t* seg = nullptr);
/// dqkv (B,T,(NH+2NKV)HS) += from dout (B,T,C), recomputing the probabilities from qkv and lse
/// (B,NH,T); out (B,T,C) gives D = rowsum(dout * out). !accumulate: dqkv is written instead (its
/// first writer: what it held is not read). seg: the forward's document mask (may be null).
void flash_attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse,
                              int B, int T, int C, int NH, int NKV, bool accumulate,
                              const std::int32_t* seg = nullptr);

/// Context parallelism (llmtrain/kernels/context_attention.h): attention of queries against one
/// block of keys and values, each row at its true position in the sequence (a key is seen by the
/// queries at or after it). qkv (B,Tq,(NH+2NKV)HS) holds the queries (its first NH HS columns);
/// kv (B,Tk,kv_width) the block's NKV key heads then NKV value heads in its last 2 NKV HS columns
/// (a packed qkv, or a (B,Tk,2 NKV HS) block). Writes out (B,Tq,C) and lse (B,NH,Tq), the
/// block's own softmax (rows that see no key of the block: out 0, lse -inf). seg (B,T) (may be
/// null): the whole sequences' segment ids (T = the whole length), read at the rows' positions, a
/// document mask as flash_attention_forward's.
void attention_block_forward(float* out, float* lse, const float* qkv, const float* kv, int B, int Tq, int Tk, int C,
                             int NH, int NKV, int kv_width, kernels::Chunks q_at, kernels::Chunks k_at,
                             const std::int32_t* seg = nullptr, int T = 0);
/// Its backward against the whole row's softmax: out (B,Tq,C) and lse (B,NH,Tq) are the merged
/// results over every block. dq (B,Tq,(NH+2NKV)HS) += the queries' gradient (first NH HS
/// columns); dkv (B,Tk,kv_width) += the block's key and value gradients (its last 2 NKV HS
/// columns). dq and dkv may be the same buffer (the block of the rank's own keys).
void attention_block_backward(float* dq, float* dkv, const float* dout, const float* qkv, const float* out,
                              const float* lse, const float* kv, int B, int Tq, int Tk, int C, int NH, int NKV,
                              int kv_width, kernels::Chunks q_at, kernels::Chunks k_at,
                              const std::int32_t* seg = nullptr, int T = 0);
/// Merges a block's attention (block_out (B,T,C), block_lse (B,NH,T)) into the running result
/// (out, lse) by their log-sum-exps: out = (e^lse out + e^block_lse block_out) / (e^lse + e^block_lse).
void attention_lse_merge(float* out, float* lse, const float* block_out, const float* block_lse, int B, int T, int C,
                         int NH);
/// kv (N, 2 KVC) = the key and value columns [C, C + 2 KVC) of qkv (N, C + 2 KVC).
void kv_pack(float* kv, const float* qkv, std::int64_t N, int C, int KVC);
/// dqkv (N, C + 2 KVC) = dq's query columns [0, C) (dq (N, C + 2 KVC)) next to dkv (N, 2 KVC).
void qkv_join(float* dqkv, const float* dq, const float* dkv, std::int64_t N, int C, int KVC);

/// Attention of one new position `pos` of one sequence against a KV cache: out (C) from q (C)
/// and the cached keys and values k_cache, v_cache (maxT, NKV HS) of positions 0..pos; query head
/// h reads key/value head h / (NH / NKV), so grouped heads are cached once.
void attention_decode(float* out, const float* q, const float* k_cache, const float* v_cache, int pos, int C, int NH,
                      int NKV);

/// The elementwise ops of llmtrain/kernels/elementwise.def: (outputs..., inputs..., N).
#define LLMTRAIN_ELEMENTWISE(name, outputs, inputs)                                                  \
  void name(LLMTRAIN_EW_LIST(LLMTRAIN_EW_F32_OUT, outputs), LLMTRAIN_EW_LIST(LLMTRAIN_EW_F32_IN, inputs), \
            std::int64_t N);
#include "llmtrain/kernels/elementwise.def"
#undef LLMTRAIN_ELEMENTWISE
/// RMSNorm (Llama): out (N,C) = inp / sqrt(mean(inp^2) + eps) * weight; rstd (N) saved.
void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, std::int64_t N, int C, float eps);
/// dinp (N,C), dweight (C) += from dout (N,C).
void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                      const float* rstd, std::int64_t N, int C);

/// Rotary position embedding in Hugging Face's rotate_half layout, on x (B,T,H,HS): for heads
/// h < n_rot, element i < HS/2 pairs with i + HS/2 and both turn by the angle
/// (pos0 + t) * theta^(-2i/HS); heads n_rot..H-1 are copied unchanged (so one call rotates the
/// query and key heads of a packed qkv and passes its value heads through).
void rope_forward(float* out, const float* inp, int B, int T, int H, int HS, int n_rot, int pos0, float theta);
/// dinp (B,T,H,HS) += the inverse rotation of dout (heads below n_rot; the others pass through).
void rope_backward(float* dinp, const float* dout, int B, int T, int H, int HS, int n_rot, int pos0, float theta);

/// Softmax + cross-entropy over logits (N,V) in one pass: losses (N) = -log softmax(logits)[target].
/// With `dlogits_scale` > 0 the logits are overwritten by their gradient, (softmax - onehot) *
/// scale, so the probabilities are never stored. Returns the sum of the N losses; with loss_sum,
/// adds it there instead and returns 0 (as the CUDA kernel does into device memory).
/// Every classifier function takes rows `ld` >= V elements apart: the padded vocabulary, whose
/// columns [V, ld) are never read, and with a gradient are set to 0.
double fused_classifier(float* logits, float* losses, const std::int32_t* targets, std::int64_t N, int V,
                        std::int64_t ld, float dlogits_scale, double* loss_sum);

/// The same cross-entropy with the vocabulary split over ranks (a vocabulary-parallel output
/// head): logits (N,V) hold columns [vocab_begin, vocab_begin + V) of the full vocabulary, and no
/// rank holds a full row. Three steps; between them the caller all-reduces over the ranks.
/// 1. row_max (N) = the max of each row's local logits (NaNs skipped, -inf for V = 0).
///    The caller takes the max over the ranks.
void classifier_row_max(float* row_max, const float* logits, std::int64_t N, int V, std::int64_t ld);
/// 2. sum_exp (N) = sum over the local columns of exp(logit - row_max), row_max the global max;
///    target_logit (N) = the logit of targets[i] (full-vocabulary ids) where this rank holds it,
///    else 0, or NaN for a negative target. The caller sums both over the ranks.
void classifier_row_stats(float* sum_exp, float* target_logit, const float* logits, const float* row_max,
                          const std::int32_t* targets, std::int64_t N, int V, std::int64_t ld,
                          std::int64_t vocab_begin);
/// 3. losses (N) = log(sum_exp) + row_max - target_logit, from the global statistics; with
///    dlogits_scale > 0 the local logits become (softmax - onehot) * dlogits_scale, as
///    fused_classifier's columns. Returns the sum of the N losses (the same on every rank), or
///    adds it into loss_sum, as fused_classifier.
double classifier_parallel_finish(float* logits, float* losses, const float* row_max, const float* sum_exp,
                                  const float* target_logit, const std::int32_t* targets, std::int64_t N, int V,
                                  std::int64_t ld, std::int64_t vocab_begin, float dlogits_scale, double* loss_sum);

/// Sum of squares of x (N), accumulated in double in fixed-size chunks (deterministic).
/// With `into`, adds the sum there and returns 0.
double sum_squares(const float* x, std::int64_t N, double* into);

/// AdamW on one parameter tensor (N): g = grad * grad_scale; m, v moment updates; bias-corrected
/// step at `step` (1-based); decoupled weight decay param -= lr * weight_decay * param.
void adamw_update(float* param, const float* grad, float* m, float* v, std::int64_t N, float lr, float beta1,
                  float beta2, float eps, float weight_decay, int step, float grad_scale);

}  // namespace llmtrain::cpu
