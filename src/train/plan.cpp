#include "train/plan.h"

#include "model/arch.h"

namespace llmtrain::train {

std::int64_t parameter_count(const config::ModelConfig& m) { return model::arch_spec(m.arch).parameter_count(m); }

double flops_per_token(const config::ModelConfig& m) {
  const double head_size = double(m.d_model) / double(m.n_head);
  return 6.0 * double(parameter_count(m)) +
         12.0 * double(m.n_layer) * double(m.n_head) * head_size * double(m.context_length);
}

std::int64_t activation_bytes_per_sequence(const config::ModelConfig& m, bool bf16, config::Recompute recompute) {
  const DType compute = bf16 ? DType::bf16 : DType::f32;
  return std::int64_t(model::arch_spec(m.arch).activation_bytes(m, recompute, compute, 1, int(m.context_length)));
}

MemoryPlan plan_memory(const config::Config& config, int data_parallel_size, int zero_stage, bool bf16,
                       std::int64_t micro_batch) {
  const std::int64_t P = parameter_count(config.model);
  const std::int64_t shard = (P + data_parallel_size - 1) / data_parallel_size;
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
