#include "parallel/parallel_context.h"

#include "parallel/context_parallel_comm.h"
#include "parallel/expert_parallel_comm.h"
#include "parallel/pipeline_stages.h"
#include "parallel/tensor_parallel_comm.h"

namespace llmtrain::parallel {

using dist::Axis;

ParallelContext::ParallelContext(const config::Config& config, const dist::Communicators& comms, Device device)
    : comms_(comms), device_(device) {
  layout_.external_storage = config.dist.zero_stage == 3;
  if (comms.host(Axis::tensor).world_size() > 1) {
    const auto& m = config.model;
    widths_ = std::make_unique<TensorParallel>(comms.host(Axis::tensor).rank(), comms.host(Axis::tensor).world_size(),
                                               config.dist.sequence_parallel, m, device,
                                               model::precision_dtype(config.train.precision));
    layout_.widths = widths_.get();
  }
  context_rank_ = comms.host(Axis::context).rank();
  context_size_ = comms.host(Axis::context).world_size();
  context_ring_ = config.dist.context_parallel_mode == config::ContextParallelMode::ring;
  if (comms.host(Axis::expert).world_size() > 1) {
    experts_ = std::make_unique<ExpertParallel>(comms.host(Axis::expert), comms.device(Axis::expert));
    layout_.experts = experts_.get();
  }
  const int stage = comms.host(Axis::pipeline).rank(), stages = comms.host(Axis::pipeline).world_size();
  if (stages > 1) layout_.layer_ranges = stage_layer_ranges(split_layers(config), stage, stages);
}

ParallelContext::~ParallelContext() = default;

bool ParallelContext::partial_model() const {
  return widths_ || experts_ || comms_.host(Axis::pipeline).world_size() > 1 ||
         layout_.external_storage;
}

void ParallelContext::attach(model::Model& model) {
  if (widths_) {
    tensor_ = std::make_unique<CommTensorGroup>(comms_.device(Axis::tensor), device_);
    widths_->set_group(tensor_.get());
  }
  if (context_size_ > 1) {
    context_ = std::make_unique<CommContextGroup>(comms_.device(Axis::context), comms_.host(Axis::context));
    sequences_ = std::make_unique<ContextAttention>(context_rank_, context_size_, context_ring_, device_,
                                                    model.compute_dtype());
    sequences_->set_group(context_.get());
    model.attach_sequences(sequences_.get());
  }
}

NormScope ParallelContext::norm_scope(const model::Model& model) const {
  NormScope norm;
  const bool tensor = comms_.host(Axis::tensor).world_size() > 1, pipeline = comms_.host(Axis::pipeline).world_size() > 1;
  const bool expert = comms_.host(Axis::expert).world_size() > 1;
  if (tensor || pipeline || expert) {
    norm.scoped = true;  // (an expert rank above 0 on a tensor rank above 0 counts nothing)
    norm.counted = norm_ranges(model);
  }
  if (tensor) norm.groups.push_back(&comms_.host(Axis::tensor));
  if (expert) norm.groups.push_back(&comms_.host(Axis::expert));
  if (pipeline) norm.groups.push_back(&comms_.host(Axis::pipeline));
  return norm;
}

ExpertScope ParallelContext::expert_scope(const model::Model& model) const {
  if (!experts_) return {};
  return {expert_shared_ranges(model.param_infos()), &comms_.device(Axis::expert)};
}

}  // namespace llmtrain::parallel
