// Check mode of the op case registry (op_cases.h): one case at one activation dtype, f32 or bf16,
// on the CPU and on the GPU, compared in the manner of ggml's test-backend-ops:
//
//   - inputs are random from a seed derived from the case's name; in a bf16 run they are rounded
//     to bf16 on the host, and the reference is the f32 CPU op on those same rounded values (its
//     outputs unrounded), so a bf16 kernel is held to its fp32 arithmetic plus one rounding;
//   - every device tensor is framed by sentinels (cuda_compare.h) at offset 0 or at a misaligned
//     offset of one element (the kernels' scalar paths; sizes divisible by 4 (f32) or 8 (bf16) at
//     offset 0 take their 128-bit paths);
//   - outputs must be finite, the reference not all zero, and the error normalised by the
//     reference's largest element within the tensor's tolerance for the run's dtype: f32 about
//     1e-5 for elementwise ops, 1e-4 for matmuls and reductions; bf16 outputs 1e-2 (the rounding
//     of the result alone is up to 2^-9 relative: a few bf16 ulps of the largest element); f32
//     outputs of bf16 ops (weight gradients, statistics) 2e-3, as they differ from the reference
//     only in summation order;
//   - accumulating outputs (+=) start from nonzero values and, where marked, must change;
//   - inputs and absent tensors (a bias that is not there) must come back bit for bit;
//   - where marked, repeated runs on fresh copies must agree bit for bit.
#pragma once

#include <cstddef>
#include <cstdint>
#include <random>
#include <string>
#include <variant>
#include <vector>

#include "cuda_compare.h"
#include "op_cases.h"

namespace llmtrain::test {

/// One tensor's values on the host: floats (already rounded to bf16 for a bf16 tensor), or ids.
struct HostValues {
  std::vector<float> f;
  std::vector<std::int32_t> i;
};

/// Random values for `a` as a tensor of `dtype`, from `rng`.
HostValues random_values(const op_cases::Arg& a, DType dtype, std::mt19937& rng);

/// One tensor of a case on the device, between sentinels.
class DeviceTensor {
 public:
  DeviceTensor(const HostValues& v, DType dtype, std::size_t offset);

  /// The data as a device tensor of this shape.
  Tensor tensor(const op_cases::Shape& shape) const;
  /// The values, widened to float (f32 and bf16 tensors).
  std::vector<float> values() const;
  /// True when the device holds exactly `v`, bit for bit.
  bool holds(const HostValues& v) const;
  /// True when every sentinel before and after the data still has its bits.
  bool guards_intact() const;

 private:
  using Array = std::variant<DeviceArray<float>, DeviceArray<Bf16>, DeviceArray<std::int32_t>>;
  static Array make(const HostValues& v, DType dtype, std::size_t offset);

  Array array_;
};

/// a - b, elementwise.
std::vector<float> minus(std::vector<float> a, const std::vector<float>& b);
/// The bits of a float.
std::uint32_t bits_of(float x);

/// The reference result of a case: the f32 CPU op on the same (rounded) values.
struct Reference {
  std::vector<HostValues> values;
  double result = 0.0;
};
/// Runs `c` on the CPU in f32 on `inputs` (one per argument), told the run's dtype.
Reference run_reference(const op_cases::OpCase& c, const std::vector<HostValues>& inputs, DType dtype = DType::f32);

/// Runs one case at one activation dtype on the CPU and the GPU and requires them to agree.
void run_case(const op_cases::OpCase& c, DType dtype);
/// Runs every check case of `op` that has `dtype`; skips visibly without a GPU.
void run_op_cases(const std::string& op, DType dtype);

}  // namespace llmtrain::test
