#include "model/model.h"

#include "core/error.h"
#include "core/rng.h"
#include "model/gpt2.h"
#include "model/llama.h"

namespace llmtrain::model {

Recompute parse_recompute(const std::string& name) {
  if (name == "none") return Recompute::none;
  if (name == "mlp") return Recompute::mlp;
  if (name == "full") return Recompute::full;
  throw InputError("train.recompute: expected \"none\", \"mlp\" or \"full\", got \"" + name + "\"");
}

Model::Model(const config::ModelConfig& config, Device device) : config_(config), device_(device) {}

void Model::add_param(const std::string& name, std::vector<std::int64_t> shape) {
  ParamInfo info{name, std::move(shape), num_params_, 1, false};
  for (const auto d : info.shape) info.numel *= d;
  info.decay = info.shape.size() == 2;
  num_params_ += info.numel;
  infos_.push_back(std::move(info));
}

void Model::allocate() {
  params_ = ops::Buffer(device_, std::size_t(num_params_) * sizeof(float));
  grads_ = ops::Buffer(device_, std::size_t(num_params_) * sizeof(float));
  zero_grads();
}

const ParamInfo& Model::param_info(const std::string& name) const {
  for (const auto& info : infos_) {
    if (info.name == name) return info;
  }
  throw RuntimeError("model: no parameter named " + name);
}

namespace {

Tensor shaped(float* data, Device device, const std::vector<std::int64_t>& shape) {
  Tensor t(data, DType::f32, device, {});
  t.ndim = int(shape.size());
  for (int i = 0; i < t.ndim; ++i) t.shape[std::size_t(i)] = shape[std::size_t(i)];
  return t;
}

}  // namespace

Tensor Model::param(const ParamInfo& info) const {
  return shaped(static_cast<float*>(params_.data()) + info.offset, device_, info.shape);
}

Tensor Model::grad(const ParamInfo& info) const {
  return shaped(static_cast<float*>(grads_.data()) + info.offset, device_, info.shape);
}

Tensor Model::param_named(const std::string& name, bool grads) const {
  const ParamInfo& info = param_info(name);
  return grads ? grad(info) : param(info);
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

std::unique_ptr<Model> make_model(const config::ModelConfig& config, Device device, Recompute recompute) {
  if (config.arch == "gpt2") return std::make_unique<Gpt2>(config, device, recompute);
  if (config.arch == "llama") return std::make_unique<Llama>(config, device, recompute);
  throw InputError("model.arch: unknown architecture \"" + config.arch + "\"");
}

}  // namespace llmtrain::model
