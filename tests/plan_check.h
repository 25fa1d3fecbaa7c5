// Shared by the plan tests: the small models whose plans they count by hand.
#pragma once

#include <cstdint>

#include "config/config.h"

namespace llmtrain::test {
// A Llama small enough to count by hand: vocab 11, d_model 4, 2 heads of size 2 sharing 1
// key/value head, SwiGLU 6, 3 layers, untied head.
//   root before the layers: lm_head 11 x 4 = 44, final norm 4            -> 48
//   each layer: 2 norms 8, q 4 x 4 = 16, k 2 x 4 = 8, v 8, o 16,
//               gate, up and down 6 x 4 = 24 each                         -> 128
//   root after the layers: embed_tokens 11 x 4                           -> 44
//   P = 48 + 3 x 128 + 44 = 476
inline config::ModelConfig shape(config::Arch arch, std::int64_t vocab, std::int64_t context, std::int64_t layers,
                          std::int64_t heads, std::int64_t kv_heads, std::int64_t d_model, std::int64_t ffn, bool tied) {
  config::ModelConfig m;
  m.arch = arch;
  m.vocab_size = vocab;
  m.context_length = context;
  m.n_layer = layers;
  m.n_head = heads;
  m.n_kv_head = kv_heads;
  m.d_model = d_model;
  m.ffn_hidden = ffn;
  m.tie_embeddings = tied;
  return m;
}

inline config::Config tiny_llama() {
  config::Config c;
  c.model = shape(config::Arch::llama, 11, 8, 3, 2, 1, 4, 6, false);
  c.train.micro_batch_size = 2;
  c.train.global_batch_size = 12;
  return c;
}

// The GPT-2 and Llama of the tensor-parallel test runs: vocab 251 (uneven over 2 and 4 ranks),
// context 32, 3 layers, 4 heads, d_model 32; GPT-2's ffn 128, Llama's 40 with `kv` key/value
// heads, untied.
inline config::Config tp_model(config::Arch arch, std::int64_t kv = 2) {
  config::Config c;
  c.model = arch == config::Arch::gpt2 ? shape(arch, 251, 32, 3, 4, 4, 32, 128, true)
                                       : shape(arch, 251, 32, 3, 4, kv, 32, 40, false);
  c.train.micro_batch_size = 2;
  c.train.global_batch_size = 8;
  return c;
}

// tests/mesh_equivalence_test.py's MoE model (4 layers, the first dense, d_model 32, 4 experts
// each token chooses top_k of, one shared expert), micro-batches of 2 sequences, 8 per update.
inline config::Config mesh_moe_config(std::int64_t top_k) {
  config::Config c;
  c.model = shape(config::Arch::llama, 251, 32, 4, 4, 2, 32, 40, false);
  c.model.moe.enabled = true;
  c.model.moe.experts = 4;
  c.model.moe.top_k = top_k;
  c.model.moe.ffn_hidden = 16;
  c.model.moe.shared_experts = 1;
  c.model.moe.shared_ffn_hidden = 16;
  c.model.moe.first_dense_layers = 1;
  c.train.micro_batch_size = 2;
  c.train.global_batch_size = 8;
  return c;
}

}  // namespace llmtrain::test
