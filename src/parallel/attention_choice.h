// model.attention resolved once, at start-up, into the kernels the model runs (ops::AttentionKernels):
// "auto" becomes cuDNN's fused attention where this build has cuDNN, the device is a GPU, the
// precision is bf16 and cuDNN accepts both graphs (forward, backward) for the run's shape, else our
// flash attention; an explicit "cudnn" that cuDNN refuses is an InputError then, not a failure at
// the first step. What cuDNN says comes through CudnnAttentionProbe, so that tests can answer
// for it without a GPU.
#pragma once

#include <memory>
#include <string>

#include "config/config.h"
#include "core/tensor.h"
#include "ops/ops.h"

namespace llmtrain::parallel {

/// The shape of one attention call: B sequences of T positions, NH query heads and NKV key/value
/// heads of size C / NH.
struct AttentionShape {
  int B = 0, T = 0, C = 0, NH = 0, NKV = 0;
  /// "B=8 T=1024 C=768 NH=12 NKV=12 (head size 64)".
  std::string describe() const;
};

/// The shape one rank's attention calls have in a training run: (train.micro_batch_size,
/// model.context_length, model.d_model, model.n_head, model.n_kv_head), the last three divided by
/// dist.tensor_parallel (its own heads; one key/value head where tp does not divide n_kv_head).
/// Evaluation during the run uses the same.
AttentionShape attention_shape(const config::Config& config);

/// What cuDNN says about its fused attention in this process.
class CudnnAttentionProbe {
 public:
  virtual ~CudnnAttentionProbe() = default;
  /// Whether this build has cuDNN and it can run on this process's GPU; else why not.
  virtual bool available(std::string* why_not) = 0;
  /// Whether cuDNN accepts both graphs at `shape` (and keeps their plans); else cuDNN's reason.
  virtual bool accepts(const AttentionShape& shape, std::string* why_not) = 0;
  /// The library's version, for the log ("9.10.2").
  virtual std::string version() = 0;
};

/// The probe that asks this build's cuDNN (ops::cudnn_attention_*); on the current GPU, so select
/// it first.
std::unique_ptr<CudnnAttentionProbe> make_cudnn_probe();

/// The resolved choice and why it was made.
struct AttentionChoice {
  ops::AttentionKernels kernels = ops::AttentionKernels::flash;
  std::string reason;  // "bf16, cuDNN 9.10.2 accepts B=8 T=1024 ..."
  /// The log line: "attention: cudnn (bf16, cuDNN 9.10.2 accepts B=8 T=1024 ...)".
  std::string describe() const;
};

/// Resolves config.model.attention for a run on `device`. On the CPU the reference computes
/// attention whatever the choice: "auto" gives flash and the probe is not asked. On a GPU,
/// "flash" is kept, and "auto" and "cudnn" ask the probe (bf16 only: "auto" in fp32 gives flash,
/// and the config loader rejects "cudnn" with fp32). Throws InputError, naming the shape and
/// cuDNN's reason, for a "cudnn" that cuDNN cannot run.
AttentionChoice resolve_attention(const config::Config& config, Device device, CudnnAttentionProbe& probe);

}  // namespace llmtrain::parallel
