// Causal self-attention through cuDNN's fused flash-attention engines (the cuDNN 9 backend graph
// API), bf16 only: an alternative to the bf16 kernels of flash_attention.h with the same packed
// layout and the same contract. CPU twins: cpu::flash_attention_forward/backward (kernels/include/llmtrain/kernels/cpu.h).
// qkv (B,T,(NH+2NKV)HS): NH query heads, then NKV key heads, then NKV value heads, each a
// contiguous HS slice; C = NH HS; query head h reads kv head h / (NH/NKV); NKV divides NH.
// lse (B,NH,T) is fp32, the natural-log log-sum-exp of each row's scores scaled by 1/sqrt(HS).
// cuDNN wants HS a multiple of 8 (as of 9.19 at most 128 on sm_80, 256 on sm_90) and every pointer
// 16-byte aligned; other shapes throw kernels::Error, as does every call in a build without cuDNN.
// Plans are built on the first call of each shape (B,T,C,NH,NKV) and kept. The first call of any of
// these functions makes the process's one cuDNN handle on the current device (select it first);
// calls from another device throw. All pointers are device memory. The backward is not
// deterministic (cuDNN accumulates dQ with atomics).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <string>

namespace llmtrain::cuda {

/// True when this build has cuDNN and it can run here (cuDNN 9.16 or newer, a device of compute
/// capability 8.0 or newer); else false, with the reason in *why_not when that is not null.
bool cudnn_attention_available(std::string* why_not);

/// True when cuDNN has engines for both graphs (forward and backward) of this shape: builds and
/// keeps their plans (the first time: seconds, for runtime-compiled engines); else false, with
/// cuDNN's reason in *why_not when that is not null.
bool cudnn_attention_supported(int B, int T, int C, int NH, int NKV, std::string* why_not);

/// out (B,T,C) and lse (B,NH,T) from qkv (B,T,(NH+2NKV)HS).
void cudnn_attention_forward(__nv_bfloat16* out, float* lse, const __nv_bfloat16* qkv, int B, int T, int C,
                             int NH, int NKV, cudaStream_t stream);

/// dqkv (B,T,(NH+2NKV)HS) += from dout (B,T,C), given the forward's qkv, out (B,T,C) and lse (B,NH,T).
/// !accumulate (dqkv's first writer): cuDNN writes dQ, dK and dV straight into dqkv. Otherwise it
/// writes them (bf16) into a stream-ordered scratch the size of dqkv, which a kernel then adds in
/// fp32 (so each element is rounded twice, where flash_attention_backward rounds once). Scratch
/// also holds cuDNN's workspace and an fp32 dQ accumulator of B NH T HS floats.
void cudnn_attention_backward(__nv_bfloat16* dqkv, const __nv_bfloat16* dout, const __nv_bfloat16* qkv,
                              const __nv_bfloat16* out, const float* lse, int B, int T, int C, int NH,
                              int NKV, bool accumulate, cudaStream_t stream);

}  // namespace llmtrain::cuda
