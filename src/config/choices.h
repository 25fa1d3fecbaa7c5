// The config keys that choose among a fixed list of names (model.arch, model.attention,
// train.precision, train.recompute, dist.pipeline_schedule), as enums. The config loader parses each name once; code
// below it compares enums, and to_string() gives back the name the JSON config spells (for the
// resolved config and for messages).
#pragma once

#include <array>
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

namespace llmtrain::config {

/// model.arch: GPT-2 or Llama (model::ArchSpec says what each one builds).
enum class Arch { gpt2, llama };
/// model.attention: the GPU's attention kernels. `automatic` (spelled "auto") is resolved once at
/// start-up, for the run's device, precision and shape, into flash or cudnn
/// (parallel/attention_choice.h); the ops see only that resolved choice (ops::AttentionKernels).
enum class Attention { automatic, flash, cudnn };
/// train.precision: fp32, or bf16 mixed precision.
enum class Precision { fp32, bf16 };
/// train.recompute: which activations backward recomputes instead of keeping from forward.
enum class Recompute { none, mlp, full };
/// dist.pipeline_schedule: the order of forward and backward micro-batches on each pipeline stage
/// (parallel/pipeline_schedule.h): one-forward-one-backward, Megatron's interleaved variant with
/// dist.virtual_stages model chunks per stage, or zero-bubble's ZB-H1 (1F1B with each backward
/// split into input and weight gradients, the weight gradients deferred into the bubbles).
enum class PipelineSchedule { one_f_one_b, interleaved, zb1p };
/// dist.context_parallel_mode: how a context-parallel group shares keys and values (parallel/context_attention.h):
/// passed around a ring (one block in flight while the next computes), or all-gathered at once.
enum class ContextParallelMode { ring, allgather };

/// The names of a choice's values, in the order the enum declares them.
template <class E>
struct ChoiceNames;
template <>
struct ChoiceNames<Arch> {
  static constexpr std::array<std::string_view, 2> values{"gpt2", "llama"};
};
template <>
struct ChoiceNames<Attention> {
  static constexpr std::array<std::string_view, 3> values{"auto", "flash", "cudnn"};
};
template <>
struct ChoiceNames<Precision> {
  static constexpr std::array<std::string_view, 2> values{"fp32", "bf16"};
};
template <>
struct ChoiceNames<Recompute> {
  static constexpr std::array<std::string_view, 3> values{"none", "mlp", "full"};
};
template <>
struct ChoiceNames<PipelineSchedule> {
  static constexpr std::array<std::string_view, 3> values{"1f1b", "interleaved", "zb1p"};
};
template <>
struct ChoiceNames<ContextParallelMode> {
  static constexpr std::array<std::string_view, 2> values{"ring", "allgather"};
};

/// An enum the config reads by name.
template <class E>
concept Choice = requires { ChoiceNames<E>::values; };

/// The name the config spells: to_string(Arch::llama) == "llama".
template <Choice E>
std::string to_string(E value) {
  return std::string(ChoiceNames<E>::values[std::size_t(value)]);
}

/// The value named `name`; nullopt for a name not in the list.
template <Choice E>
std::optional<E> parse_choice(std::string_view name) {
  const auto& names = ChoiceNames<E>::values;
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (names[i] == name) return E(i);
  }
  return std::nullopt;
}

}  // namespace llmtrain::config
