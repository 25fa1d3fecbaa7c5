// Causal flash attention (fp32; and bf16 storage with fp32 arithmetic), memory-lean: the forward
// saves the log-sum-exp of each row's scaled scores instead of the (B,NH,T,T) probabilities; the
// backward recomputes them.
// CPU twins: cpu::flash_attention_forward/backward (llmtrain/kernels/cpu.h), same arguments plus a
// stream.
// qkv (B,T,(NH+2NKV)HS): NH query heads, then NKV key heads, then NKV value heads, each a
// contiguous HS slice; C = NH HS; query head h reads kv head h / (NH/NKV); NKV divides NH.
// Head sizes 16, 32, 64 and 128; others throw kernels::Error. All pointers are device memory.
// The bf16 kernels read and write bf16 activations and gradients; lse stays fp32. For head sizes
// 64 and 128 with 16-byte aligned tensors they run on tensor cores (mma.sync: bf16 products with
// fp32 accumulation, P and dS rounded to bf16 as matrix operands; softmax in fp32); otherwise, and
// for fp32, every product, sum and exponential is fp32 on CUDA cores (tiles staged as fp32).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

namespace llmtrain::cuda {

/// The 16-bit storage type of mixed precision (declared, identically, in cuda.h).
using bf16 = __nv_bfloat16;

/// out (B,T,C), lse (B,NH,T) from qkv (B,T,(NH+2NKV)HS); Act is float or bf16 (lse is fp32).
template <class Act>
void flash_attention_forward(Act* out, float* lse, const Act* qkv, int B, int T, int C, int NH, int NKV,
                             cudaStream_t stream);

/// dqkv (B,T,(NH+2NKV)HS) += from dout (B,T,C), given the forward's qkv, out (B,T,C) and lse (B,NH,T);
/// !accumulate (dqkv's first writer): dqkv is zeroed on the stream first, so what it held does not
/// count. Uses a stream-ordered scratch of B NH T floats. bf16: each element of dqkv is read, added
/// to in fp32 and rounded once. Deterministic (no atomics), unless set_flash_attention_deterministic
/// (false) chose the single pass for the bf16 tensor-core kernels.
template <class Act>
void flash_attention_backward(Act* dqkv, const Act* dout, const Act* qkv, const Act* out, const float* lse, int B,
                              int T, int C, int NH, int NKV, bool accumulate, cudaStream_t stream);

/// Chooses the backward of the bf16 tensor-core kernels (head sizes 64 and 128; see
/// flash_attention_uses_tensor_cores). true (the default): deterministic, two kernels (dK/dV, then
/// dQ), bitwise the same run after run. false: one pass that computes S and dP once and adds dQ
/// with fp32 atomics in an order that varies run to run, so dQ does too (within rounding); it needs
/// a further stream-ordered scratch of B T NH HS floats. Process-wide, like set_matmul_tf32; the
/// trainer sets it from train.deterministic. The fp32 and CUDA-core kernels are always deterministic.
void set_flash_attention_deterministic(bool deterministic);
bool flash_attention_deterministic();

/// Whether the bf16 kernels take the tensor-core path (mma.sync, ldmatrix, cp.async) for this
/// head size and these tensors: head sizes 64 and 128, qkv and out (forward) or qkv, out, dout
/// and dqkv (backward) 16-byte aligned. Otherwise the CUDA-core kernels run.
bool flash_attention_uses_tensor_cores(int head_size, const void* qkv, const void* out);

}  // namespace llmtrain::cuda
