// The MPI communicator's calls (dist/mpi_communicator.cpp): status checks, and collectives and
// transfers made of several MPI calls ("pieces") where a count, a total over the ranks or a byte
// offset would exceed what an int holds.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/tensor.h"
#include "dist/communicator.h"

namespace llmtrain::dist {

/// RuntimeError naming `call` and MPI's text unless `status` is MPI_SUCCESS.
inline void check(int status, const char* call) {
  if (status != MPI_SUCCESS) {
    char text[MPI_MAX_ERROR_STRING];
    int length = 0;
    MPI_Error_string(status, text, &length);
    throw RuntimeError(std::string("MPI error in ") + call + ": " + std::string(text, std::size_t(length)));
  }
}

// MPI counts are ints: a transfer of more elements is made in pieces of at most this many (fewer
// when LLMTRAIN_COMM_MAX_ELEMENTS says so).
inline std::int64_t mpi_piece_limit() { return piece_limit(std::numeric_limits<int>::max()); }

// Open MPI's non-blocking collectives (libnbc) compute more than the count in int: a
// reduce-scatter's ranks x count, and byte offsets into the buffers. Each call of a collective is
// kept so that every one of those stays within an int: at most this many bytes in all (fewer when
// LLMTRAIN_COMM_MAX_BYTES says so).
inline std::int64_t mpi_byte_limit() {
  return piece_limit(std::numeric_limits<int>::max(), "LLMTRAIN_COMM_MAX_BYTES");
}

// A reduce-scatter in pieces goes through one staging buffer holding piece j of every rank's
// block: at most this many bytes (1 GiB), whatever the limits.
inline constexpr std::int64_t staging_bytes = std::int64_t(1) << 30;

/// Elements per rank of one call of a collective over `ranks` blocks of `size`-byte elements (1
/// block for an all-reduce or broadcast): the count, the total ranks x count and the total bytes
/// all within the limits above. At least 1, so that a call always moves something.
inline std::int64_t collective_piece(int ranks, std::size_t size) {
  const std::int64_t by_count = mpi_piece_limit() / ranks;
  const std::int64_t by_bytes = mpi_byte_limit() / (std::int64_t(ranks) * std::int64_t(size));
  return std::max<std::int64_t>(1, std::min(by_count, by_bytes));
}

/// The same for a call through the staging buffer.
inline std::int64_t staged_piece(int ranks, std::size_t size) {
  const std::int64_t by_staging = staging_bytes / (std::int64_t(ranks) * std::int64_t(size));
  return std::max<std::int64_t>(1, std::min(collective_piece(ranks, size), by_staging));
}

// Transfers move elements as they are: 16-bit ones (bf16, u16) as words.
inline MPI_Datatype element_type(DType dtype) {
  switch (dtype) {
    case DType::f32: return MPI_FLOAT;
    case DType::i32: return MPI_INT32_T;
    case DType::bf16:
    case DType::u16: return MPI_UINT16_T;
  }
  return MPI_BYTE;
}

// One message of a transfer in flight, and whom to blame when it never finishes.
struct TransferPart {
  MPI_Request mpi = MPI_REQUEST_NULL;
  std::string blame;  // "rank 2 never received it"
};

// One collective made of one MPI call or several (pieces, when a count exceeds the piece limit):
// the calls in flight, and those still to start, each once every call before it has finished
// (pieces that share a staging buffer). Datatypes made for the pieces are freed when all are done.
struct Pieces {
  std::vector<MPI_Request> active;
  std::vector<std::function<void(Pieces&)>> later;
  std::size_t next = 0;
  std::vector<MPI_Datatype> types;
  std::vector<float> staging;

  MPI_Request& add() { return active.emplace_back(MPI_REQUEST_NULL); }
  // Whether every piece has finished; starts the next deferred one when those in flight have.
  bool test() {
    int done = 0;
    check(MPI_Testall(int(active.size()), active.data(), &done, MPI_STATUSES_IGNORE), "MPI_Testall");
    if (!done) return false;
    active.clear();
    if (next < later.size()) {
      later[next++](*this);
      return false;
    }
    for (MPI_Datatype& type : types) MPI_Type_free(&type);
    types.clear();
    return true;
  }
};

}  // namespace llmtrain::dist
