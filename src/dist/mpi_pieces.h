// The MPI communicator's calls (dist/mpi_communicator.cpp): status checks, and collectives and
// transfers made of several MPI calls ("pieces") where a count exceeds what an int holds.
#pragma once

#include <mpi.h>

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

// MPI counts are ints: a call of more elements is made in pieces of at most this many (fewer
// when LLMTRAIN_COMM_MAX_ELEMENTS says so).
inline std::int64_t mpi_piece_limit() { return piece_limit(std::numeric_limits<int>::max()); }

// A reduce-scatter in pieces packs piece j of every rank's block into one staging buffer: at most
// this many elements in all (1 GiB of floats), whatever the piece limit.
inline constexpr std::int64_t staging_elements = std::int64_t(1) << 28;

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
