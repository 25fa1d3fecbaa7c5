// Test hooks of the emulated cuBLASLt (runtime/cublaslt.cpp): how many algorithms the heuristic
// offers, how many of them cublasLtMatmul turns down, and counts of the calls, so that a test
// can drive the matmul's algorithm fallback (kernels/cuda/matmul.cu) without a GPU.
#pragma once

#include <cstdint>

namespace llmtrain_emu {

struct CublasLtCandidates {
  /// Algorithms the heuristic returns (at most the number requested). 0: none, and the
  /// heuristic returns CUBLAS_STATUS_NOT_SUPPORTED, as cuBLASLt does for a problem it cannot run.
  int offered = 4;
  /// The first `rejected` algorithms offered fail in cublasLtMatmul with CUBLAS_STATUS_NOT_SUPPORTED
  /// (before touching any memory). Fixed in each algorithm when the heuristic returns it.
  int rejected = 0;
};

/// What later heuristic calls offer. The defaults come from LLMTRAIN_EMU_CUBLASLT_OFFERED (4) and
/// LLMTRAIN_EMU_CUBLASLT_REJECTED (0), so a whole test run can exercise the fallback.
void set_cublaslt_candidates(CublasLtCandidates candidates);
CublasLtCandidates cublaslt_candidates();

struct CublasLtCounts {
  std::int64_t heuristic_calls = 0;  // cublasLtMatmulAlgoGetHeuristic
  std::int64_t matmul_calls = 0;     // cublasLtMatmul, the rejected ones included
  std::int64_t rejected_calls = 0;   // cublasLtMatmul calls turned down as set above
  int last_rank = -1;                // the heuristic's rank (0: first) of the last algorithm that ran
};

/// The counts since the process started.
CublasLtCounts cublaslt_counts();

}  // namespace llmtrain_emu
