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
/// past OC not read); dinp (N,C) += too, or is written when !accumulate (its first writer). A
/// null dinp, or a null dweight (with a null dbias), skips that part.
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
/// out (B,M,N) = inp (B,M,K) weight^T for each of B matrices, weight (B,N,K); or, when
/// !transpose_weight, inp weight with weight (B,K,N). No bias: Newton-Schulz's products.
void batched_matmul(float* out, const float* inp, const float* weight, std::int64_t B, int M, int N, int K,
                    bool transpose_weight);

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

/// Per-head RMSNorm of a packed qkv (N, (NH + 2 NKV) HS): out = each query head of inp normalised
/// and scaled by q_weight (HS), each key head by k_weight (HS), the value heads copied; rstd
/// (N, NH + NKV) saved.
void qk_norm_forward(float* out, float* rstd, const float* inp, const float* q_weight, const float* k_weight,
                     std::int64_t N, int NH, int NKV, int HS, float eps);
/// Its backward: dinp (N, (NH + 2 NKV) HS) written (value heads: dout's); dq_weight, dk_weight (HS) +=.
void qk_norm_backward(float* dinp, float* dq_weight, float* dk_weight, const float* dout, const float* inp,
                      const float* q_weight, const float* k_weight, const float* rstd, std::int64_t N, int NH, int NKV,
                      int HS);

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

/// Muon's momentum (torch.optim.Muon's) on buf, grad, u (N): g = grad * grad_scale;
/// buf <- buf + (1 - momentum)(g - buf); u = g + momentum (buf - g) when nesterov, else buf.
void muon_momentum(float* buf, const float* grad, float* u, std::int64_t N, float momentum, int nesterov,
                   float grad_scale);
/// Muon's weight update on param, o (N): param <- param * keep - step * o.
void muon_apply(float* param, const float* o, std::int64_t N, float keep, float step);

// ---- Newton-Schulz (newton_schulz.cpp; optim/newton_schulz.h) ------------------------------------
// Muon's orthogonalisation on a (rows, cols) matrix, worked on in its wide orientation (m, n),
// m = min(rows, cols) <= n = max(rows, cols); its products are batched_matmul's.

/// x (m,n) = u (rows,cols), transposed when rows > cols, times 1 / max(sqrt(*squares), eps):
/// the matrix over its Frobenius norm, squares being its sum of squares (sum_squares').
void newton_schulz_normalise(float* x, const float* u, const double* squares, std::int64_t rows, std::int64_t cols,
                             double eps);
/// out (C,N) = inp (N,C)^T.
void transpose(float* out, const float* inp, std::int64_t N, std::int64_t C);
/// out (N) = alpha x + beta y (the quintic's b A + c A^2 and a X + (b A + c A^2) X).
void scaled_sum(float* out, const float* x, const float* y, std::int64_t N, float alpha, float beta);

// ---- Mixture of Experts (moe.cpp, grouped_matmul.cpp; docs/moe.md) ------------------------------
// E experts, k chosen per token, N tokens, N k token slots (slot s = t k + j: token t's j-th
// choice); M = offsets[E] rows kept, in expert order.

/// Router forward from logits (N,E): probs (N,E) f32 the softmax probabilities (or, `sigmoid`,
/// the sigmoid scores); experts (N,k) the top k of probs + bias (bias (E) or null), ties to the
/// lower index; weights (N,k) f32 the chosen probs, renormalised to sum 1 when `normalize` (always
/// with `sigmoid`), times route_scale; counts (E) f32 how many tokens chose each expert; pbar (E)
/// f32 Pbar_e, the mean over the tokens of each expert's probability (`sigmoid`: of its score over
/// the token's score sum); losses (3) f32: the load-balancing loss (E/k) sum_e (c_e/N) Pbar_e, the
/// z-loss mean_t lse_t^2, and the largest load over the mean load.
void moe_router_forward(float* probs, std::int32_t* experts, float* weights, float* counts, float* pbar,
                        float* losses, const float* logits, const float* bias, std::int64_t N, int E, int k, bool sigmoid,
                        bool normalize, float route_scale);
/// dlogits (N,E) WRITTEN: the gradient from dweights (N,k) f32, plus aux_scale times the
/// load-balancing loss's and z_scale times the z-loss's (counts held constant).
void moe_router_backward(float* dlogits, const float* dweights, const float* logits, const float* probs,
                         const std::int32_t* experts, const float* counts, std::int64_t N, int E, int k,
                         bool sigmoid, bool normalize, float route_scale, float aux_scale, float z_scale);
/// The dispatch plan of experts (N,k): offsets (E+1) the first row of each expert; slot_row (N k)
/// each slot's row (-1: dropped), row_slot (N k) each row's slot (-1 past M); with capacity > 0
/// each expert keeps at most `capacity` slots, the later ones in token order dropped; dropped (1)
/// f32 the fraction of slots dropped.
void moe_dispatch(std::int32_t* offsets, std::int32_t* row_slot, std::int32_t* slot_row, float* dropped,
                  const std::int32_t* experts, std::int64_t N, int E, int k, std::int64_t capacity);
/// xp (N k, C): its first M rows, row r a copy of x (N,C)'s row of slot row_slot[r].
void moe_permute_forward(float* xp, const float* x, const std::int32_t* row_slot, const std::int32_t* offsets,
                         std::int64_t N, int E, int k, int C);
/// dx (N,C) += (or, !accumulate, =) the sum of its kept slots' rows of dxp (N k, C): a gather.
void moe_permute_backward(float* dx, const float* dxp, const std::int32_t* slot_row, std::int64_t N, int k, int C,
                          bool accumulate);
/// out (N,C) WRITTEN: sum over token t's kept slots of weights (N,k) times y's (N k, C) row.
void moe_unpermute_forward(float* out, const float* y, const float* weights, const std::int32_t* slot_row,
                           std::int64_t N, int k, int C);
/// dy (N k, C; first M rows) and dweights (N,k) f32 (0 for a dropped slot) WRITTEN from dout (N,C).
void moe_unpermute_backward(float* dy, float* dweights, const float* dout, const float* y, const float* weights,
                            const std::int32_t* row_slot, const std::int32_t* slot_row, const std::int32_t* offsets,
                            std::int64_t N, int E, int k, int C);
/// bias (n) += rate sign(mean_load - loads (n)): aux-loss-free balancing (n: all of a layer's E
/// experts, or the part of them a ZeRO shard holds).
void moe_bias_update(float* bias, const float* loads, float mean_load, std::int64_t n, float rate);
/// out (rows, OC) = each expert's rows of inp (rows, C) times weight[e]^T (weight (E,OC,C)), the
/// rows of expert e being [offsets[e], offsets[e+1]).
void grouped_matmul_forward(float* out, const float* inp, const float* weight, const std::int32_t* offsets, int E,
                            int C, int OC);
/// dweight (E,OC,C) += ; dinp (rows, C) += (or, !accumulate, =) from dout (rows, OC); a null dinp or
/// dweight skips that part.
void grouped_matmul_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                             const std::int32_t* offsets, int E, int C, int OC, bool accumulate);

}  // namespace llmtrain::cpu
