// The cuDNN 9 backend graph API in the few pieces cudnn_attention.cu needs: checked calls, an owned
// descriptor, and a builder that writes an operation graph node by node (tensors, matmul,
// pointwise, reduction, reshape, a causal mask). Included only where LLMTRAIN_HAVE_CUDNN is set.
#pragma once

#include <cudnn.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "llmtrain/kernels/error.h"

namespace llmtrain::cuda::cudnn {

[[noreturn]] inline void throw_cudnn_error(cudnnStatus_t status, const char* call, const char* file, int line) {
  char detail[512] = {};
  cudnnGetLastErrorString(detail, sizeof detail);
  throw kernels::Error(std::string("cuDNN error: ") + cudnnGetErrorString(status) +
                     (detail[0] != '\0' ? std::string(" (") + detail + ")" : std::string()) + " in " + call +
                     " at " + file + ":" + std::to_string(line));
}

}  // namespace llmtrain::cuda::cudnn

// Every cuDNN call goes through LLMTRAIN_CUDNN_CHECK, which names the call (for SetAttribute, the
// attribute), file and line, and cuDNN's own last message.
#define LLMTRAIN_CUDNN_CHECK(call)                                                            \
  do {                                                                                        \
    const cudnnStatus_t llmtrain_cudnn_status_ = (call);                                      \
    if (llmtrain_cudnn_status_ != CUDNN_STATUS_SUCCESS) {                                     \
      ::llmtrain::cuda::cudnn::throw_cudnn_error(llmtrain_cudnn_status_, #call, __FILE__, __LINE__); \
    }                                                                                         \
  } while (0)

#define LLMTRAIN_CUDNN_SET(desc, name, type, count, values) \
  LLMTRAIN_CUDNN_CHECK(cudnnBackendSetAttribute((desc), (name), (type), (count), (values)))


namespace llmtrain::cuda::cudnn {

// A backend descriptor, destroyed with its owner.
class Descriptor {
 public:
  explicit Descriptor(cudnnBackendDescriptorType_t type) {
    LLMTRAIN_CUDNN_CHECK(cudnnBackendCreateDescriptor(type, &desc_));
  }
  ~Descriptor() {
    if (desc_ != nullptr) cudnnBackendDestroyDescriptor(desc_);
  }
  Descriptor(Descriptor&& other) noexcept : desc_(std::exchange(other.desc_, nullptr)) {}
  Descriptor(const Descriptor&) = delete;
  Descriptor& operator=(const Descriptor&) = delete;
  Descriptor& operator=(Descriptor&&) = delete;

  cudnnBackendDescriptor_t get() const { return desc_; }

 private:
  cudnnBackendDescriptor_t desc_ = nullptr;
};

using Dims = std::array<std::int64_t, 4>;
using Desc = cudnnBackendDescriptor_t;

// Builds one operation graph; owns every descriptor it makes.
class GraphBuilder {
 public:
  /// Virtual (intermediate) tensors get unique ids from `first_virtual_uid` on; `cudnn_version`
  /// (cudnnGetVersion()) picks the attributes that version knows, as cudnn_frontend does.
  GraphBuilder(std::int64_t first_virtual_uid, std::size_t cudnn_version)
      : next_virtual_(first_virtual_uid), version_(cudnn_version) {}

  Desc tensor(std::int64_t uid, cudnnDataType_t type, const Dims& dims, const Dims& strides,
              bool is_virtual = false, bool by_value = false) {
    const Desc t = make(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    // 16 bytes: every pointer is checked (check_aligned); virtual tensors say so too, as cudnn_frontend's.
    const std::int64_t alignment = 16;
    LLMTRAIN_CUDNN_SET(t, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type);
    LLMTRAIN_CUDNN_SET(t, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims.data());
    LLMTRAIN_CUDNN_SET(t, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, strides.data());
    LLMTRAIN_CUDNN_SET(t, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid);
    LLMTRAIN_CUDNN_SET(t, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &alignment);
    LLMTRAIN_CUDNN_SET(t, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &is_virtual);
    if (by_value) LLMTRAIN_CUDNN_SET(t, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value);
    LLMTRAIN_CUDNN_CHECK(cudnnBackendFinalize(t));
    return t;
  }
  Desc intermediate(cudnnDataType_t type, const Dims& dims, const Dims& strides) {
    return tensor(next_virtual_++, type, dims, strides, /*is_virtual=*/true);
  }
  /// An fp32 scalar passed by value (the variant pack points at a host float).
  Desc scalar(std::int64_t uid) {
    return tensor(uid, CUDNN_DATA_FLOAT, {1, 1, 1, 1}, {1, 1, 1, 1}, false, true);
  }

  /// c = a b over the last two dims, batched over the first two (broadcast where b has fewer heads).
  void matmul(Desc c, Desc a, Desc b) {
    const Desc mm = make(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
    const cudnnDataType_t compute = CUDNN_DATA_FLOAT;
    LLMTRAIN_CUDNN_SET(mm, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &compute);
    LLMTRAIN_CUDNN_CHECK(cudnnBackendFinalize(mm));
    const Desc op = make(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
    LLMTRAIN_CUDNN_SET(op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &a);
    LLMTRAIN_CUDNN_SET(op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b);
    LLMTRAIN_CUDNN_SET(op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &c);
    LLMTRAIN_CUDNN_SET(op, CUDNN_ATTR_OPERATION_MATMUL_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &mm);
    add_operation(op);
  }

  /// y = mode(x[, b[, t]]), computed in `math`; `axis` for GEN_INDEX.
  void pointwise(cudnnPointwiseMode_t mode, Desc y, Desc x, Desc b = nullptr, Desc t = nullptr,
                 cudnnDataType_t math = CUDNN_DATA_FLOAT, std::int64_t axis = -1) {
    const Desc pw = make(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    LLMTRAIN_CUDNN_SET(pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode);
    LLMTRAIN_CUDNN_SET(pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &math);
    if (axis >= 0) LLMTRAIN_CUDNN_SET(pw, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis);
    LLMTRAIN_CUDNN_CHECK(cudnnBackendFinalize(pw));
    const Desc op = make(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
    const float one = 1.0f;  // alpha1, alpha2: cudnn_frontend always sets both
    LLMTRAIN_CUDNN_SET(op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
                       &pw);
    LLMTRAIN_CUDNN_SET(op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x);
    if (b != nullptr)
      LLMTRAIN_CUDNN_SET(op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b);
    if (t != nullptr)
      LLMTRAIN_CUDNN_SET(op, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &t);
    LLMTRAIN_CUDNN_SET(op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y);
    LLMTRAIN_CUDNN_SET(op, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_TYPE_FLOAT, 1, &one);
    LLMTRAIN_CUDNN_SET(op, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, CUDNN_TYPE_FLOAT, 1, &one);
    add_operation(op);
  }

  /// y = reduce(x) over the dims where y is smaller (to 1, or from NH heads to NKV groups).
  void reduction(cudnnReduceTensorOp_t reduce, Desc y, Desc x) {
    const Desc red = make(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
    const cudnnDataType_t compute = CUDNN_DATA_FLOAT;
    LLMTRAIN_CUDNN_SET(red, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &reduce);
    LLMTRAIN_CUDNN_SET(red, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &compute);
    LLMTRAIN_CUDNN_CHECK(cudnnBackendFinalize(red));
    const Desc op = make(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
    LLMTRAIN_CUDNN_SET(op, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x);
    LLMTRAIN_CUDNN_SET(op, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y);
    LLMTRAIN_CUDNN_SET(op, CUDNN_ATTR_OPERATION_REDUCTION_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &red);
    add_operation(op);
  }

  /// y = x seen with y's dims and strides (here: a transpose of the last two dims). A view: from
  /// cuDNN 9.22, which has a reshape mode, it says VIEW_ONLY, as cudnn_frontend does.
  void reshape(Desc y, Desc x) {
    const Desc op = make(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
    LLMTRAIN_CUDNN_SET(op, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x);
    LLMTRAIN_CUDNN_SET(op, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y);
#if CUDNN_VERSION >= 92200
    if (version_ >= 92200) {
      const cudnnBackendReshapeMode_t mode = CUDNN_RESHAPE_VIEW_ONLY;
      LLMTRAIN_CUDNN_SET(op, CUDNN_ATTR_OPERATION_RESHAPE_MODE, CUDNN_TYPE_RESHAPE_MODE, 1, &mode);
    }
#endif
    add_operation(op);
  }

  /// scores where row (query) >= column (key), else `lowest` (the most negative float: exp gives
  /// 0, and unlike -inf it cannot make inf - inf). cudnn_frontend's causal mask, node for node:
  /// the indices generated in FLOAT, as the frontend keeps them (exact below 2^24).
  Desc causal_mask(Desc scores, Desc lowest, const Dims& dims, const Dims& strides) {
    const Desc row = intermediate(CUDNN_DATA_FLOAT, dims, strides);
    const Desc col = intermediate(CUDNN_DATA_FLOAT, dims, strides);
    const Desc keep = intermediate(CUDNN_DATA_BOOLEAN, dims, strides);
    const Desc masked = intermediate(CUDNN_DATA_FLOAT, dims, strides);
    pointwise(CUDNN_POINTWISE_GEN_INDEX, row, scores, nullptr, nullptr, CUDNN_DATA_FLOAT, 2);
    pointwise(CUDNN_POINTWISE_GEN_INDEX, col, scores, nullptr, nullptr, CUDNN_DATA_FLOAT, 3);
    pointwise(CUDNN_POINTWISE_CMP_GE, keep, row, col, nullptr, CUDNN_DATA_BOOLEAN);
    pointwise(CUDNN_POINTWISE_BINARY_SELECT, masked, scores, lowest, keep);  // keep ? scores : lowest
    return masked;
  }

  /// Moves the descriptors out (the plan keeps them as long as it lives).
  std::vector<Descriptor> take_descriptors() { return std::move(descriptors_); }
  const std::vector<Desc>& operations() const { return operations_; }
  Desc make(cudnnBackendDescriptorType_t type) {
    descriptors_.emplace_back(type);
    return descriptors_.back().get();
  }

 private:
  void add_operation(Desc op) {
    LLMTRAIN_CUDNN_CHECK(cudnnBackendFinalize(op));
    operations_.push_back(op);
  }

  std::vector<Descriptor> descriptors_;
  std::vector<Desc> operations_;
  std::int64_t next_virtual_;
  std::size_t version_;
};

}  // namespace llmtrain::cuda::cudnn
