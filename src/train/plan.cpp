#include "train/plan.h"

namespace llmtrain::train {

std::int64_t parameter_count(const config::ModelConfig& m) {
  const std::int64_t C = m.d_model, F = m.ffn_hidden;
  if (m.arch == "llama") {
    const std::int64_t HS = C / m.n_head, q = m.n_head * HS, kv = m.n_kv_head * HS;
    const std::int64_t per_layer = 2 * C                 // input and post-attention RMSNorm
                                   + (q + 2 * kv) * C    // q, k, v projections
                                   + C * q               // o projection
                                   + 3 * F * C;          // gate, up, down
    return m.vocab_size * C * (m.tie_embeddings ? 1 : 2) + m.n_layer * per_layer + C;
  }
  const std::int64_t per_layer = 2 * 2 * C              // ln_1, ln_2
                                 + 3 * C * C + 3 * C    // qkv
                                 + C * C + C            // attention projection
                                 + F * C + F + C * F + C;  // MLP
  return m.vocab_size * C + m.context_length * C + m.n_layer * per_layer + 2 * C;
}

double flops_per_token(const config::ModelConfig& m) {
  const double head_size = double(m.d_model) / double(m.n_head);
  return 6.0 * double(parameter_count(m)) +
         12.0 * double(m.n_layer) * double(m.n_head) * head_size * double(m.context_length);
}

namespace {

// Elements per token of Llama::bind_acts's layout, for the recompute mode.
std::int64_t llama_elements_per_token(const config::ModelConfig& m, const std::string& recompute) {
  const std::int64_t C = m.d_model, F = m.ffn_hidden, NH = m.n_head, L = m.n_layer;
  const std::int64_t QKV = (NH + 2 * m.n_kv_head) * (C / NH);
  const std::int64_t attention_block = 4 * C + 2 + QKV + NH;  // ln1, atty, residual2, ln2, 2 rstd, qkvr, log-sum-exp
  const std::int64_t mlp_block = 3 * F;                           // gate, up, SwiGLU output
  std::int64_t layers = 0, shared = QKV + 2 * C;                   // pre-rotation qkv, two branch outputs
  if (recompute == "full") {
    layers = L * C;
    shared += attention_block + mlp_block;
  } else if (recompute == "mlp") {
    layers = L * (attention_block + C);
    shared += mlp_block;
  } else {
    layers = L * (attention_block + mlp_block + C);
  }
  const std::int64_t head = C + 1 + m.vocab_size + 1;                 // lnf, rstd, logits, loss
  const std::int64_t gradients = 2 * C + 3 * C + 2 * QKV + 3 * F;    // residual, lnf; one layer's scratch
  return C + layers + shared + head + gradients;
}

// Elements per token of Gpt2::bind_acts's layout, for the recompute mode.
std::int64_t gpt2_elements_per_token(const config::ModelConfig& m, const std::string& recompute) {
  const std::int64_t C = m.d_model, F = m.ffn_hidden, NH = m.n_head, L = m.n_layer;
  // ln1, qkv (3C), atty, residual2, ln2, two means, two rstds, log-sum-exp.
  const std::int64_t attention_block = 7 * C + 4 + NH;
  const std::int64_t mlp_block = 2 * F;  // c_fc output and its GELU
  std::int64_t layers = 0, shared = 2 * C;  // the two branch outputs
  if (recompute == "full") {
    layers = L * C;
    shared += attention_block + mlp_block;
  } else if (recompute == "mlp") {
    layers = L * (attention_block + C);
    shared += mlp_block;
  } else {
    layers = L * (attention_block + mlp_block + C);
  }
  const std::int64_t head = C + 2 + m.vocab_size + 1;           // lnf, mean, rstd, logits, loss
  const std::int64_t gradients = 2 * C + 6 * C + 2 * F;         // residual, lnf; one layer's scratch
  return C + layers + shared + head + gradients;
}

}  // namespace

std::int64_t activation_bytes_per_sequence(const config::ModelConfig& m, bool bf16, const std::string& recompute) {
  const std::int64_t element = bf16 ? 2 : 4;
  const std::int64_t per_token = m.arch == "llama" ? llama_elements_per_token(m, recompute)
                                                   : gpt2_elements_per_token(m, recompute);
  return m.context_length * (per_token * element + 2 * 4);  // and the 4-byte inputs and targets
}

MemoryPlan plan_memory(const config::Config& config, int world_size, int zero_stage, bool bf16,
                       std::int64_t micro_batch) {
  const std::int64_t P = parameter_count(config.model);
  const std::int64_t shard = (P + world_size - 1) / world_size;
  MemoryPlan plan;
  // Every rank keeps the f32 master weights (and, in bf16, a 2-byte working copy) and f32
  // gradients; ZeRO 1 shards AdamW's m and v, ZeRO 2 the gradients too.
  plan.weights = (bf16 ? 4 + 2 : 4) * P;
  plan.gradients = 4 * (zero_stage >= 2 ? shard : P);
  plan.optimizer = 8 * (zero_stage >= 1 ? shard : P);
  plan.activations = micro_batch * activation_bytes_per_sequence(config.model, bf16, config.train.recompute);
  return plan;
}

}  // namespace llmtrain::train
