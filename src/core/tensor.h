// A non-owning view of a tensor: pointer, element type, device and shape.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace llmtrain {

enum class DType : std::uint8_t { f32, bf16, i32, u16 };
enum class Device : std::uint8_t { cpu, cuda };

/// Bytes per element.
constexpr std::size_t dtype_size(DType t) {
  return t == DType::f32 || t == DType::i32 ? 4 : 2;
}
const char* dtype_name(DType t);
const char* device_name(Device d);

struct Tensor {
  static constexpr int max_dims = 4;

  void* data = nullptr;
  DType dtype = DType::f32;
  Device device = Device::cpu;
  int ndim = 0;
  std::array<std::int64_t, max_dims> shape{};

  Tensor() = default;
  Tensor(void* data_, DType dtype_, Device device_, std::initializer_list<std::int64_t> dims);

  std::int64_t numel() const;
  std::size_t bytes() const { return static_cast<std::size_t>(numel()) * dtype_size(dtype); }
  template <class T>
  T* as() const {
    return static_cast<T*>(data);
  }
  /// "f32[4, 64] on cpu", for error messages.
  std::string describe() const;
  /// The same data with another shape of the same element count.
  Tensor reshape(std::initializer_list<std::int64_t> dims) const;
};

}  // namespace llmtrain
