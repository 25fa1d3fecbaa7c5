// Reading the PyTorch golden files (tests/data/*_reference.safetensors) and comparing against them.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "catch_compat.h"
#include "checkpoint/safetensors.h"

namespace llmtrain::test::golden {

/// Tensor `name` of the golden file as float32 (it must be there).
inline std::vector<float> read(const checkpoint::SafetensorsReader& r, const std::string& name) {
  const auto* info = r.find(name);
  REQUIRE(info != nullptr);
  std::vector<float> out(std::size_t(info->numel()));
  r.read_f32(name, out);
  return out;
}

/// Tensor `name` of the golden file as its int32 values (it must be there).
inline std::vector<std::int32_t> read_i32(const checkpoint::SafetensorsReader& r, const std::string& name) {
  const auto* info = r.find(name);
  REQUIRE(info != nullptr);
  const auto bytes = r.data(*info);
  std::vector<std::int32_t> out(bytes.size() / 4);
  std::memcpy(out.data(), bytes.data(), bytes.size());
  return out;
}

/// |a - b| / |b| over whole tensors (a holds b.size() values).
inline double relative_error(const float* a, const std::vector<float>& b) {
  double diff = 0.0, ref = 0.0;
  for (std::size_t i = 0; i < b.size(); ++i) {
    diff += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    ref += double(b[i]) * b[i];
  }
  return std::sqrt(diff / ref);
}

}  // namespace llmtrain::test::golden
