// Every CUDA op against its CPU reference, over the check grids of the op case registry
// (op_cases.h: the cases; op_check.h: how a case is run and compared). Each op has one Catch2
// test case per dtype ("cuda layernorm bf16 matches the cpu reference"); a failure names the case
// ("layernorm bf16 N=64 C=127 offset=1") and the tensor. Without a GPU every [cuda] case skips
// visibly; the registry's own tests below run on the CPU.
#include <algorithm>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "catch_compat.h"
#include "op_cases.h"
#include "op_check.h"
#include "ops/ops.h"

using namespace llmtrain;
using namespace llmtrain::test;
using op_cases::Arg;
using op_cases::OpCase;
using op_cases::Role;
using op_cases::Use;

namespace {

// The ops that have test cases (filled by LLMTRAIN_OP_TEST), to check that none is left out.
std::set<std::string>& ops_with_test_cases() {
  static std::set<std::string> names;
  return names;
}
bool register_op_test(const char* op) { return ops_with_test_cases().insert(op).second; }

}  // namespace

#define LLMTRAIN_CONCAT_(a, b) a##b
#define LLMTRAIN_CONCAT(a, b) LLMTRAIN_CONCAT_(a, b)
// The test cases of one op: "cuda OP f32 matches the cpu reference" [cuda][ops] and, for an op
// with bf16 kernels, "cuda OP bf16 ..." [cuda][bf16].
#define LLMTRAIN_OP_TEST_F32(op)                                                                             \
  [[maybe_unused]] static const bool LLMTRAIN_CONCAT(registered_op_test_, __LINE__) = register_op_test(op); \
  TEST_CASE("cuda " op " f32 matches the cpu reference", "[cuda][ops]") { run_op_cases(op, DType::f32); }
#define LLMTRAIN_OP_TEST(op) \
  LLMTRAIN_OP_TEST_F32(op)   \
  TEST_CASE("cuda " op " bf16 matches the cpu reference", "[cuda][bf16]") { run_op_cases(op, DType::bf16); }

LLMTRAIN_OP_TEST("encoder")
LLMTRAIN_OP_TEST("encoder_backward deterministic")
LLMTRAIN_OP_TEST("layernorm")
LLMTRAIN_OP_TEST("layernorm_residual")
LLMTRAIN_OP_TEST("matmul")
LLMTRAIN_OP_TEST("matmul_gelu")
LLMTRAIN_OP_TEST("attention_decode")
LLMTRAIN_OP_TEST("gelu")
LLMTRAIN_OP_TEST("residual")
LLMTRAIN_OP_TEST("swiglu")
LLMTRAIN_OP_TEST("rmsnorm")
LLMTRAIN_OP_TEST("rope")
LLMTRAIN_OP_TEST("fused_classifier")
LLMTRAIN_OP_TEST("vocab_parallel")
LLMTRAIN_OP_TEST_F32("sum_squares")
LLMTRAIN_OP_TEST_F32("adamw_update")
LLMTRAIN_OP_TEST_F32("muon_momentum")
LLMTRAIN_OP_TEST("muon_apply")
// Newton-Schulz's products (kernels/cuda/matmul.cu) and its other steps (kernels/cuda/newton_schulz.cu).
LLMTRAIN_OP_TEST("batched_matmul")
LLMTRAIN_OP_TEST("newton_schulz_normalise")
LLMTRAIN_OP_TEST("transpose")
LLMTRAIN_OP_TEST("scaled_sum")
// Mixture of Experts (kernels/cuda/moe.cu, grouped_matmul.cu).
LLMTRAIN_OP_TEST("moe_router")
LLMTRAIN_OP_TEST("moe_dispatch")
LLMTRAIN_OP_TEST("grouped_matmul")
LLMTRAIN_OP_TEST_F32("moe_bias_update")

// Runs without a GPU: the table itself.
TEST_CASE("every op case has a test case, outputs with tolerances, and runs on the cpu", "[ops]") {
  std::set<std::string> in_table;
  for (const auto& [op, cases] : op_cases::check_cases()) {
    in_table.insert(op);
    std::set<std::string> names;
    for (const OpCase& c : cases) {
      CHECK(c.use != Use::timing_only);
      CHECK(!c.steps.empty());
      for (const DType dtype : c.dtypes) {
        INFO(c.name(dtype));
        CHECK(names.insert(c.name(dtype)).second);  // no case twice
        int outputs = 0;
        for (const Arg& a : c.args) {
          if (a.role != Role::out && a.role != Role::acc) continue;
          ++outputs;
          CHECK((dtype == DType::bf16 ? a.tol.bf16 : a.tol.f32) > 0.0);
        }
        CHECK((outputs > 0 || c.result_tol));
      }
    }
    // The first (smallest) case: every tensor the ops:: calls name exists, and the shapes fit.
    std::mt19937 rng(1);
    std::vector<HostValues> inputs;
    for (const Arg& a : cases.front().args) {
      inputs.push_back(random_values(a, op_cases::dtype_in_run(a, DType::f32), rng));
    }
    INFO(cases.front().name(DType::f32));
    CHECK_NOTHROW(run_reference(cases.front(), inputs));
  }
  CHECK(in_table == ops_with_test_cases());
}

// Runs without a GPU: the timing cases (bench_kernels' rows) at a small model's shapes, each on
// the CPU, so that a timing-only entry names its tensors right before a GPU ever runs it.
TEST_CASE("every timing op case (a bench_kernels row) runs on the cpu at small shapes, rows named once", "[ops]") {
  const op_cases::ModelShape m{1, 16, 32, 2, 100, DType::f32};
  const std::vector<OpCase> cases = op_cases::timing_cases(m);
  REQUIRE(!cases.empty());
  std::set<std::string> rows;
  for (const OpCase& c : cases) {
    INFO(c.op << " " << c.shape);
    CHECK(c.use != Use::check_only);
    int timed = 0;
    for (const auto& s : c.steps) {
      if (!s.timed) continue;
      ++timed;
      CHECK(rows.insert(s.name).second);  // one row per name
      CHECK((s.flops > 0.0 || s.bytes(m.dtype) > 0.0));
    }
    CHECK(timed > 0);
    if (!c.skip.empty()) continue;  // cuDNN's attention, the bf16 single pass
    std::mt19937 rng(2);
    std::vector<HostValues> inputs;
    for (const Arg& a : c.args) inputs.push_back(random_values(a, op_cases::dtype_in_run(a, m.dtype), rng));
    CHECK_NOTHROW(run_reference(c, inputs));
  }
  for (const char* row : {"encoder_forward", "layernorm_backward", "matmul_forward lm_head", "attention_backward flash",
                          "fused_classifier (unpadded rows)", "adamw_update", "sum_squares (grad norm)"}) {
    CHECK(rows.count(row) == 1);
  }
}
