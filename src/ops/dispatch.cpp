#include "ops/dispatch.h"

#include "core/bf16.h"

namespace llmtrain::ops::dispatch {

void Devices::see(const Tensor& t) {
  // The device is kept by value: argument lists may hold temporary views (attention_decode's rows).
  if (!t.data) return;
  if (!seen_) {
    seen_ = true;
    device_ = t.device;
  } else if (t.device != device_) {
    throw RuntimeError(std::string("ops::") + op_ + ": arguments on different devices (" + device_name(device_) +
                       " and " + device_name(t.device) + ")");
  }
}

bool Devices::on_cuda() const {
  if (!seen_ || device_ != Device::cuda) return false;
#if !LLMTRAIN_HAVE_CUDA
  throw RuntimeError(std::string("ops::") + op_ +
                     ": cuda tensors in a build without CUDA (configure with -DLLMTRAIN_CUDA=ON)");
#endif
  return true;
}

Widened::~Widened() {
  for (const Copy& c : copies_) {
    if (!c.output) continue;
    auto* bits = c.target.as<std::uint16_t>();
    for (std::size_t i = 0; i < c.values.size(); ++i) bits[i] = float_to_bf16_bits(c.values[i]);
  }
}

float* Widened::widen(const Tensor& t, bool output) {
  if (!t.data || t.dtype != DType::bf16) return t.as<float>();
  Copy& c = copies_.emplace_back(Copy{t, std::vector<float>(std::size_t(t.numel())), output});
  const auto* bits = t.as<const std::uint16_t>();
  for (std::size_t i = 0; i < c.values.size(); ++i) c.values[i] = bf16_bits_to_float(bits[i]);
  return c.values.data();
}

DType Op::activation(const Tensor& t) const {
  if (t.dtype == DType::f32 || t.dtype == DType::bf16) return t.dtype;
  fail("expected f32 or bf16 activations, got " + t.describe());
}

void Op::expect(const char* arg, const Tensor& t, DType dtype, std::vector<std::int64_t> shape) const {
  bool ok = t.data != nullptr && t.dtype == dtype && t.ndim == int(shape.size());
  for (int i = 0; ok && i < t.ndim; ++i) ok = shape[i] < 0 || t.shape[i] == shape[i];
  if (ok) return;
  std::string want = std::string(dtype_name(dtype)) + "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    want += (i ? ", " : "") + (shape[i] < 0 ? std::string("*") : std::to_string(shape[i]));
  }
  fail(std::string(arg) + " is " + (t.data ? t.describe() : "null") + ", expected " + want + "]");
}

DType Op::expect_same_size(std::initializer_list<const Tensor*> tensors, bool f32_only) const {
  const Tensor& first = **tensors.begin();
  const DType dtype = first.dtype == DType::bf16 && !f32_only ? DType::bf16 : DType::f32;
  for (const Tensor* t : tensors) {
    if (!t->data || t->dtype != dtype || t->numel() != first.numel()) {
      fail("expected " + std::string(dtype_name(dtype)) + " tensors of " + std::to_string(first.numel()) +
           " elements, got " + (t->data ? t->describe() : "null"));
    }
  }
  return dtype;
}

void Op::fail(const std::string& what) const { throw RuntimeError(std::string("ops::") + name_ + ": " + what); }

#if LLMTRAIN_HAVE_CUDA
const cuda::Blas& matmul_blas() {
  static const cuda::Blas* const blas = new cuda::Blas(cuda::create_blas());  // never deleted: see the header
  return *blas;
}
#endif

bool Op::on_cuda(std::initializer_list<const Tensor*> tensors) const {
  Devices devices(name_);
  for (const Tensor* t : tensors) devices.see(*t);
  return devices.on_cuda();
}

}  // namespace llmtrain::ops::dispatch
