#include "model/model.h"

#include "core/error.h"
#include "core/rng.h"
#include "model/arch.h"
#include "ops/ops.h"

namespace llmtrain::model {

DType precision_dtype(config::Precision precision) {
  return precision == config::Precision::bf16 ? DType::bf16 : DType::f32;
}

Model::Model(const config::ModelConfig& config, Device device, DType compute, ops::AttentionKernels attention)
    : config_(config),
      device_(device),
      compute_(compute),
      attention_kernels_(attention) {
  if (compute != DType::f32 && compute != DType::bf16) throw RuntimeError("model: compute dtype must be f32 or bf16");
}

void Model::add_param(const std::string& name, std::vector<std::int64_t> shape) {
  ParamInfo info{name, std::move(shape), num_params_, 1, false};
  for (const auto d : info.shape) info.numel *= d;
  info.decay = info.shape.size() == 2;
  num_params_ += info.numel;
  infos_.push_back(std::move(info));
}

void Model::allocate() {
  params_ = ops::Buffer(device_, std::size_t(num_params_) * sizeof(float));
  // On the CPU the gradients come zeroed from the OS and take memory only once backward writes
  // them: a model loaded for export, eval or generate holds its weights alone (GPT-2 124M's
  // export peaked at 1.47 GB with them zeroed here).
  const std::size_t grad_bytes = std::size_t(num_params_) * sizeof(float);
  grads_ = device_ == Device::cpu ? ops::Buffer::zeroed_cpu(grad_bytes) : ops::Buffer(device_, grad_bytes);
  if (compute_ == DType::bf16) working_ = ops::Buffer(device_, std::size_t(num_params_) * dtype_size(DType::bf16));
  if (device_ != Device::cpu) zero_grads();
}

void Model::prepare_weights() {
  if (compute_ == DType::bf16) ops::convert(working_.view(DType::bf16, {num_params_}), params());
}

Tensor Model::as_f32(const Tensor& t, ops::Buffer& scratch) const {
  if (t.dtype == DType::f32) return t;
  if (scratch.bytes() < std::size_t(t.numel()) * sizeof(float)) {
    scratch = ops::Buffer(device_, std::size_t(t.numel()) * sizeof(float));
  }
  Tensor wide = t;
  wide.data = scratch.data();
  wide.dtype = DType::f32;
  ops::convert(wide, t);
  return wide;
}

const ParamInfo& Model::param_info(const std::string& name) const {
  for (const auto& info : infos_) {
    if (info.name == name) return info;
  }
  throw RuntimeError("model: no parameter named " + name);
}

namespace {

Tensor shaped(void* data, DType dtype, Device device, const std::vector<std::int64_t>& shape) {
  Tensor t(data, dtype, device, {});
  t.ndim = int(shape.size());
  for (int i = 0; i < t.ndim; ++i) t.shape[std::size_t(i)] = shape[std::size_t(i)];
  return t;
}

}  // namespace

Tensor Model::param(const ParamInfo& info) const {
  return shaped(static_cast<float*>(params_.data()) + info.offset, DType::f32, device_, info.shape);
}

Tensor Model::grad(const ParamInfo& info) const {
  return shaped(static_cast<float*>(grads_.data()) + info.offset, DType::f32, device_, info.shape);
}

Tensor Model::weight(const ParamInfo& info) const {
  if (compute_ == DType::f32) return param(info);
  return shaped(static_cast<std::uint16_t*>(working_.data()) + info.offset, DType::bf16, device_, info.shape);
}

Tensor Model::param_named(const std::string& name, bool grads) const {
  const ParamInfo& info = param_info(name);
  return grads ? grad(info) : weight(info);
}

void Model::zero_grads() {
  if (num_params_ > 0) ops::zero(grads());
}

void Model::init_normal(const ParamInfo& info, std::uint64_t seed, float std) {
  if (device_ != Device::cpu) throw RuntimeError("model: initialise on the CPU, then copy");
  float* w = param(info).as<float>();
  for (std::int64_t i = 0; i < info.numel; ++i) w[i] = std * normal_at(seed, std::uint64_t(info.offset + i));
}

void Model::init_constant(const ParamInfo& info, float value) {
  if (device_ != Device::cpu) throw RuntimeError("model: initialise on the CPU, then copy");
  float* w = param(info).as<float>();
  for (std::int64_t i = 0; i < info.numel; ++i) w[i] = value;
}

std::unique_ptr<Model> make_model(const config::ModelConfig& config, Device device, Recompute recompute,
                                  DType compute, ops::AttentionKernels attention) {
  return arch_spec(config.arch).make(config, device, recompute, compute, attention);
}

}  // namespace llmtrain::model
