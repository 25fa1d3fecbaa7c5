// Check mode of the op case registry: see op_check.h.
#include "op_check.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "ops/ops.h"

namespace llmtrain::test {

using op_cases::Arg;
using op_cases::Args;
using op_cases::Compare;
using op_cases::Changes;
using op_cases::Kind;
using op_cases::OpCase;
using op_cases::Role;
using op_cases::dtype_in_run;

HostValues random_values(const Arg& a, DType dtype, std::mt19937& rng) {
  HostValues v;
  const std::size_t n = op_cases::numel(a.shape);
  if (dtype == DType::i32) {
    std::uniform_int_distribution<std::int32_t> dist(std::int32_t(a.lo), std::int32_t(a.hi) - 1);
    v.i.resize(n);
    for (auto& x : v.i) x = dist(rng);
    return v;
  }
  v.f = a.lo == a.hi ? std::vector<float>(n, a.lo) : uniform_vec(rng, n, a.lo, a.hi);
  if (dtype == DType::bf16) v.f = round_bf16(v.f);
  return v;
}

namespace {

template <class T>
DType dtype_of_array(const DeviceArray<T>&) {
  return dtype_of<T>();
}

}  // namespace

DeviceTensor::DeviceTensor(const HostValues& v, DType dtype, std::size_t offset) : array_(make(v, dtype, offset)) {}

Tensor DeviceTensor::tensor(const op_cases::Shape& shape) const {
  return std::visit([&](const auto& a) { return op_cases::view(a.data(), dtype_of_array(a), Device::cuda, shape); },
                    array_);
}

std::vector<float> DeviceTensor::values() const {
  if (const auto* a = std::get_if<DeviceArray<float>>(&array_)) return a->to_host();
  return to_float(std::get<DeviceArray<Bf16>>(array_).to_host());
}

bool DeviceTensor::holds(const HostValues& v) const {
  if (const auto* a = std::get_if<DeviceArray<std::int32_t>>(&array_)) return a->to_host() == v.i;
  if (const auto* a = std::get_if<DeviceArray<Bf16>>(&array_)) {
    const std::vector<Bf16> got = a->to_host(), want = to_bf16(v.f);
    return std::memcmp(got.data(), want.data(), got.size() * sizeof(Bf16)) == 0;
  }
  const std::vector<float> got = std::get<DeviceArray<float>>(array_).to_host();
  return std::memcmp(got.data(), v.f.data(), got.size() * sizeof(float)) == 0;
}

bool DeviceTensor::guards_intact() const {
  return std::visit([](const auto& a) { return a.guards_intact(); }, array_);
}

DeviceTensor::Array DeviceTensor::make(const HostValues& v, DType dtype, std::size_t offset) {
  if (dtype == DType::i32) return Array(std::in_place_type<DeviceArray<std::int32_t>>, v.i, offset);
  if (dtype == DType::bf16) return Array(std::in_place_type<DeviceArray<Bf16>>, to_bf16(v.f), offset);
  return Array(std::in_place_type<DeviceArray<float>>, v.f, offset);
}

std::vector<float> minus(std::vector<float> a, const std::vector<float>& b) {
  for (std::size_t i = 0; i < a.size(); ++i) a[i] -= b[i];
  return a;
}

std::uint32_t bits_of(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

namespace {

std::uint64_t seed_of(const std::string& name) {  // FNV-1a: the same inputs on every platform
  std::uint64_t h = 1469598103934665603ull;
  for (const char ch : name) h = (h ^ std::uint8_t(ch)) * 1099511628211ull;
  return h;
}

}  // namespace

Reference run_reference(const OpCase& c, const std::vector<HostValues>& inputs, DType dtype) {
  Reference ref;
  ref.values = inputs;
  Args args;
  for (std::size_t k = 0; k < c.args.size(); ++k) {
    const Arg& a = c.args[k];
    HostValues& v = ref.values[k];
    if (a.role == Role::absent) {
      args.add(a.name, Tensor());
    } else if (a.kind == Kind::i32) {
      args.add(a.name, op_cases::view(v.i.data(), DType::i32, Device::cpu, a.shape));
    } else {
      args.add(a.name, op_cases::view(v.f.data(), DType::f32, Device::cpu, a.shape));
    }
  }
  ref.result = c.reference ? c.reference(args, dtype) : c.run(args);
  return ref;
}

void run_case(const OpCase& c, DType dtype) {
  const std::string name = c.name(dtype);
  INFO("op case: " << name);
  const double result_tol = c.result_tol ? (dtype == DType::bf16 ? c.result_tol->bf16 : c.result_tol->f32) : 0.0;

  std::mt19937 rng(std::uint32_t(seed_of(name)));
  std::vector<HostValues> inputs;
  for (const Arg& a : c.args) inputs.push_back(random_values(a, dtype_in_run(a, dtype), rng));
  const Reference ref = run_reference(c, inputs, dtype);

  std::vector<std::vector<float>> first_outputs(c.args.size());
  double first_result = 0.0;
  for (int run = 0; run < c.runs; ++run) {
    INFO("device run " << run + 1 << " of " << c.runs);
    std::vector<DeviceTensor> device;
    device.reserve(c.args.size());
    Args args;
    for (std::size_t k = 0; k < c.args.size(); ++k) {
      const Arg& a = c.args[k];
      device.emplace_back(inputs[k], dtype_in_run(a, dtype), c.offset);
      args.add(a.name, a.role == Role::absent ? Tensor() : device.back().tensor(a.shape));
    }
    const double result = c.run(args);

    for (std::size_t k = 0; k < c.args.size(); ++k) {
      const Arg& a = c.args[k];
      const DeviceTensor& d = device[k];
      {
        INFO(a.name << ": a sentinel before or after the tensor was overwritten");
        REQUIRE(d.guards_intact());
      }
      if (a.role == Role::in || a.role == Role::absent) {
        INFO(a.name << (a.role == Role::in ? " (an input)" : " (absent)") << " was changed by the op");
        REQUIRE(d.holds(inputs[k]));
        continue;
      }
      if (a.kind == Kind::i32) {  // indices (the MoE router's choices, its dispatch plan): exactly
        INFO(a.name << ": an integer output differs from the reference's");
        REQUIRE(d.holds(ref.values[k]));
        continue;
      }
      std::vector<float> got = d.values();
      if (run > 0) {
        INFO(a.name << " differs between device runs " << 1 << " and " << run + 1);
        REQUIRE(std::memcmp(got.data(), first_outputs[k].data(), got.size() * sizeof(float)) == 0);
        continue;
      }
      const double tol = dtype == DType::bf16 ? a.tol.bf16 : a.tol.f32;
      if (a.compare == Compare::change) {
        require_close(a.name + " change", minus(got, inputs[k].f), minus(ref.values[k].f, inputs[k].f), tol);
      } else {
        require_close(a.name, got, ref.values[k].f, tol, a.scale_floor);
      }
      // An accumulating op that added nothing would match a reference that added nothing. A bf16
      // element whose increment is below half an ulp stays as it was, so a handful of them may
      // all stay; from 64 elements on, some must change.
      const bool bf16 = dtype_in_run(a, dtype) == DType::bf16;
      const bool must_change = a.changes == Changes::yes || (a.changes == Changes::f32_only && dtype == DType::f32);
      if (must_change && (!bf16 || got.size() >= 64)) require_changed(a.name, got, inputs[k].f);
      first_outputs[k] = std::move(got);
    }
    if (run > 0) {
      INFO("the result differs between device runs: " << first_result << " and " << result);
      REQUIRE(std::memcmp(&result, &first_result, sizeof result) == 0);
    } else if (c.result_tol) {
      // In double (sum_squares is held to 1e-10): finite, the reference not zero, relative error.
      const double scale = std::max(std::abs(ref.result), c.result_scale_floor);
      INFO("result " << result << ", reference " << ref.result << ", tolerance " << result_tol << " of " << scale);
      REQUIRE(std::isfinite(ref.result));
      REQUIRE(ref.result != 0.0);
      REQUIRE(std::isfinite(result));
      REQUIRE(std::abs(result - ref.result) <= result_tol * scale);
    }
    first_result = result;
  }
}

void run_op_cases(const std::string& op, DType dtype) {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);
  const auto found = op_cases::check_cases().find(op);
  REQUIRE(found != op_cases::check_cases().end());
  int ran = 0;
  for (const OpCase& c : found->second) {
    if (std::find(c.dtypes.begin(), c.dtypes.end(), dtype) == c.dtypes.end()) continue;
    run_case(c, dtype);
    ++ran;
  }
  REQUIRE(ran > 0);
}

}  // namespace llmtrain::test
