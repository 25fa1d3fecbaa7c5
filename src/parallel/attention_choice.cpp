#include "parallel/attention_choice.h"

#include <algorithm>
#include <cstdint>
#include <string>

#include "core/error.h"

namespace llmtrain::parallel {
namespace {

// cuDNN's messages can span lines; an error message and a log line are one line each.
std::string one_line(std::string text) {
  std::replace(text.begin(), text.end(), '\n', ' ');
  return text;
}

// ops::cudnn_attention_*, as a probe.
class CudnnLibraryProbe final : public CudnnAttentionProbe {
 public:
  bool available(std::string* why_not) override { return ops::cudnn_attention_available(why_not); }
  bool accepts(const AttentionShape& s, std::string* why_not) override {
    return ops::cudnn_attention_supported(s.B, s.T, s.C, s.NH, s.NKV, why_not);
  }
  std::string version() override { return ops::cudnn_version(); }
};

}  // namespace

std::string AttentionShape::describe() const {
  return "B=" + std::to_string(B) + " T=" + std::to_string(T) + " C=" + std::to_string(C) +
         " NH=" + std::to_string(NH) + " NKV=" + std::to_string(NKV) +
         " (head size " + std::to_string(NH > 0 ? C / NH : 0) + ")";
}

AttentionShape attention_shape(const config::Config& config) {
  const auto& m = config.model;
  // Under tensor parallelism each rank runs its own heads: NH / tp query heads of the same size,
  // NKV / tp key/value heads (one, replicated, where tp does not divide NKV), as the models bind them.
  const std::int64_t tp = std::max<std::int64_t>(1, config.dist.tensor_parallel);
  const std::int64_t NKV = m.n_kv_head > 0 ? m.n_kv_head : m.n_head, NH = m.n_head / tp;
  return {int(config.train.micro_batch_size), int(m.context_length), int(NH * (m.d_model / m.n_head)), int(NH),
          int(NKV % tp == 0 ? NKV / tp : 1)};
}

std::unique_ptr<CudnnAttentionProbe> make_cudnn_probe() { return std::make_unique<CudnnLibraryProbe>(); }

std::string AttentionChoice::describe() const {
  return std::string("attention: ") + (kernels == ops::AttentionKernels::cudnn ? "cudnn" : "flash") + " (" +
         reason + ")";
}

AttentionChoice resolve_attention(const config::Config& config, Device device, CudnnAttentionProbe& probe) {
  using config::Attention;
  using ops::AttentionKernels;
  const Attention asked = config.model.attention;
  if (device == Device::cpu) {
    // The CPU reference serves both choices; "cudnn" is kept so that a CPU run reads as configured.
    if (asked == Attention::cudnn) return {AttentionKernels::cudnn, "as configured; on the CPU the reference computes it"};
    return {AttentionKernels::flash, "CPU: the reference computes attention for either choice"};
  }
  if (asked == Attention::flash) return {AttentionKernels::flash, "as configured"};
  const bool bf16 = config.train.precision == config::Precision::bf16;
  if (!bf16) {  // "cudnn" with fp32 never gets here: the config loader rejects it
    return {AttentionKernels::flash, "fp32: cuDNN's fused attention needs train.precision \"bf16\""};
  }
  // cuDNN's graph takes a plain causal mask over whole sequences: not the offset masks of context
  // parallelism's blocks (queries against keys at other positions), nor a document mask.
  if (config.dist.context_parallel > 1 || config.data.document_mask) {
    const std::string what = config.dist.context_parallel > 1
                                 ? "the context-parallel blocks' offset causal masks (dist.context_parallel " +
                                       std::to_string(config.dist.context_parallel) + ")"
                                 : std::string("document masks (data.document_mask)");
    if (asked == Attention::cudnn) {
      throw InputError("model.attention: \"cudnn\" cannot take " + what + "; use \"auto\" or \"flash\"");
    }
    return {AttentionKernels::flash, "bf16, but cuDNN cannot take " + what};
  }
  const AttentionShape shape = attention_shape(config);
  std::string why;
  if (!probe.available(&why)) {
    if (asked == Attention::cudnn) {
      throw InputError("model.attention: \"cudnn\" cannot run here (" + shape.describe() + "): " + one_line(why) +
                       "; use \"auto\" or \"flash\"");
    }
    return {AttentionKernels::flash, "bf16, but " + one_line(why)};
  }
  if (!probe.accepts(shape, &why)) {
    if (asked == Attention::cudnn) {
      throw InputError("model.attention: \"cudnn\": cuDNN " + probe.version() + " refuses " + shape.describe() +
                       ": " + one_line(why) + "; use \"auto\" or \"flash\"");
    }
    return {AttentionKernels::flash, "bf16, but cuDNN " + probe.version() + " refuses " + shape.describe() + ": " +
                                         one_line(why)};
  }
  return {AttentionKernels::cudnn, std::string(asked == Attention::cudnn ? "as configured" : "bf16") + ", cuDNN " +
                                       probe.version() + " accepts " + shape.describe()};
}

}  // namespace llmtrain::parallel
