// The Transformer ops as the model calls them. Each validates its tensors once (dtype, device,
// shape) and dispatches (src/ops/dispatch.h) to the CPU reference (kernels/include/llmtrain/kernels/cpu.h) or, on
// cuda tensors, to the CUDA kernels (kernels/include/llmtrain/kernels/cuda.h). Backward ops accumulate (+=) into
// their outputs, like their CPU references, except where they say otherwise: an activation
// gradient's first writer writes it (Accumulate::no, matmul_backward_dgelu), so that nothing has
// to zero it first.
//
// Precision: activations, their gradients and the weights an op reads are all f32, or all bf16
// (mixed precision); weight gradients (dweight, dbias, dwte, ...) and statistics (mean, rstd,
// lse, losses) are always f32. On the CPU, bf16 ops run the f32 reference on widened copies and
// round their outputs once: slow, and meant for checking the mixed-precision path.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "ops/buffer.h"
#include "llmtrain/kernels/context_attention.h"
#include "llmtrain/kernels/elementwise.h"

namespace llmtrain::ops {

/// out (B,T,C) = wte[inp] + wpe[t]; inp (B,T) i32; wte (V,C); wpe (maxT,C), or no data for none.
void encoder_forward(const Tensor& out, const Tensor& inp, const Tensor& wte, const Tensor& wpe);
void encoder_backward(const Tensor& dwte, const Tensor& dwpe, const Tensor& dout, const Tensor& inp);

/// out (N,C) LayerNorm of inp (N,C) with weight, bias (C); mean, rstd (N) saved.
void layernorm_forward(const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& inp,
                       const Tensor& weight, const Tensor& bias);
void layernorm_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dbias, const Tensor& dout,
                        const Tensor& inp, const Tensor& weight, const Tensor& mean, const Tensor& rstd);
/// residual (N,C) = a + b (N,C), then out (N,C), mean, rstd (N) its LayerNorm: a residual add and
/// the LayerNorm after it in one pass over the rows (residual_forward, then layernorm_forward).
void layernorm_residual_forward(const Tensor& residual, const Tensor& out, const Tensor& mean, const Tensor& rstd,
                                const Tensor& a, const Tensor& b, const Tensor& weight, const Tensor& bias);

/// out (N,OC) = inp (N,C) weight^T (weight (OC,C)) + bias (OC); a bias with no data means none.
/// out may have wider rows, (N,ld) with ld > OC (the padded logits): its columns past OC are not
/// written.
void matmul_forward(const Tensor& out, const Tensor& inp, const Tensor& weight, const Tensor& bias);
/// Whether a backward op adds its input gradient to dinp or is its first writer and writes it
/// (no zeroing beforehand, and on the GPU no read of the old values).
enum class Accumulate : bool { no, yes };
/// dinp (N,C) += (or, Accumulate::no, =) dout weight; dweight (OC,C), dbias (OC) += . dout may
/// have wider rows, (N,ld) with ld > OC, as matmul_forward's out: its columns past OC are not read.
/// Either part may run alone (a backward split into input and weight gradients): dinp without
/// data skips the input gradient, dweight without data (and then no dbias) the weight gradients;
/// each part is the same arithmetic as in the whole call, so the two apart give its bits.
void matmul_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dbias, const Tensor& dout,
                     const Tensor& inp, const Tensor& weight, Accumulate dinp_mode = Accumulate::yes);

/// pre (N,OC) = inp (N,C) weight^T + bias, out (N,OC) = GELU(pre): the MLP's first projection and
/// its activation in one (on the GPU cuBLASLt's GELU_AUX_BIAS epilogue); pre is kept for backward.
void matmul_gelu_forward(const Tensor& out, const Tensor& pre, const Tensor& inp, const Tensor& weight,
                         const Tensor& bias);
/// Backward of out = inp weight^T + bias where inp (N,C) = GELU(pre), through the GELU: dpre (N,C)
/// = GELU'(pre) (dout weight) is WRITTEN, not accumulated; dweight (OC,C), dbias (OC) and dpre_bias
/// (C: the column sums of dpre, the bias gradient of the matmul that made pre) += ; either bias
/// gradient may have no data, and dweight none (then dbias none either): the weight gradients
/// left to a later matmul_backward without dinp. On the GPU cuBLASLt's DGELU epilogue
/// (DGELU_BGRAD in fp32).
void matmul_backward_dgelu(const Tensor& dpre, const Tensor& dweight, const Tensor& dbias, const Tensor& dpre_bias,
                           const Tensor& dout, const Tensor& inp, const Tensor& pre, const Tensor& weight);

/// Which GPU kernels compute flash_attention_*: ours, or cuDNN's fused attention (bf16 only).
/// The CPU reference serves both. Deliberately not config::Attention: the config's "auto" is
/// resolved at start-up (parallel/attention_choice.h), so it has no value here.
enum class AttentionKernels { flash, cudnn };

/// Whether cuDNN's fused attention can run in this process (a build with cuDNN 9.16 or newer, a
/// GPU of compute capability 8.0 or newer); else false, with the reason in *why_not (not null).
bool cudnn_attention_available(std::string* why_not);
/// Whether cuDNN accepts both attention graphs (forward, backward) for q heads NH, kv heads NKV
/// and C = NH HS at (B,T) on the current GPU: builds and keeps their plans (seconds, the first
/// time); else false, with cuDNN's reason in *why_not (not null).
bool cudnn_attention_supported(int B, int T, int C, int NH, int NKV, std::string* why_not);
/// The cuDNN library's version ("9.10.2"), or "not built".
std::string cudnn_version();

/// Whether the GPU kernels must be bitwise reproducible (train.deterministic; true by default).
/// false lets the bf16 tensor-core flash attention backward (AttentionKernels::flash, head sizes
/// 64 and 128) run in one pass, summing dQ with atomics in an order that varies run to run.
/// Process-wide; no effect on the CPU or in a build without CUDA.
void set_deterministic(bool deterministic);

/// Causal self-attention, memory-lean (flash attention): qkv (B,T,(NH+2NKV)HS) holds NH query, NKV
/// key and NKV value heads (grouped-query attention; NKV 0 means NH, GPT-2's qkv (B,T,3C)) ->
/// out (B,T,NH HS) and lse (B,NH,T) f32, the log-sum-exp of each row's scaled scores; nothing of
/// size T x T is stored. segments (B,T) i32, nondecreasing along each sequence (empty: plain
/// causal): a document mask for packed sequences, row t attending to keys s <= t with
/// segments[s] = segments[t]; CPU kernels only so far (CUDA tensors throw "no CUDA kernel").
void flash_attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, int NH, int NKV = 0,
                             AttentionKernels kernels = AttentionKernels::flash, const Tensor& segments = Tensor());
/// dqkv += (or, Accumulate::no, =) the gradient from dout (B,T,NH HS), recomputing the
/// probabilities from qkv, out and lse. As dqkv's first writer cuDNN writes it directly, with no
/// scratch copy to add; llmtrain's kernels zero it on the device and add. segments: the
/// forward's document mask (empty: none).
void flash_attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                              const Tensor& lse, int NH, int NKV = 0,
                              AttentionKernels kernels = AttentionKernels::flash,
                              Accumulate dqkv_mode = Accumulate::yes, const Tensor& segments = Tensor());

/// Context parallelism (parallel/context_attention.h): which positions of the sequence a rank's rows
/// hold (kernels::Chunks: one chunk, or the head-and-tail pair of a context-parallel rank).
using Chunks = kernels::Chunks;
/// Attention of the queries of qkv (B,Tq,(NH+2NKV)HS) at positions `q_at` against one block of
/// keys and values at positions `k_at`: kv (B,Tk,W) holds NKV key heads then NKV value heads in
/// its last 2 NKV HS columns (a packed qkv, or a (B,Tk,2 NKV HS) block from kv_pack). A key is
/// seen by the queries at or after its position. Writes the block's own softmax result: out
/// (B,Tq,NH HS) f32 and lse (B,NH,Tq) f32 (rows that see no key of the block: 0 and -inf).
/// With every key in one block (Chunks{T, 0}) it is flash_attention_forward. segments (B,T) i32:
/// the whole sequences' segment ids (T their whole length; empty: none), a document mask as
/// flash_attention_forward's, read at the rows' positions (CPU kernels only so far).
void attention_block_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, const Tensor& kv,
                             const Chunks& q_at, const Chunks& k_at, int NH, int NKV = 0,
                             const Tensor& segments = Tensor());
/// Its backward, against the softmax over all blocks: out (B,Tq,NH HS) and lse (B,NH,Tq) the
/// merged results (out in the activations' dtype). dq (B,Tq,(NH+2NKV)HS) f32 += the queries'
/// gradient (its first NH HS columns); dkv f32, shaped as kv, += the block's key and value
/// gradients (its last 2 NKV HS columns). dq and dkv may be one tensor (a rank's own block).
void attention_block_backward(const Tensor& dq, const Tensor& dkv, const Tensor& dout, const Tensor& qkv,
                              const Tensor& out, const Tensor& lse, const Tensor& kv, const Chunks& q_at,
                              const Chunks& k_at, int NH, int NKV = 0, const Tensor& segments = Tensor());
/// The log-sum-exp merge: (out, lse) f32 (B,T,C), (B,NH,T) become the attention over both their
/// keys and the block's (block_out, block_lse).
void attention_lse_merge(const Tensor& out, const Tensor& lse, const Tensor& block_out, const Tensor& block_lse);
/// kv (B,T,2 KVC) = the key and value columns of qkv (B,T,C + 2 KVC), C = NH HS, KVC = NKV HS.
void kv_pack(const Tensor& kv, const Tensor& qkv, int NH, int NKV = 0);
/// dqkv (B,T,C + 2 KVC) = the query columns of dq (f32, shaped as dqkv; it may be dqkv itself) and dkv
/// (f32, (B,T,2 KVC)).
void qkv_join(const Tensor& dqkv, const Tensor& dq, const Tensor& dkv, int NH, int NKV = 0);

/// One new position of one sequence: out (C) from q (C) and the caches (maxT, NKV HS) up to `pos`
/// (NKV 0: NH).
void attention_decode(const Tensor& out, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, int pos,
                      int NH, int NKV = 0);

/// RMSNorm: out (N,C) from inp (N,C), weight (C); rstd (N) saved.
void rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& inp, const Tensor& weight, float eps);
void rmsnorm_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dout, const Tensor& inp,
                      const Tensor& weight, const Tensor& rstd);
/// Per-head RMSNorm of a packed qkv (N, (NH + 2 NKV) HS) (model.qk_norm): out, shaped as inp, holds
/// each query head normalised and scaled by q_weight (HS), each key head by k_weight (HS), the value
/// heads copied; rstd (N, NH + NKV) f32 saved.
void qk_norm_forward(const Tensor& out, const Tensor& rstd, const Tensor& inp, const Tensor& q_weight,
                     const Tensor& k_weight, int NH, int NKV, float eps);
/// Its backward: dinp (shaped as inp) written, its value heads dout's; dq_weight, dk_weight (HS) f32 +=.
void qk_norm_backward(const Tensor& dinp, const Tensor& dq_weight, const Tensor& dk_weight, const Tensor& dout,
                      const Tensor& inp, const Tensor& q_weight, const Tensor& k_weight, const Tensor& rstd, int NH,
                      int NKV);

/// Rotary embedding (rotate_half layout) on (B,T,H,HS) tensors: heads below `rotated_heads` (-1:
/// all) turn by their position pos0 + t, the others pass through unchanged.
void rope_forward(const Tensor& out, const Tensor& inp, float theta, int rotated_heads = -1, int pos0 = 0);
void rope_backward(const Tensor& dinp, const Tensor& dout, float theta, int rotated_heads = -1, int pos0 = 0);

/// The elementwise ops (GELU, residual, SwiGLU): one line each in elementwise.def.
#define LLMTRAIN_ELEMENTWISE(name, outputs, inputs) \
  void name(LLMTRAIN_EW_LIST(LLMTRAIN_EW_TENSOR, outputs), LLMTRAIN_EW_LIST(LLMTRAIN_EW_TENSOR, inputs));
#include "llmtrain/kernels/elementwise.def"
#undef LLMTRAIN_ELEMENTWISE

/// A sum kept where the summed tensors are (a double in device memory on a GPU), so that ops can
/// add into it without the host waiting for each (the losses of an update's micro-steps, the
/// parts of a gradient norm): take() waits, once.
class DeviceSum {
 public:
  explicit DeviceSum(Device device);
  Device device() const { return buffer_.device(); }
  double* data() const { return static_cast<double*>(buffer_.data()); }
  /// The sum so far (waiting for the device), and starts again from 0.
  double take();

 private:
  Buffer buffer_;
};

/// The padded vocabulary (as llm.c's): the row stride of logits of V vocabulary columns, V rounded
/// up to a multiple of 128 (GPT-2's 50257 in rows of 50304), so that every row starts 256-byte
/// aligned (the classifier's 128-bit accesses, cuBLASLt's aligned leading dimensions) whatever V
/// is. The matmuls and the classifier below never read the padding.
constexpr std::int64_t logits_stride(std::int64_t V) { return (V + 127) / 128 * 128; }

/// Softmax cross-entropy over logits (N,V) against targets (N) i32 -> losses (N); with
/// dlogits_scale > 0 the logits become their gradient times that scale. Returns the loss sum
/// (on a GPU, waiting for it); or, given `loss_sum` (a DeviceSum on the logits' device), adds the
/// sum there without waiting and returns 0.
/// The padded vocabulary: every classifier op takes logits (N,ld) of which only the first
/// `columns` (all of them for -1) are the vocabulary; the rest of each row is padding (whatever a
/// matmul into (N,ld) left there), never read, and set to 0 where the gradient is written.
double fused_classifier(const Tensor& logits, const Tensor& losses, const Tensor& targets, float dlogits_scale,
                        DeviceSum* loss_sum = nullptr, std::int64_t columns = -1);

/// fused_classifier with the vocabulary split over the ranks of a tensor group: logits (N,Vl)
/// are columns [vocab_begin, vocab_begin + Vl) of the vocabulary, f32 or bf16; row_max, sum_exp,
/// target_logit and losses (N) are f32; targets (N) i32 hold full-vocabulary ids. Between the
/// steps the caller all-reduces over the group: the max of row_max after step 1, the sums of
/// sum_exp and target_logit after step 2. With one rank (vocab_begin 0, Vl = V) the steps give
/// fused_classifier's losses and gradient to rounding.
/// 1. row_max = each row's local max.
void classifier_row_max(const Tensor& row_max, const Tensor& logits, std::int64_t columns = -1);
/// 2. sum_exp = the local sum of exp(logit - row_max) (row_max global); target_logit = the target's
///    logit where this rank holds it, else 0 (NaN for a negative target, on every rank).
void classifier_row_stats(const Tensor& sum_exp, const Tensor& target_logit, const Tensor& logits,
                          const Tensor& row_max, const Tensor& targets, std::int64_t vocab_begin,
                          std::int64_t columns = -1);
/// 3. losses = log(sum_exp) + row_max - target_logit (global statistics); with dlogits_scale > 0
///    the local logits become their gradient (softmax - onehot) times that scale. Returns the loss
///    sum, the same on every rank, or adds it into `loss_sum` as fused_classifier.
double classifier_parallel_finish(const Tensor& logits, const Tensor& losses, const Tensor& row_max,
                                  const Tensor& sum_exp, const Tensor& target_logit, const Tensor& targets,
                                  std::int64_t vocab_begin, float dlogits_scale, DeviceSum* loss_sum = nullptr,
                                  std::int64_t columns = -1);

/// out = in, converting f32 -> bf16 (round to nearest even) or bf16 -> f32; same element count.
void convert(const Tensor& out, const Tensor& in);

/// Sum of squares of all elements (for the global gradient norm), in double; or, given `into`
/// (on x's device), added there without waiting, returning 0.
double sum_squares(const Tensor& x, DeviceSum* into = nullptr);

struct AdamWParams {
  float lr, beta1, beta2, eps, weight_decay;
  int step;          // 1-based, for the bias correction
  float grad_scale;  // applied to the gradient first (clipping)
};
/// One AdamW step on param with grad, m, v (all the same size, f32).
void adamw_update(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const AdamWParams& p);

/// A run of elements [offset, offset + length) of the weights and gradients an AdamW update
/// covers, whose moments lie at [state, state + length) of m and v (state -1: at offset, where the
/// moments are laid out like the weights; an optimizer that keeps moments for some elements only
/// lays them end to end).
struct AdamWRun {
  std::int64_t offset = 0, length = 0;
  bool decay = false;  // weight decay applies (2-D parameters)
  std::int64_t state = -1;
};
/// The runs of a multi-tensor AdamW update, laid out once for the device that runs them: on a GPU
/// a table of work chunks (one thread block each) in device memory, so that every update is one
/// launch with no host-to-device copy.
class AdamWPlan {
 public:
  AdamWPlan() = default;
  /// Runs must not overlap, in the weights nor in the moments; empty ones are dropped. Each run's
  /// `state` is resolved (never -1 here).
  AdamWPlan(const std::vector<AdamWRun>& runs, Device device);
  const std::vector<AdamWRun>& runs() const { return runs_; }
  Device device() const { return device_; }
  /// One past the last element any run covers: the weights and gradients must hold at least this
  /// many, m and v at least state_extent().
  std::int64_t extent() const { return extent_; }
  std::int64_t state_extent() const { return state_extent_; }
  std::int64_t chunks() const { return chunks_; }
  const void* chunk_table() const { return table_.data(); }  // device memory (CUDA plans)

 private:
  std::vector<AdamWRun> runs_;
  Device device_ = Device::cpu;
  std::int64_t extent_ = 0, state_extent_ = 0, chunks_ = 0;
  Buffer table_;
};
/// One AdamW step on every run of `plan` at once (one kernel launch on the GPU): param, grad (N,)
/// and m, v (M,) f32 (each run's moments at its `state`) as adamw_update on each run, with
/// p.weight_decay on the decayed runs and none on the others. `working` (N,) bf16, when it has data, receives the updated weights of the runs
/// rounded to bf16 (to nearest even, as convert), in the same pass: the working copy of mixed
/// precision. Elements outside the runs are not touched.
void adamw_update_runs(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                       const Tensor& working, const AdamWPlan& plan, const AdamWParams& p);

}  // namespace llmtrain::ops
