// The op case registry, in the manner of ggml's test-backend-ops: each case of an op is written
// once, as data (its tensors with their shapes, roles and random ranges, its ops:: calls, the
// tolerances of its outputs, the bytes and FLOPs of each call), and run in two modes:
//
//   - check mode (test_cuda_ops: tests/cuda_ops_test.cpp, tests/op_check.cpp): over a grid of
//     shapes, each case on the CPU and on the GPU, the outputs compared within their tolerances;
//   - timing mode (bench/bench_kernels.cpp): at the model's shapes, each step (one row of the
//     table) timed on the GPU against the memory or matrix ceiling.
//
// An op builder (layernorm_case(N, C), ...) describes a case at any shape; the check grids (each
// family's file) and the model's shapes (op_timing_cases.cpp) call the same builders. Cases that
// only one mode runs are marked by their Use: check_only (grids of ops the benchmark does not
// time, e.g. rope), timing_only (attention, timed here and checked by tests/flash_attention_test.cpp
// and tests/flash_attention_bf16_test.cpp; each fused op's unfused sequence, timed beside it). Depends
// only on the ops:: API.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace llmtrain::ops {
struct AdamWParams;
}

namespace llmtrain::op_cases {

// ---- a case's tensors ------------------------------------------------------------------------

enum class Kind {
  act,  // the run's dtype: activations, their gradients, the weights an op reads
  f32,  // always f32: weight gradients and statistics (mean, rstd, losses), optimizer state
  i32,  // token ids
};
enum class Role {
  in,      // read only: must come back bit for bit
  out,     // overwritten (pre-filled with random values that must not survive)
  acc,     // accumulated into (+=), pre-filled with random values
  absent,  // passed as a tensor without data (no bias, no position table); must stay untouched
};
enum class Changes { no, yes, f32_only };  // whether an accumulating output must change
enum class Compare { values, change };     // change: compare (after - before), for an update

/// A normalised error allowed for an output, in an f32 run and in a bf16 run.
struct Tol {
  double f32, bf16;
};
inline constexpr Tol act_elementwise{1e-5, 1e-2};  // elementwise outputs in the run's dtype
inline constexpr Tol act_reduction{1e-4, 1e-2};    // matmul and reduction outputs in the run's dtype
inline constexpr Tol f32_elementwise{1e-5, 2e-3};  // f32 outputs: statistics, losses
inline constexpr Tol f32_reduction{1e-4, 2e-3};    // f32 outputs summed over rows: weight gradients
// f32 sums over rows of an intermediate that a bf16 run rounds to bf16 and the reference keeps in
// f32 (the fused MLP's GELU output and dpre): one more bf16 rounding inside.
inline constexpr Tol f32_reduction_of_bf16{1e-4, 1e-2};

using Shape = std::vector<std::int64_t>;

struct Arg {
  std::string name;
  Shape shape;
  Kind kind = Kind::act;
  Role role = Role::in;
  float lo = -1.0f, hi = 1.0f;  // uniform random values in [lo, hi); i32: token ids in [lo, hi)
  Tol tol{0.0, 0.0};            // outputs only
  Changes changes = Changes::no;
  Compare compare = Compare::values;
  double scale_floor = 0.0;  // errors normalised by at least this (see losses)
};

/// A read-only tensor of the run's dtype, uniform in [lo, hi).
Arg input(std::string name, Shape shape, float lo = -1.0f, float hi = 1.0f);
/// Token ids (B,T) or (N) in [0, V).
Arg tokens(std::string name, Shape shape, int V);
/// An overwritten output, compared within `tol`.
Arg output(std::string name, Shape shape, Tol tol);
/// An output accumulated into (+=), compared within `tol`.
Arg accumulated(std::string name, Shape shape, Tol tol, Changes changes = Changes::yes);
/// `a`, always f32 whatever the run's dtype.
Arg always_f32(Arg a);
/// `a`, or an absent tensor when not `present`.
Arg present_if(bool present, Arg a);
/// `a` with random values in [lo, hi).
Arg range(float lo, float hi, Arg a);

/// The dtype of `a` in a run whose activations are `act`.
DType dtype_in_run(const Arg& a, DType act);
/// The number of elements of a shape.
std::size_t numel(const Shape& shape);
/// A tensor of this shape over `data` (throws past Tensor::max_dims).
Tensor view(void* data, DType dtype, Device device, const Shape& shape);

/// The tensors of one run of a case, by name; an absent one is a Tensor without data.
class Args {
 public:
  void add(const std::string& name, const Tensor& t) {
    names_.push_back(name);
    tensors_.push_back(t);
  }
  const Tensor& operator[](std::string_view name) const {
    for (std::size_t i = 0; i < names_.size(); ++i) {
      if (names_[i] == name) return tensors_[i];
    }
    throw std::logic_error("op case has no tensor named " + std::string(name));
  }

 private:
  std::vector<std::string> names_;
  std::vector<Tensor> tensors_;
};

// ---- a case ----------------------------------------------------------------------------------

/// One call of a case (a forward, a backward): check mode runs a case's steps in order; timing
/// mode times each as one row of the table.
struct Step {
  std::string name;                          // the row: "layernorm_forward"
  std::function<double(const Args&)> call;  // the ops:: calls; returns the op's result, or 0
  // The least the call must move (each input read once, each output written once, an
  // accumulated one read and written): activation elements, times the run's element size, plus
  // bytes of f32 (and i32) tensors. FLOPs: 2 per multiply-add. A step with FLOPs is
  // compute-bound (its row is against the matrix peak), else memory-bound.
  double act_elements = 0.0, fixed_bytes = 0.0, flops = 0.0;
  bool timed = true;  // false: timing mode runs it once, untimed (it prepares what later steps read)

  /// The bytes of the step in a run whose activations are `act`.
  double bytes(DType act) const { return act_elements * double(dtype_size(act)) + fixed_bytes; }
};

enum class Use { check_and_time, check_only, timing_only };

struct OpCase {
  OpCase(std::string op_name, std::string shape_desc) : op(std::move(op_name)), shape(std::move(shape_desc)) {}

  std::string op;     // which test case runs it: "layernorm"
  std::string shape;  // "N=64 C=127"; in timing mode the rows' shape column
  std::vector<Arg> args;
  std::vector<Step> steps;
  // When set, the reference runs this instead of the steps, told the run's dtype: for a fused op
  // whose bf16 kernel rounds an intermediate to bf16 that the f32 reference would keep.
  std::function<double(const Args&, DType)> reference;
  std::vector<DType> dtypes{DType::f32, DType::bf16};
  std::size_t offset = 0;           // leading sentinels of every device tensor (1: misaligned views)
  std::optional<Tol> result_tol;    // compare the steps' result too, relative to
  double result_scale_floor = 0.0;  // max(|reference|, this)
  int runs = 1;                     // > 1: repeated device runs must agree bit for bit
  Use use = Use::check_and_time;
  std::string skip;  // timing mode: why the case cannot run here (its rows say "skipped: " this)

  /// "layernorm bf16 N=64 C=127 offset=1": the check-mode name (it seeds the inputs).
  std::string name(DType dtype) const {
    return op + " " + dtype_name(dtype) + " " + shape + " offset=" + std::to_string(offset);
  }
  /// Runs every step in order; the last step's result.
  double run(const Args& a) const {
    double result = 0.0;
    for (const Step& s : steps) result = s.call(a);
    return result;
  }
  /// The tensor named `name` (to change its range or role at one shape).
  Arg& arg(std::string_view name);
};

/// "B=2 T=17 C=64": dimensions by name.
std::string shape_name(std::initializer_list<std::pair<const char*, std::int64_t>> dims);

// ---- the op builders: one case of an op at one shape -----------------------------------------
// Each is the op's only description; the check grids and the model's shapes both call it.

/// encoder_forward then encoder_backward: tokens (B,T) of a vocabulary of V, position table of
/// maxT rows (absent without positions).
OpCase encoder_case(std::int64_t B, std::int64_t T, std::int64_t C, std::int64_t V, std::int64_t maxT,
                    bool positions);
/// layernorm_forward then layernorm_backward over (N,C).
OpCase layernorm_case(std::int64_t N, std::int64_t C);
/// layernorm_residual_forward over (N,C): residual = a + b, then its LayerNorm.
OpCase layernorm_residual_case(std::int64_t N, std::int64_t C);
/// residual_forward then residual_backward, elementwise over `shape`.
OpCase residual_case(std::string label, const Shape& shape);
/// gelu_forward then gelu_backward, elementwise over `shape`.
OpCase gelu_case(std::string label, const Shape& shape);
/// matmul_forward (N,C) x (OC,C)^T into rows of ld >= OC, then matmul_backward, accumulating into
/// dinp or (overwrite) as its first writer.
OpCase matmul_case(std::int64_t N, std::int64_t C, std::int64_t OC, bool with_bias, bool overwrite,
                   std::int64_t ld);
/// GPT-2's MLP fused: matmul_gelu_forward (c_fc (F,C) with its GELU), then matmul_backward_dgelu
/// (c_proj (OC,F)'s backward through the GELU).
OpCase matmul_gelu_case(std::int64_t N, std::int64_t C, std::int64_t F, std::int64_t OC, bool with_bias);
/// fused_classifier over logits (N, columns V of rows of ld); scale 0: losses only.
OpCase fused_classifier_case(std::int64_t N, std::int64_t V, float scale, std::int64_t ld);
/// sum_squares over N f32 elements, uniform in [lo, hi).
OpCase sum_squares_case(std::int64_t N, float lo, float hi);
/// adamw_update of N f32 parameters with their gradient and moments.
OpCase adamw_case(std::int64_t N, const ops::AdamWParams& p);
/// muon_momentum of N f32 momentum elements with their gradient, writing u.
OpCase muon_momentum_case(std::int64_t N, float momentum, bool nesterov);
/// muon_apply of N f32 parameters with the orthogonalised update; `working`: a bf16 run that also
/// writes the bf16 working copy (else an f32 run without one).
OpCase muon_apply_case(std::int64_t N, bool working);

/// Mixture of Experts (moe_cases.cpp): moe_router_forward then _backward over logits (N,E), top k;
/// moe_dispatch with the permutation and combination of N k slots of C channels (capacity 0:
/// dropless); grouped_matmul_forward and _backward over R rows of E experts' (OC,C) weights (their
/// offsets from moe_dispatch); moe_bias_update of E experts. Every case of them.
OpCase moe_router_case(std::int64_t N, std::int64_t E, std::int64_t k, bool sigmoid, bool bias);
OpCase moe_dispatch_case(std::int64_t N, std::int64_t E, std::int64_t k, std::int64_t C, std::int64_t capacity);
OpCase grouped_matmul_case(std::int64_t R, std::int64_t E, std::int64_t C, std::int64_t OC);
OpCase moe_bias_update_case(std::int64_t E);

// ---- the registry ----------------------------------------------------------------------------
// Each family of ops has one file (norm_cases.cpp, matmul_cases.cpp, moe_cases.cpp, ...): its
// builders and its check grids, which it registers where it defines them
// (`[[maybe_unused]] const bool registered = register_check_grid(grid);`). CMake compiles every
// file of this folder into the programs that use the registry, so a new family is one new file.

/// Adds a grid (a function returning cases) to check_cases(); returns true.
bool register_check_grid(std::vector<OpCase> (*grid)());
/// Every check-mode case of every registered grid, by op (the name of its test cases).
const std::map<std::string, std::vector<OpCase>>& check_cases();

/// The shapes the grids share: odd sizes, sizes that take the 128-bit paths (64 and 768 channels:
/// 4 f32 or 8 bf16 per access), and the real model's sizes. (B, T) pairs, channel counts, and
/// element counts for 1-D ops.
extern const std::vector<std::pair<int, int>> batch_shapes;
extern const std::vector<int> channel_sizes;
extern const std::vector<std::int64_t> element_counts;
/// Adds `c` to `cases` once per offset (each case runs aligned and one element off).
void add(std::vector<OpCase>& cases, const OpCase& c, std::initializer_list<std::size_t> offsets = {0, 1});

/// The shapes timing mode runs at: a GPT-2 model's (B x T tokens, C channels, NH heads, a
/// vocabulary of V) and its activations' dtype.
struct ModelShape {
  std::int64_t B, T, C, NH, V;
  DType dtype;
};
/// Every timing-mode case at the model's shapes, in the order of the table's rows.
std::vector<OpCase> timing_cases(const ModelShape& m);

}  // namespace llmtrain::op_cases
