// The collectives this process hands MPI, as MPI sees them: the test binary defines
// MPI_Iallreduce, MPI_Ireduce_scatter_block, MPI_Iallgather and MPI_Ibcast (MPI's profiling
// interface), which note each call's numbers and pass it on to PMPI_*. Tests check from it that a
// collective in pieces keeps every count, total and byte count MPI computes within the limits.
#pragma once

#include <cstdint>

namespace llmtrain::test {

struct MpiCalls {
  enum Kind { all_reduce, reduce_scatter, all_gather, broadcast, kinds };
  std::int64_t calls[kinds] = {};
  std::int64_t largest_count[kinds] = {};  // one rank's count
  std::int64_t largest_total[kinds] = {};  // every rank's block: ranks x count (all-reduce: count)
  std::int64_t largest_bytes[kinds] = {};  // the total in bytes
};

/// The calls made since the last reset (assign MpiCalls{} to reset).
MpiCalls& mpi_calls();

}  // namespace llmtrain::test
