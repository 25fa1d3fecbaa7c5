// cuBLASLt on the host. The descriptors record what cuBLASLt would be told; every call checks
// what cuBLASLt checks (attribute value sizes, shapes, leading dimensions, types, pointers in
// device memory, and that pointers are as aligned as the preferences promised when the
// algorithm was chosen), and cublasLtMatmul computes
//   D = epilogue(alpha op(A) op(B) + beta C)
// in double for every element, rounding once to D's type (C is not read when beta == 0, as in
// BLAS). TF32 and bf16-fast compute types round the inputs first, as tensor cores do.
// The heuristic offers several algorithms (all the same GEMM); the test hooks of
// llmtrain_emu/cublaslt_control.h set how many, and how many of them cublasLtMatmul turns down.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "cublasLt.h"
#include "cuda_bf16.h"
#include "internal.h"
#include "llmtrain_emu/cublaslt_control.h"

struct cublasLtContext {
  int magic;
};
struct cublasLtMatmulDescEmu {
  cublasComputeType_t compute;
  cudaDataType_t scale_type;
  std::int32_t pointer_mode = CUBLAS_POINTER_MODE_HOST;
  std::int32_t trans_a = CUBLAS_OP_N, trans_b = CUBLAS_OP_N;
  std::uint32_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  const void* bias = nullptr;
  std::int32_t bias_type = -1;  // -1: D's type
  std::int64_t bias_batch_stride = 0;
  void* aux = nullptr;
  std::int64_t aux_ld = 0, aux_batch_stride = 0;
  std::int32_t aux_type = -1;
};
struct cublasLtMatrixLayoutEmu {
  cudaDataType_t type;
  std::uint64_t rows, cols;
  std::int64_t ld;
  std::int32_t order = CUBLASLT_ORDER_COL;
  std::int32_t batch = 1;
  std::int64_t batch_stride = 0;
};
struct cublasLtMatmulPreferenceEmu {
  std::uint64_t max_workspace = 0;
  std::uint32_t min_alignment[4] = {256, 256, 256, 256};  // A, B, C, D: cuBLASLt's default is 256
};

namespace {

using llmtrain_emu::report;

constexpr int handle_magic = 0x1b1a5;

cublasStatus_t bad(cublasStatus_t status, const std::string& why) {
  report("cuBLASLt: " + why);
  return status;
}

template <class T>
cublasStatus_t read_value(T* out, const void* buf, std::size_t size, const char* name) {
  if (buf == nullptr || size != sizeof(T)) {
    return bad(CUBLAS_STATUS_INVALID_VALUE, std::string(name) + ": value of " + std::to_string(size) +
                                                " bytes, cuBLASLt expects " + std::to_string(sizeof(T)));
  }
  std::memcpy(out, buf, sizeof(T));
  return CUBLAS_STATUS_SUCCESS;
}

std::size_t type_bytes(int type) {
  switch (type) {
    case CUDA_R_32F: return 4;
    case CUDA_R_16BF: case CUDA_R_16F: return 2;
    case CUDA_R_64F: return 8;
    default: return 0;
  }
}

float half_to_float(std::uint16_t h) {
  const std::uint32_t sign = std::uint32_t(h & 0x8000u) << 16;
  const int exponent = (h >> 10) & 0x1f;
  const std::uint32_t mantissa = h & 0x3ffu;
  float f;
  if (exponent == 0) {
    f = std::ldexp(float(mantissa), -24);
  } else if (exponent == 31) {
    f = mantissa ? NAN : INFINITY;
  } else {
    f = std::ldexp(float(mantissa | 0x400u), exponent - 25);
  }
  std::uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits |= sign;
  std::memcpy(&f, &bits, 4);
  return f;
}

std::uint16_t float_to_half(float f) {
  // Through the exact double value: round to nearest even at half precision.
  if (std::isnan(f)) return 0x7e00;
  const std::uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  double a = std::fabs(double(f));
  if (a >= 65520.0) return sign | 0x7c00;
  if (a < std::ldexp(1.0, -14)) return sign | std::uint16_t(std::nearbyint(a * std::ldexp(1.0, 24)));
  int e;
  const double m = std::frexp(a, &e);  // a = m 2^e, m in [0.5, 1)
  double q = std::nearbyint(m * 2048.0);  // 11 significant bits
  if (q == 2048.0) {
    q = 1024.0;
    ++e;
  }
  return sign | std::uint16_t(((e + 14) << 10) | (std::uint32_t(q) & 0x3ffu));
}

double load(const void* base, std::int64_t index, int type) {
  switch (type) {
    case CUDA_R_32F: return static_cast<const float*>(base)[index];
    case CUDA_R_64F: return static_cast<const double*>(base)[index];
    case CUDA_R_16BF: return float(static_cast<const __nv_bfloat16*>(base)[index]);
    case CUDA_R_16F: return half_to_float(static_cast<const std::uint16_t*>(base)[index]);
    default: return NAN;
  }
}

void store(void* base, std::int64_t index, int type, double value) {
  switch (type) {
    case CUDA_R_32F: static_cast<float*>(base)[index] = float(value); break;
    case CUDA_R_64F: static_cast<double*>(base)[index] = value; break;
    case CUDA_R_16BF: static_cast<__nv_bfloat16*>(base)[index] = __nv_bfloat16(float(value)); break;
    case CUDA_R_16F: static_cast<std::uint16_t*>(base)[index] = float_to_half(float(value)); break;
    default: break;
  }
}

// Rounds an input as the compute type's tensor cores read it.
double round_input(double x, cublasComputeType_t compute) {
  if (compute == CUBLAS_COMPUTE_32F_FAST_TF32) {  // 10 explicit mantissa bits, nearest even
    float f = float(x);
    std::uint32_t bits;
    std::memcpy(&bits, &f, 4);
    if ((bits & 0x7f800000u) != 0x7f800000u) bits = (bits + 0xfffu + ((bits >> 13) & 1u)) & ~0x1fffu;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  if (compute == CUBLAS_COMPUTE_32F_FAST_16BF) return float(__nv_bfloat16(float(x)));
  if (compute == CUBLAS_COMPUTE_32F_FAST_16F) return half_to_float(float_to_half(float(x)));
  return x;
}

double gelu(double x) { return 0.5 * x * (1.0 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))); }
double gelu_grad(double x) {
  const double u = 0.7978845608028654 * (x + 0.044715 * x * x * x);
  const double t = std::tanh(u);
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3 * 0.044715 * x * x);
}

// Index of element (r, c) of batch `batch` in a layout.
std::int64_t at(const cublasLtMatrixLayoutEmu& l, std::uint64_t r, std::uint64_t c, int batch) {
  const std::int64_t offset = std::int64_t(batch) * l.batch_stride;
  return offset + (l.order == CUBLASLT_ORDER_COL ? std::int64_t(r) + std::int64_t(c) * l.ld
                                                 : std::int64_t(r) * l.ld + std::int64_t(c));
}

// The bytes a layout's elements span (all batches), for the device-memory check.
std::size_t span_bytes(const cublasLtMatrixLayoutEmu& l) {
  if (l.rows == 0 || l.cols == 0) return 0;
  const std::int64_t last = at(l, l.rows - 1, l.cols - 1, l.batch - 1);
  return std::size_t(last + 1) * type_bytes(l.type);
}

std::uint32_t alignment_of(const void* p) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  std::uint32_t alignment = 256;
  while (alignment > 1 && a % alignment != 0) alignment /= 2;
  return alignment;
}

bool has_bias(std::uint32_t e) {
  return e == CUBLASLT_EPILOGUE_BIAS || e == CUBLASLT_EPILOGUE_RELU_BIAS || e == CUBLASLT_EPILOGUE_GELU_BIAS ||
         e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
}
bool writes_bias_grad(std::uint32_t e) {
  return e == CUBLASLT_EPILOGUE_BGRADA || e == CUBLASLT_EPILOGUE_BGRADB || e == CUBLASLT_EPILOGUE_DGELU_BGRAD;
}
bool uses_aux(std::uint32_t e) {
  return e == CUBLASLT_EPILOGUE_GELU_AUX || e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS || e == CUBLASLT_EPILOGUE_DGELU ||
         e == CUBLASLT_EPILOGUE_DGELU_BGRAD;
}
bool supported_epilogue(std::uint32_t e) {
  return e == CUBLASLT_EPILOGUE_DEFAULT || e == CUBLASLT_EPILOGUE_RELU || e == CUBLASLT_EPILOGUE_RELU_BIAS ||
         e == CUBLASLT_EPILOGUE_GELU || e == CUBLASLT_EPILOGUE_GELU_BIAS || has_bias(e) || writes_bias_grad(e) ||
         uses_aux(e);
}

struct Shape {
  std::uint64_t m, n, k;
};

// The checks cuBLASLt makes of a problem (both in the heuristic and in the matmul).
cublasStatus_t check_problem(const cublasLtMatmulDescEmu* desc, const cublasLtMatrixLayoutEmu* a,
                             const cublasLtMatrixLayoutEmu* b, const cublasLtMatrixLayoutEmu* c,
                             const cublasLtMatrixLayoutEmu* d, Shape* shape) {
  if (!desc || !a || !b || !c || !d) return bad(CUBLAS_STATUS_INVALID_VALUE, "null descriptor or layout");
  if (desc->trans_a == CUBLAS_OP_C || desc->trans_b == CUBLAS_OP_C) {
    return bad(CUBLAS_STATUS_NOT_SUPPORTED, "CUBLAS_OP_C is not emulated (real types: same as T)");
  }
  const bool ta = desc->trans_a == CUBLAS_OP_T, tb = desc->trans_b == CUBLAS_OP_T;
  const std::uint64_t m = ta ? a->cols : a->rows, k = ta ? a->rows : a->cols;
  const std::uint64_t kb = tb ? b->cols : b->rows, n = tb ? b->rows : b->cols;
  const auto dims = [](const cublasLtMatrixLayoutEmu* l) {
    return std::to_string(l->rows) + "x" + std::to_string(l->cols);
  };
  if (k != kb || c->rows != m || c->cols != n || d->rows != m || d->cols != n) {
    return bad(CUBLAS_STATUS_INVALID_VALUE, std::string("inconsistent shapes: A ") + dims(a) + (ta ? " (T)" : "") +
                                                ", B " + dims(b) + (tb ? " (T)" : "") + ", C " + dims(c) + ", D " +
                                                dims(d) + ": op(A) is " + std::to_string(m) + "x" +
                                                std::to_string(k) + ", op(B) " + std::to_string(kb) + "x" +
                                                std::to_string(n));
  }
  for (const auto* l : {a, b, c, d}) {
    const std::uint64_t inner = l->order == CUBLASLT_ORDER_COL ? l->rows : l->cols;
    if (l->ld < std::int64_t(inner == 0 ? 1 : inner)) {
      return bad(CUBLAS_STATUS_INVALID_VALUE, "leading dimension " + std::to_string(l->ld) + " below " +
                                                  std::to_string(inner) + " for a " + dims(l) + " matrix");
    }
    if (type_bytes(l->type) == 0) return bad(CUBLAS_STATUS_NOT_SUPPORTED, "matrix data type not emulated");
    if (l->batch != d->batch) return bad(CUBLAS_STATUS_INVALID_VALUE, "batch counts differ");
  }
  if (a->type != b->type) return bad(CUBLAS_STATUS_NOT_SUPPORTED, "A and B of different types");
  if (c->type != d->type) return bad(CUBLAS_STATUS_NOT_SUPPORTED, "C and D of different types");
  if (desc->scale_type != CUDA_R_32F && desc->scale_type != CUDA_R_64F) {
    return bad(CUBLAS_STATUS_NOT_SUPPORTED, "scale type not emulated");
  }
  if ((desc->compute == CUBLAS_COMPUTE_64F) != (a->type == CUDA_R_64F)) {
    return bad(CUBLAS_STATUS_NOT_SUPPORTED, "compute type does not fit the data types");
  }
  if ((desc->compute == CUBLAS_COMPUTE_32F_FAST_TF32 || desc->compute == CUBLAS_COMPUTE_32F_FAST_16BF ||
       desc->compute == CUBLAS_COMPUTE_32F_FAST_16F) &&
      a->type != CUDA_R_32F) {
    return bad(CUBLAS_STATUS_NOT_SUPPORTED, "fast-fp32 compute types take fp32 inputs");
  }
  if (!supported_epilogue(desc->epilogue)) {
    return bad(CUBLAS_STATUS_NOT_SUPPORTED, "epilogue " + std::to_string(desc->epilogue) + " not emulated");
  }
  if ((has_bias(desc->epilogue) || writes_bias_grad(desc->epilogue)) && desc->bias == nullptr) {
    return bad(CUBLAS_STATUS_INVALID_VALUE, "the epilogue needs CUBLASLT_MATMUL_DESC_BIAS_POINTER");
  }
  if (uses_aux(desc->epilogue) && (desc->aux == nullptr || desc->aux_ld < std::int64_t(m))) {
    return bad(CUBLAS_STATUS_INVALID_VALUE, "the epilogue needs an aux pointer and an aux ld >= m");
  }
  *shape = Shape{m, n, k};
  return CUBLAS_STATUS_SUCCESS;
}

// The test hooks' settings and counts.
struct Control {
  std::mutex mutex;
  llmtrain_emu::CublasLtCandidates candidates;
  llmtrain_emu::CublasLtCounts counts;
  Control() {
    const auto env_int = [](const char* name, int fallback) {
      const char* v = std::getenv(name);
      return v && *v ? std::atoi(v) : fallback;
    };
    candidates.offered = std::max(0, env_int("LLMTRAIN_EMU_CUBLASLT_OFFERED", candidates.offered));
    candidates.rejected = std::max(0, env_int("LLMTRAIN_EMU_CUBLASLT_REJECTED", candidates.rejected));
  }
};
Control& control() {
  static Control c;
  return c;
}

}  // namespace

namespace llmtrain_emu {

void set_cublaslt_candidates(CublasLtCandidates candidates) {
  const std::lock_guard<std::mutex> lock(control().mutex);
  control().candidates = candidates;
}

CublasLtCandidates cublaslt_candidates() {
  const std::lock_guard<std::mutex> lock(control().mutex);
  return control().candidates;
}

CublasLtCounts cublaslt_counts() {
  const std::lock_guard<std::mutex> lock(control().mutex);
  return control().counts;
}

}  // namespace llmtrain_emu

// ---- handles and versions -----------------------------------------------------------------------------

cublasStatus_t cublasLtCreate(cublasLtHandle_t* handle) {
  *handle = new cublasLtContext{handle_magic};
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtDestroy(cublasLtHandle_t handle) {
  if (!handle || handle->magic != handle_magic) return bad(CUBLAS_STATUS_NOT_INITIALIZED, "destroying a bad handle");
  handle->magic = 0;
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}

std::size_t cublasLtGetVersion() { return 130000; }

const char* cublasLtGetStatusName(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
  }
  return "CUBLAS_STATUS_UNKNOWN";
}

const char* cublasLtGetStatusString(cublasStatus_t status) { return cublasLtGetStatusName(status); }

// ---- matmul descriptors -------------------------------------------------------------------------------------

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* desc, cublasComputeType_t compute,
                                        cudaDataType_t scale_type) {
  switch (compute) {
    case CUBLAS_COMPUTE_32F: case CUBLAS_COMPUTE_32F_PEDANTIC: case CUBLAS_COMPUTE_32F_FAST_TF32:
    case CUBLAS_COMPUTE_32F_FAST_16BF: case CUBLAS_COMPUTE_32F_FAST_16F: case CUBLAS_COMPUTE_64F: break;
    default: return bad(CUBLAS_STATUS_NOT_SUPPORTED, "compute type not emulated");
  }
  *desc = new cublasLtMatmulDescEmu{};
  (*desc)->compute = compute;
  (*desc)->scale_type = scale_type;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc) {
  delete desc;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr,
                                              const void* buf, std::size_t size) {
  if (!desc) return bad(CUBLAS_STATUS_INVALID_VALUE, "null matmul descriptor");
  switch (attr) {
    case CUBLASLT_MATMUL_DESC_COMPUTE_TYPE: {
      std::int32_t v;
      if (const auto s = read_value(&v, buf, size, "COMPUTE_TYPE")) return s;
      desc->compute = cublasComputeType_t(v);
      return CUBLAS_STATUS_SUCCESS;
    }
    case CUBLASLT_MATMUL_DESC_SCALE_TYPE: {
      std::int32_t v;
      if (const auto s = read_value(&v, buf, size, "SCALE_TYPE")) return s;
      desc->scale_type = cudaDataType_t(v);
      return CUBLAS_STATUS_SUCCESS;
    }
    case CUBLASLT_MATMUL_DESC_POINTER_MODE: return read_value(&desc->pointer_mode, buf, size, "POINTER_MODE");
    case CUBLASLT_MATMUL_DESC_TRANSA: return read_value(&desc->trans_a, buf, size, "TRANSA");
    case CUBLASLT_MATMUL_DESC_TRANSB: return read_value(&desc->trans_b, buf, size, "TRANSB");
    case CUBLASLT_MATMUL_DESC_EPILOGUE: return read_value(&desc->epilogue, buf, size, "EPILOGUE");
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER: return read_value(&desc->bias, buf, size, "BIAS_POINTER");
    case CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE: return read_value(&desc->bias_type, buf, size, "BIAS_DATA_TYPE");
    case CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE:
      return read_value(&desc->bias_batch_stride, buf, size, "BIAS_BATCH_STRIDE");
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER: return read_value(&desc->aux, buf, size, "EPILOGUE_AUX_POINTER");
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD: return read_value(&desc->aux_ld, buf, size, "EPILOGUE_AUX_LD");
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE:
      return read_value(&desc->aux_batch_stride, buf, size, "EPILOGUE_AUX_BATCH_STRIDE");
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE:
      return read_value(&desc->aux_type, buf, size, "EPILOGUE_AUX_DATA_TYPE");
    default:
      return bad(CUBLAS_STATUS_NOT_SUPPORTED,
                 "matmul descriptor attribute " + std::to_string(int(attr)) + " not emulated (add it to cublaslt.cpp)");
  }
}

cublasStatus_t cublasLtMatmulDescGetAttribute(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr,
                                              void* buf, std::size_t size, std::size_t* size_written) {
  if (!desc) return bad(CUBLAS_STATUS_INVALID_VALUE, "null matmul descriptor");
  const auto give = [&](const auto& v) {
    if (size_written) *size_written = sizeof v;
    if (size < sizeof v || buf == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
    std::memcpy(buf, &v, sizeof v);
    return CUBLAS_STATUS_SUCCESS;
  };
  switch (attr) {
    case CUBLASLT_MATMUL_DESC_TRANSA: return give(desc->trans_a);
    case CUBLASLT_MATMUL_DESC_TRANSB: return give(desc->trans_b);
    case CUBLASLT_MATMUL_DESC_EPILOGUE: return give(desc->epilogue);
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER: return give(desc->bias);
    default: return bad(CUBLAS_STATUS_NOT_SUPPORTED, "GetAttribute: attribute not emulated");
  }
}

// ---- layouts and preferences ------------------------------------------------------------------------------

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* layout, cudaDataType type, std::uint64_t rows,
                                          std::uint64_t cols, std::int64_t ld) {
  *layout = new cublasLtMatrixLayoutEmu{type, rows, cols, ld};
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout) {
  delete layout;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t layout, cublasLtMatrixLayoutAttribute_t attr,
                                                const void* buf, std::size_t size) {
  if (!layout) return bad(CUBLAS_STATUS_INVALID_VALUE, "null layout");
  switch (attr) {
    case CUBLASLT_MATRIX_LAYOUT_TYPE: {
      std::uint32_t v;
      if (const auto s = read_value(&v, buf, size, "LAYOUT_TYPE")) return s;
      layout->type = cudaDataType_t(v);
      return CUBLAS_STATUS_SUCCESS;
    }
    case CUBLASLT_MATRIX_LAYOUT_ORDER: {
      if (const auto s = read_value(&layout->order, buf, size, "LAYOUT_ORDER")) return s;
      if (layout->order != CUBLASLT_ORDER_COL && layout->order != CUBLASLT_ORDER_ROW) {
        return bad(CUBLAS_STATUS_NOT_SUPPORTED, "only column and row orders are emulated");
      }
      return CUBLAS_STATUS_SUCCESS;
    }
    case CUBLASLT_MATRIX_LAYOUT_ROWS: return read_value(&layout->rows, buf, size, "LAYOUT_ROWS");
    case CUBLASLT_MATRIX_LAYOUT_COLS: return read_value(&layout->cols, buf, size, "LAYOUT_COLS");
    case CUBLASLT_MATRIX_LAYOUT_LD: return read_value(&layout->ld, buf, size, "LAYOUT_LD");
    case CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT: return read_value(&layout->batch, buf, size, "LAYOUT_BATCH_COUNT");
    case CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET:
      return read_value(&layout->batch_stride, buf, size, "LAYOUT_STRIDED_BATCH_OFFSET");
  }
  return bad(CUBLAS_STATUS_NOT_SUPPORTED, "layout attribute not emulated");
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* pref) {
  *pref = new cublasLtMatmulPreferenceEmu{};
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref) {
  delete pref;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref,
                                                    cublasLtMatmulPreferenceAttributes_t attr, const void* buf,
                                                    std::size_t size) {
  if (!pref) return bad(CUBLAS_STATUS_INVALID_VALUE, "null preference");
  switch (attr) {
    case CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES: return read_value(&pref->max_workspace, buf, size, "MAX_WORKSPACE_BYTES");
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES: return read_value(&pref->min_alignment[0], buf, size, "MIN_ALIGNMENT_A_BYTES");
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES: return read_value(&pref->min_alignment[1], buf, size, "MIN_ALIGNMENT_B_BYTES");
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES: return read_value(&pref->min_alignment[2], buf, size, "MIN_ALIGNMENT_C_BYTES");
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES: return read_value(&pref->min_alignment[3], buf, size, "MIN_ALIGNMENT_D_BYTES");
    case CUBLASLT_MATMUL_PREF_SEARCH_MODE: case CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK:
    case CUBLASLT_MATMUL_PREF_MAX_WAVES_COUNT: case CUBLASLT_MATMUL_PREF_IMPL_MASK:
      return CUBLAS_STATUS_SUCCESS;
  }
  return bad(CUBLAS_STATUS_NOT_SUPPORTED, "preference attribute not emulated");
}

// ---- heuristic and matmul --------------------------------------------------------------------------------------

// The emulated algorithm records the alignments it was chosen for (data[0..3]), the workspace it
// needs (data[4]), its rank in the heuristic's answer (data[5]) and whether cublasLtMatmul turns
// it down (data[6]: the test hooks); data[7] marks it as one of ours.
constexpr std::uint64_t algo_marker = 0x6c6c6d747261696eull;

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                                              cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                              cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
                                              cublasLtMatmulPreference_t pref, int requested,
                                              cublasLtMatmulHeuristicResult_t results[], int* returned) {
  if (!handle || handle->magic != handle_magic) return bad(CUBLAS_STATUS_NOT_INITIALIZED, "bad handle");
  if (!pref || requested < 1 || !results || !returned) return bad(CUBLAS_STATUS_INVALID_VALUE, "bad heuristic arguments");
  Shape shape;
  *returned = 0;
  if (const cublasStatus_t s = check_problem(desc, a, b, c, d, &shape)) return s;
  for (const std::uint32_t alignment : pref->min_alignment) {
    if (alignment == 0 || (alignment & (alignment - 1))) {
      return bad(CUBLAS_STATUS_INVALID_VALUE, "MIN_ALIGNMENT preferences must be powers of two");
    }
  }
  // Real cuBLASLt has no kernels for pointers less aligned than their element.
  const std::uint32_t element = std::uint32_t(type_bytes(a->type)), out_element = std::uint32_t(type_bytes(d->type));
  if (pref->min_alignment[0] < element || pref->min_alignment[1] < element || pref->min_alignment[2] < out_element ||
      pref->min_alignment[3] < out_element) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  llmtrain_emu::CublasLtCandidates candidates;
  {
    const std::lock_guard<std::mutex> lock(control().mutex);
    ++control().counts.heuristic_calls;
    candidates = control().candidates;
  }
  if (candidates.offered == 0) return CUBLAS_STATUS_NOT_SUPPORTED;  // cuBLASLt's answer when it has none
  const int count = std::min(requested, candidates.offered);
  for (int rank = 0; rank < count; ++rank) {
    cublasLtMatmulHeuristicResult_t& r = results[rank];
    std::memset(&r, 0, sizeof r);
    for (int i = 0; i < 4; ++i) r.algo.data[i] = pref->min_alignment[i];
    // Ranks after the first need some workspace (1 MiB each, within the preference's limit), so
    // that a caller passing less than the heuristic said is caught.
    r.workspaceSize = std::min<std::uint64_t>(pref->max_workspace, std::uint64_t(rank) << 20);
    r.algo.data[4] = r.workspaceSize;
    r.algo.data[5] = std::uint64_t(rank);
    r.algo.data[6] = rank < candidates.rejected ? 1 : 0;
    r.algo.data[7] = algo_marker;
    r.state = CUBLAS_STATUS_SUCCESS;
    r.wavesCount = 1.0f;
  }
  *returned = count;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, const void* alpha, const void* A,
                              cublasLtMatrixLayout_t a_desc, const void* B, cublasLtMatrixLayout_t b_desc,
                              const void* beta, const void* C, cublasLtMatrixLayout_t c_desc, void* D,
                              cublasLtMatrixLayout_t d_desc, const cublasLtMatmulAlgo_t* algo, void* workspace,
                              std::size_t workspace_bytes, cudaStream_t stream) {
  if (!handle || handle->magic != handle_magic) return bad(CUBLAS_STATUS_NOT_INITIALIZED, "bad handle");
  if (llmtrain_emu::sticky_error() != cudaSuccess) return CUBLAS_STATUS_EXECUTION_FAILED;
  if (!llmtrain_emu::check_stream(stream, "cublasLtMatmul")) return CUBLAS_STATUS_INVALID_VALUE;
  Shape shape;
  if (const cublasStatus_t s = check_problem(desc, a_desc, b_desc, c_desc, d_desc, &shape)) return s;
  if (!alpha || !beta) return bad(CUBLAS_STATUS_INVALID_VALUE, "null alpha or beta");
  if (desc->pointer_mode != CUBLAS_POINTER_MODE_HOST) {
    return bad(CUBLAS_STATUS_NOT_SUPPORTED, "device pointer mode not emulated");
  }
  const bool in_place = C == D;
  if (in_place && (c_desc->rows != d_desc->rows || c_desc->cols != d_desc->cols || c_desc->ld != d_desc->ld ||
                   c_desc->order != d_desc->order || c_desc->type != d_desc->type)) {
    return bad(CUBLAS_STATUS_INVALID_VALUE, "C and D are the same memory but their layouts differ");
  }
  // Pointers: device memory with room for every element, as aligned as the algorithm assumed.
  const void* pointers[4] = {A, B, C, D};
  const cublasLtMatrixLayoutEmu* layouts[4] = {a_desc, b_desc, c_desc, d_desc};
  const char* names[4] = {"A", "B", "C", "D"};
  for (int i = 0; i < 4; ++i) {
    const std::size_t bytes = span_bytes(*layouts[i]);
    if (bytes == 0) continue;
    if (!llmtrain_emu::check_device_range(pointers[i], bytes, (std::string("cublasLtMatmul ") + names[i]).c_str())) {
      return CUBLAS_STATUS_INVALID_VALUE;
    }
  }
  {
    const std::lock_guard<std::mutex> lock(control().mutex);
    ++control().counts.matmul_calls;
  }
  if (algo) {
    if (algo->data[7] != algo_marker) return bad(CUBLAS_STATUS_INVALID_VALUE, "the algorithm was not made by the heuristic");
    if (algo->data[6] != 0) {  // turned down by the test hooks, before anything is touched
      const std::lock_guard<std::mutex> lock(control().mutex);
      ++control().counts.rejected_calls;
      return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    if (workspace_bytes < algo->data[4]) {
      return bad(CUBLAS_STATUS_INVALID_VALUE, "workspace of " + std::to_string(workspace_bytes) +
                                                  " bytes, the algorithm needs " + std::to_string(algo->data[4]));
    }
    for (int i = 0; i < 4; ++i) {
      if (alignment_of(pointers[i]) < algo->data[i]) {
        return bad(CUBLAS_STATUS_EXECUTION_FAILED,
                   std::string("pointer ") + names[i] + " is " + std::to_string(alignment_of(pointers[i])) +
                       "-byte aligned, but the algorithm was chosen for " + std::to_string(algo->data[i]) +
                       "-byte alignment (MIN_ALIGNMENT_" + names[i] + "_BYTES): a GPU would fault or fail here");
      }
    }
  }
  if (workspace_bytes > 0 && !llmtrain_emu::check_device_range(workspace, workspace_bytes, "cublasLtMatmul workspace")) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }

  const double alpha_v = desc->scale_type == CUDA_R_64F ? *static_cast<const double*>(alpha) : *static_cast<const float*>(alpha);
  const double beta_v = desc->scale_type == CUDA_R_64F ? *static_cast<const double*>(beta) : *static_cast<const float*>(beta);
  const std::uint64_t m = shape.m, n = shape.n, k = shape.k;
  const bool ta = desc->trans_a == CUBLAS_OP_T, tb = desc->trans_b == CUBLAS_OP_T;
  const std::uint32_t epilogue = desc->epilogue;
  const int bias_type = desc->bias_type >= 0 ? desc->bias_type : d_desc->type;
  const std::size_t bias_len = epilogue == CUBLASLT_EPILOGUE_BGRADB ? n : m;
  if (desc->bias && !llmtrain_emu::check_device_range(desc->bias, bias_len * type_bytes(bias_type) +
                                                                       std::size_t(d_desc->batch - 1) *
                                                                           std::size_t(desc->bias_batch_stride) *
                                                                           type_bytes(bias_type),
                                                      "cublasLtMatmul bias")) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  const int aux_type = desc->aux_type >= 0 ? desc->aux_type : d_desc->type;
  if (uses_aux(epilogue) &&
      !llmtrain_emu::check_device_range(desc->aux, (std::size_t(n - 1) * std::size_t(desc->aux_ld) + m) * type_bytes(aux_type),
                                        "cublasLtMatmul epilogue aux")) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }

  // op(A) as m rows of k, op(B) as n rows of k, in double (rounded as the compute type reads them).
  std::vector<double> op_a(m * k), op_b(n * k), result(m * n);
  for (int batch = 0; batch < d_desc->batch; ++batch) {
    for (std::uint64_t i = 0; i < m; ++i)
      for (std::uint64_t p = 0; p < k; ++p)
        op_a[i * k + p] = round_input(load(A, ta ? at(*a_desc, p, i, batch) : at(*a_desc, i, p, batch), a_desc->type), desc->compute);
    for (std::uint64_t j = 0; j < n; ++j)
      for (std::uint64_t p = 0; p < k; ++p)
        op_b[j * k + p] = round_input(load(B, tb ? at(*b_desc, j, p, batch) : at(*b_desc, p, j, batch), b_desc->type), desc->compute);
    for (std::uint64_t j = 0; j < n; ++j) {
      const double* bj = &op_b[j * k];
      for (std::uint64_t i = 0; i < m; ++i) {
        const double* ai = &op_a[i * k];
        double acc = 0.0;
        for (std::uint64_t p = 0; p < k; ++p) acc += ai[p] * bj[p];
        double v = alpha_v * acc;
        if (beta_v != 0.0) v += beta_v * load(C, at(*c_desc, i, j, batch), c_desc->type);
        result[j * m + i] = v;
      }
    }
    const std::int64_t bias_offset = std::int64_t(batch) * desc->bias_batch_stride;
    const std::int64_t aux_offset = std::int64_t(batch) * desc->aux_batch_stride;
    for (std::uint64_t j = 0; j < n; ++j) {
      for (std::uint64_t i = 0; i < m; ++i) {
        double v = result[j * m + i];
        if (has_bias(epilogue)) v += load(desc->bias, bias_offset + std::int64_t(i), bias_type);
        const std::int64_t aux_at = aux_offset + std::int64_t(i) + std::int64_t(j) * desc->aux_ld;
        switch (epilogue) {
          case CUBLASLT_EPILOGUE_RELU: case CUBLASLT_EPILOGUE_RELU_BIAS: v = v > 0.0 ? v : 0.0; break;
          case CUBLASLT_EPILOGUE_GELU: case CUBLASLT_EPILOGUE_GELU_BIAS: v = gelu(v); break;
          case CUBLASLT_EPILOGUE_GELU_AUX: case CUBLASLT_EPILOGUE_GELU_AUX_BIAS:
            store(desc->aux, aux_at, aux_type, v);
            v = gelu(v);
            break;
          case CUBLASLT_EPILOGUE_DGELU: case CUBLASLT_EPILOGUE_DGELU_BGRAD:
            v *= gelu_grad(load(desc->aux, aux_at, aux_type));
            break;
          default: break;
        }
        result[j * m + i] = v;
      }
    }
    // Bias gradients are written (not accumulated), as cuBLASLt does.
    void* bias_out = const_cast<void*>(desc->bias);
    if (epilogue == CUBLASLT_EPILOGUE_DGELU_BGRAD) {
      for (std::uint64_t i = 0; i < m; ++i) {
        double s = 0.0;
        for (std::uint64_t j = 0; j < n; ++j) s += result[j * m + i];
        store(bias_out, bias_offset + std::int64_t(i), bias_type, s);
      }
    } else if (epilogue == CUBLASLT_EPILOGUE_BGRADA) {
      for (std::uint64_t i = 0; i < m; ++i) {
        double s = 0.0;
        for (std::uint64_t p = 0; p < k; ++p) s += op_a[i * k + p];
        store(bias_out, bias_offset + std::int64_t(i), bias_type, s);
      }
    } else if (epilogue == CUBLASLT_EPILOGUE_BGRADB) {
      for (std::uint64_t j = 0; j < n; ++j) {
        double s = 0.0;
        for (std::uint64_t p = 0; p < k; ++p) s += op_b[j * k + p];
        store(bias_out, bias_offset + std::int64_t(j), bias_type, s);
      }
    }
    for (std::uint64_t j = 0; j < n; ++j)
      for (std::uint64_t i = 0; i < m; ++i) store(D, at(*d_desc, i, j, batch), d_desc->type, result[j * m + i]);
  }
  {
    const std::lock_guard<std::mutex> lock(control().mutex);
    control().counts.last_rank = algo ? int(algo->data[5]) : -1;
  }
  return CUBLAS_STATUS_SUCCESS;
}
