// Causal flash attention (fp32), memory-lean: the forward saves the log-sum-exp of each row's
// scaled scores instead of the (B,NH,T,T) probabilities; the backward recomputes them.
// CPU twins: cpu::flash_attention_forward/backward (src/ops/cpu/nn.h), same arguments plus a stream.
// qkv (B,T,(NH+2NKV)HS): NH query heads, then NKV key heads, then NKV value heads, each a
// contiguous HS slice; C = NH HS; query head h reads kv head h / (NH/NKV); NKV divides NH.
// Head sizes 16, 32, 64 and 128; others throw RuntimeError. All pointers are device memory.
#pragma once

#include <cuda_runtime_api.h>

namespace llmtrain::cuda {

/// out (B,T,C), lse (B,NH,T) from qkv (B,T,(NH+2NKV)HS).
void flash_attention_forward(float* out, float* lse, const float* qkv, int B, int T, int C, int NH, int NKV,
                             cudaStream_t stream);

/// dqkv (B,T,(NH+2NKV)HS) += from dout (B,T,C), given the forward's qkv, out (B,T,C) and lse (B,NH,T).
/// Deterministic (no atomics). Uses a stream-ordered scratch of B NH T floats.
void flash_attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out,
                              const float* lse, int B, int T, int C, int NH, int NKV, cudaStream_t stream);

}  // namespace llmtrain::cuda
