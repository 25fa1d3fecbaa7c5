#include "model/model.h"

#include "core/error.h"
#include "core/rng.h"
#include "model/arch.h"
#include "ops/ops.h"

namespace llmtrain::model {

DType precision_dtype(config::Precision precision) {
  return precision == config::Precision::bf16 ? DType::bf16 : DType::f32;
}

Model::Model(const config::ModelConfig& config, Device device, DType compute, ops::AttentionKernels attention,
             bool sharded)
    : config_(config),
      device_(device),
      compute_(compute),
      attention_kernels_(attention),
      sharded_(sharded) {
  if (compute != DType::f32 && compute != DType::bf16) throw RuntimeError("model: compute dtype must be f32 or bf16");
}

namespace {

// N of ".h.N." (GPT-2) or ".layers.N." (Llama) in a parameter's name; -1 when neither is there.
int layer_of(const std::string& name) {
  for (const std::string marker : {".h.", ".layers."}) {
    const std::size_t at = name.find(marker);
    if (at == std::string::npos) continue;
    const std::size_t digits = at + marker.size();
    const std::size_t end = name.find('.', digits);
    if (end == std::string::npos || end == digits) continue;
    return std::stoi(name.substr(digits, end - digits));
  }
  return -1;
}

}  // namespace

void Model::add_param(const std::string& name, std::vector<std::int64_t> shape) {
  ParamInfo info{name, std::move(shape), num_params_, 1, false};
  for (const auto d : info.shape) info.numel *= d;
  info.decay = info.shape.size() == 2;
  info.layer = layer_of(name);
  num_params_ += info.numel;
  infos_.push_back(std::move(info));
}

void Model::allocate() {
  // Units: maximal runs of consecutive parameters of one layer (or of none).
  for (auto& info : infos_) {
    if (units_.empty() || units_.back().layer != info.layer) units_.push_back({info.offset, info.offset, info.layer});
    units_.back().end = info.offset + info.numel;
    info.unit = units_.size() - 1;
  }
  unit_weights_.assign(units_.size(), nullptr);
  unit_grads_.assign(units_.size(), nullptr);
  if (sharded_) return;
  params_ = ops::Buffer(device_, std::size_t(num_params_) * sizeof(float));
  // On the CPU the gradients come zeroed from the OS and take memory only once backward writes
  // them: a model loaded for export, eval or generate holds its weights alone (GPT-2 124M's
  // export peaked at 1.47 GB with them zeroed here).
  const std::size_t grad_bytes = std::size_t(num_params_) * sizeof(float);
  grads_ = device_ == Device::cpu ? ops::Buffer::zeroed_cpu(grad_bytes) : ops::Buffer(device_, grad_bytes);
  if (compute_ == DType::bf16) working_ = ops::Buffer(device_, std::size_t(num_params_) * dtype_size(DType::bf16));
  if (device_ != Device::cpu) zero_grads();
  char* weights = static_cast<char*>(compute_ == DType::bf16 ? working_.data() : params_.data());
  for (std::size_t u = 0; u < units_.size(); ++u) {
    unit_weights_[u] = weights + std::size_t(units_[u].begin) * dtype_size(compute_);
    unit_grads_[u] = static_cast<float*>(grads_.data()) + units_[u].begin;
  }
}

void Model::set_unit_storage(std::size_t u, void* weights, float* grads) {
  if (!sharded_) throw RuntimeError("model: set_unit_storage on a model that owns its flat buffers");
  unit_weights_.at(u) = weights;
  unit_grads_.at(u) = grads;
  bind_unit(units_[u]);
}

void Model::prepare_weights() {
  if (compute_ == DType::bf16 && !sharded_) ops::convert(working_.view(DType::bf16, {num_params_}), params());
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
  float* base = static_cast<float*>(params_.data());
  return shaped(base ? base + info.offset : nullptr, DType::f32, device_, info.shape);
}

Tensor Model::grad(const ParamInfo& info) const {
  float* base = unit_grads_[info.unit];
  return shaped(base ? base + (info.offset - units_[info.unit].begin) : nullptr, DType::f32, device_, info.shape);
}

Tensor Model::weight(const ParamInfo& info) const {
  char* base = static_cast<char*>(unit_weights_[info.unit]);
  const std::size_t at = std::size_t(info.offset - units_[info.unit].begin) * dtype_size(compute_);
  return shaped(base ? base + at : nullptr, compute_, device_, info.shape);
}

Tensor Model::param_named(const std::string& name, bool grads) const {
  const ParamInfo& info = param_info(name);
  return grads ? grad(info) : weight(info);
}

void Model::zero_grads() {
  if (num_params_ > 0 && !sharded_) ops::zero(grads());
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
                                  DType compute, ops::AttentionKernels attention, bool sharded) {
  return arch_spec(config.arch).make(config, device, recompute, compute, attention, sharded);
}

}  // namespace llmtrain::model
