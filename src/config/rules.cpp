#include "config/rules.h"

#include <string>

#include "config/arch_traits.h"
#include "core/error.h"

namespace llmtrain::config {

namespace {

// The rules between the pipeline's keys. Those that need the mesh (micro-batches per update at
// least dist.pipeline_parallel, and a multiple of it for "interleaved") are checked at start-up
// (train::pipeline_micro_batches).
void check_pipeline(const Config& c, const Origins& o) {
  const auto& d = c.dist;
  if (d.virtual_stages > 1 && d.pipeline_schedule != PipelineSchedule::interleaved) {
    fail_rule(o, "dist.virtual_stages", "dist.pipeline_schedule",
              "more than one model chunk per stage needs dist.pipeline_schedule \"interleaved\", got \"" +
                  to_string(d.pipeline_schedule) + "\"");
  }
  if (d.pipeline_schedule == PipelineSchedule::interleaved && d.virtual_stages < 2) {
    fail_rule(o, "dist.pipeline_schedule", "dist.virtual_stages",
              "\"interleaved\" needs dist.virtual_stages >= 2 model chunks per stage, got " +
                  std::to_string(d.virtual_stages) + " (with one chunk per stage, use \"1f1b\")");
  }
  if (d.pipeline_schedule == PipelineSchedule::zb1p) {
    // Its deferred weight gradients read the layers' kept inputs and a copy of their output
    // gradients: what recomputation, the sequence-parallel gathers and the other axes' layers do
    // not keep is not built for it (a key that stays at its default passes).
    const auto refuse = [&](const char* key, const std::string& value) {
      fail_rule(o, "dist.pipeline_schedule", key,
                "\"zb1p\" defers the linear layers' weight gradients, which is built for pipeline and data "
                "parallelism (any ZeRO stage the pipeline takes) without recomputation; " +
                    std::string(key) + " is " + value);
    };
    if (c.train.recompute != Recompute::none) refuse("train.recompute", "\"" + to_string(c.train.recompute) + "\"");
    if (d.tensor_parallel > 1) refuse("dist.tensor_parallel", std::to_string(d.tensor_parallel));
    if (d.context_parallel > 1) refuse("dist.context_parallel", std::to_string(d.context_parallel));
    if (d.expert_parallel > 1) refuse("dist.expert_parallel", std::to_string(d.expert_parallel));
  }
  const std::int64_t stages = d.pipeline_parallel * d.virtual_stages;
  const std::string stages_text = "dist.pipeline_parallel x dist.virtual_stages = " + std::to_string(d.pipeline_parallel) +
                                  " x " + std::to_string(d.virtual_stages) + " = " + std::to_string(stages);
  if (stages > c.model.n_layer) {
    fail_rule(o, "dist.pipeline_parallel", "model.n_layer",
              "every stage needs at least one layer, but " + stages_text + " stages exceed model.n_layer (" +
                  std::to_string(c.model.n_layer) + ")");
  }
  if (d.pipeline_layers.empty()) return;
  if (std::int64_t(d.pipeline_layers.size()) != stages) {
    fail_rule(o, "dist.pipeline_layers", "dist.pipeline_parallel",
              "lists " + std::to_string(d.pipeline_layers.size()) + " stage(s), expected one per stage: " + stages_text);
  }
  std::int64_t sum = 0;
  for (const std::int64_t n : d.pipeline_layers) sum += n;
  if (sum != c.model.n_layer) {
    fail_rule(o, "dist.pipeline_layers", "model.n_layer",
              "adds up to " + std::to_string(sum) + " layers, expected model.n_layer (" +
                  std::to_string(c.model.n_layer) + ")");
  }
}

// Context parallelism cuts every sequence into 2 x dist.context_parallel chunks of equal length
// (rank r holds chunks r and 2 CP - 1 - r): the sequence length must divide evenly.
void check_context(const Config& c, const Origins& o) {
  const std::int64_t cp = c.dist.context_parallel, T = c.model.context_length;
  if (cp > 1 && T % (2 * cp) != 0) {
    fail_rule(o, "dist.context_parallel", "model.context_length",
              "each sequence is cut into 2 x dist.context_parallel = " + std::to_string(2 * cp) +
                  " chunks of equal length, so model.context_length (" + std::to_string(T) + ") must divide by " +
                  std::to_string(2 * cp));
  }
}

// The architecture's rules: its defaults, and what its layers cannot do.
void check_arch(ModelConfig& m, const Origins& o, bool tie_embeddings_given) {
  const ArchTraits& arch = arch_traits(m.arch);
  const std::string name = to_string(m.arch);
  if (!tie_embeddings_given) m.tie_embeddings = arch.tied_by_default;
  if (m.n_kv_head == 0) m.n_kv_head = m.n_head;
  if (m.ffn_hidden == 0) m.ffn_hidden = default_ffn_hidden(arch, m.d_model);
  if (m.d_model % m.n_head != 0) {
    fail_rule(o, "model.n_head", "model.d_model", "must divide model.d_model (" + std::to_string(m.d_model) + "), got " +
                                std::to_string(m.n_head));
  }
  if (m.n_kv_head > m.n_head || m.n_head % m.n_kv_head != 0) {
    fail_rule(o, "model.n_kv_head", "model.n_head", "must divide model.n_head (" + std::to_string(m.n_head) + "), got " +
                                   std::to_string(m.n_kv_head));
  }
  if (!arch.grouped_query_attention && m.n_kv_head != m.n_head) {
    fail_rule(o, "model.n_kv_head", "model.arch", name + " has no grouped-query attention: must equal model.n_head (" +
                                   std::to_string(m.n_head) + ") or be 0, got " + std::to_string(m.n_kv_head));
  }
  if (!arch.untied_head && !m.tie_embeddings) {
    fail_rule(o, "model.tie_embeddings", "model.arch",
              name + " always ties its output head to the token embedding: must be true");
  }
  if (m.qk_norm && !arch.head_norms) {
    fail_rule(o, "model.qk_norm", "model.arch", name + " has no per-head query and key norms: must be false");
  }
  if (arch.positions == Positions::rotary && (m.d_model / m.n_head) % 2 != 0) {
    fail_rule(o, "model.n_head", "model.d_model", name + "'s rotary embeddings need an even head size (d_model / n_head), got " +
                                std::to_string(m.d_model / m.n_head));
  }
}

// Mixture-of-Experts MLPs: the llama family's SwiGLU layers, on one rank, data parallel (ZeRO 0-3),
// expert parallel (dist.expert_parallel, out of the data ranks), tensor parallel (the MoE MLP whole
// on every tensor rank) and in a pipeline; context and sequence parallelism and recomputation are
// not built for them yet (docs/moe.md).
void check_moe(Config& c, const Origins& o) {
  MoeConfig& m = c.model.moe;
  const std::int64_t ep = c.dist.expert_parallel;
  if (!m.enabled) {
    if (ep > 1) {
      fail_rule(o, "dist.expert_parallel", "model.moe",
                "splits the experts of Mixture-of-Experts layers, and model.moe is not set (got " + std::to_string(ep) + ")");
    }
    return;
  }
  if (m.experts % ep != 0) {
    fail_rule(o, "dist.expert_parallel", "model.moe.experts",
              "must divide model.moe.experts (" + std::to_string(m.experts) + "), got " + std::to_string(ep));
  }
  if (arch_traits(c.model.arch).mlp != Mlp::swiglu) {
    fail_rule(o, "model.moe", "model.arch",
              "Mixture-of-Experts layers are built for the llama family, got model.arch \"" + to_string(c.model.arch) + "\"");
  }
  if (m.shared_ffn_hidden == 0) m.shared_ffn_hidden = m.ffn_hidden;
  if (m.first_dense_layers >= c.model.n_layer) {
    fail_rule(o, "model.moe.first_dense_layers", "model.n_layer",
              "must be < model.n_layer (" + std::to_string(c.model.n_layer) + "), got " +
                  std::to_string(m.first_dense_layers));
  }
  if (m.capacity_factor > 0 && c.dist.context_parallel > 1) {
    // An expert's capacity keeps the first slots in the micro-batch's token order, which spans the
    // context group's ranks.
    fail_rule(o, "model.moe.capacity_factor", "dist.context_parallel",
              "a capacity is not built for sequences split over ranks: model.moe.capacity_factor must be 0 (dropless) "
              "with dist.context_parallel " + std::to_string(c.dist.context_parallel));
  }
}

}  // namespace

void resolve_and_check(Config& c, const Origins& o, bool tie_embeddings_given) {
  auto& m = c.model;
  check_arch(m, o, tie_embeddings_given);
  const auto& t = c.train;
  if (m.attention == Attention::cudnn && t.precision != Precision::bf16) {
    fail_rule(o, "model.attention", "train.precision",
              "\"cudnn\" needs train.precision \"bf16\" (cuDNN's fused attention has no fp32 kernels), got \"" +
                  to_string(t.precision) + "\"");
  }
  if (t.global_batch_size % t.micro_batch_size != 0) {
    fail_rule(o, "train.global_batch_size", "train.micro_batch_size", "must be a multiple of train.micro_batch_size (" +
                                           std::to_string(t.micro_batch_size) + "), got " +
                                           std::to_string(t.global_batch_size));
  }
  check_pipeline(c, o);
  check_context(c, o);
  check_moe(c, o);
  if (c.optim.min_lr > c.optim.lr) {
    fail_rule(o, "optim.min_lr", "optim.lr", "must be <= optim.lr (" + format_number(c.optim.lr) + "), got " +
                                format_number(c.optim.min_lr));
  }
  if (c.optim.warmup_steps > t.max_steps) {
    fail_rule(o, "optim.warmup_steps", "train.max_steps", "must be <= train.max_steps (" + std::to_string(t.max_steps) + "), got " +
                                      std::to_string(c.optim.warmup_steps));
  }
}

std::int64_t grad_accum_steps(const Config& config, int data_parallel_size) {
  const auto& t = config.train;
  const std::int64_t per_micro_step = t.micro_batch_size * data_parallel_size;
  if (t.global_batch_size % per_micro_step != 0) {
    throw InputError("train.global_batch_size: must be a multiple of train.micro_batch_size x data-parallel size (" +
                     std::to_string(t.micro_batch_size) + " x " + std::to_string(data_parallel_size) + " = " +
                     std::to_string(per_micro_step) + "), got " + std::to_string(t.global_batch_size));
  }
  return t.global_batch_size / per_micro_step;
}

}  // namespace llmtrain::config
