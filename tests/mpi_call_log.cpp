// The profiling-interface wrappers behind tests/mpi_call_log.h.
#include "mpi_call_log.h"

#include <mpi.h>

#include <algorithm>

namespace llmtrain::test {

MpiCalls& mpi_calls() {
  static MpiCalls calls;
  return calls;
}

namespace {

void note(MpiCalls::Kind kind, int count, int ranks, MPI_Datatype type) {
  int size = 0;
  PMPI_Type_size(type, &size);
  MpiCalls& log = mpi_calls();
  const std::int64_t total = std::int64_t(count) * ranks;
  log.calls[kind] += 1;
  log.largest_count[kind] = std::max<std::int64_t>(log.largest_count[kind], count);
  log.largest_total[kind] = std::max(log.largest_total[kind], total);
  log.largest_bytes[kind] = std::max(log.largest_bytes[kind], total * size);
}

int ranks_of(MPI_Comm comm) {
  int size = 0;
  PMPI_Comm_size(comm, &size);
  return size;
}

}  // namespace
}  // namespace llmtrain::test

using llmtrain::test::MpiCalls;

extern "C" int MPI_Iallreduce(const void* sendbuf, void* recvbuf, int count, MPI_Datatype datatype, MPI_Op op,
                              MPI_Comm comm, MPI_Request* request) {
  llmtrain::test::note(MpiCalls::all_reduce, count, 1, datatype);
  return PMPI_Iallreduce(sendbuf, recvbuf, count, datatype, op, comm, request);
}

extern "C" int MPI_Ireduce_scatter_block(const void* sendbuf, void* recvbuf, int recvcount, MPI_Datatype datatype,
                                         MPI_Op op, MPI_Comm comm, MPI_Request* request) {
  llmtrain::test::note(MpiCalls::reduce_scatter, recvcount, llmtrain::test::ranks_of(comm), datatype);
  return PMPI_Ireduce_scatter_block(sendbuf, recvbuf, recvcount, datatype, op, comm, request);
}

extern "C" int MPI_Iallgather(const void* sendbuf, int sendcount, MPI_Datatype sendtype, void* recvbuf, int recvcount,
                              MPI_Datatype recvtype, MPI_Comm comm, MPI_Request* request) {
  llmtrain::test::note(MpiCalls::all_gather, recvcount, llmtrain::test::ranks_of(comm), recvtype);
  return PMPI_Iallgather(sendbuf, sendcount, sendtype, recvbuf, recvcount, recvtype, comm, request);
}

extern "C" int MPI_Ibcast(void* buffer, int count, MPI_Datatype datatype, int root, MPI_Comm comm,
                          MPI_Request* request) {
  llmtrain::test::note(MpiCalls::broadcast, count, 1, datatype);
  return PMPI_Ibcast(buffer, count, datatype, root, comm, request);
}
