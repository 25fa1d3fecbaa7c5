#include "config/arch_traits.h"

#include <string>

#include "core/error.h"

namespace llmtrain::config {
namespace {

constexpr ArchTraits gpt2{
    Arch::gpt2, Norm::layernorm, Positions::learned, Mlp::gelu,
    /*biases=*/true, /*grouped_query_attention=*/false, /*untied_head=*/false, /*tied_by_default=*/true,
    /*head_norms=*/false,
};

constexpr ArchTraits llama{
    Arch::llama, Norm::rmsnorm, Positions::rotary, Mlp::swiglu,
    /*biases=*/false, /*grouped_query_attention=*/true, /*untied_head=*/true, /*tied_by_default=*/false,
    /*head_norms=*/true,
};

}  // namespace

const ArchTraits& arch_traits(Arch arch) {
  switch (arch) {
    case Arch::gpt2: return gpt2;
    case Arch::llama: return llama;
  }
  throw RuntimeError("model.arch: no traits for value " + std::to_string(int(arch)));
}

std::int64_t default_ffn_hidden(const ArchTraits& traits, std::int64_t d_model) {
  return traits.mlp == Mlp::gelu ? 4 * d_model : (8 * d_model / 3 + 255) / 256 * 256;
}

int norm_params_per_channel(const ArchTraits& traits) { return traits.norm == Norm::layernorm ? 2 : 1; }

bool head_is_tied(const ArchTraits& traits, bool tie_embeddings) { return !traits.untied_head || tie_embeddings; }

}  // namespace llmtrain::config
