#include "core/tensor.h"

#include <stdexcept>

namespace llmtrain {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::bf16: return "bf16";
    case DType::i32: return "i32";
    case DType::u16: return "u16";
  }
  return "?";
}

const char* device_name(Device d) { return d == Device::cpu ? "cpu" : "cuda"; }

Tensor::Tensor(void* data_, DType dtype_, Device device_, std::initializer_list<std::int64_t> dims)
    : data(data_), dtype(dtype_), device(device_), ndim(static_cast<int>(dims.size())) {
  if (dims.size() > max_dims) throw std::invalid_argument("Tensor: more than 4 dimensions");
  int i = 0;
  for (const auto d : dims) shape[i++] = d;
}

std::int64_t Tensor::numel() const {
  std::int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[i];
  return n;
}

std::string Tensor::describe() const {
  std::string s = std::string(dtype_name(dtype)) + "[";
  for (int i = 0; i < ndim; ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "] on " + device_name(device);
}

Tensor Tensor::reshape(std::initializer_list<std::int64_t> dims) const {
  Tensor t(data, dtype, device, dims);
  if (t.numel() != numel()) throw std::invalid_argument("Tensor::reshape: " + describe() + " to another size");
  return t;
}

}  // namespace llmtrain
