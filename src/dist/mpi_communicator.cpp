// MPI over host memory. Every collective is started non-blocking and polled, so that one that
// does not finish within the timeout (a rank died or hangs) stops the job with a clear message
// instead of hanging it.
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <thread>

#include "core/error.h"
#include "dist/communicator.h"

namespace llmtrain::dist {
namespace {

class MpiCommunicator;

void check(int status, const char* call) {
  if (status != MPI_SUCCESS) {
    char text[MPI_MAX_ERROR_STRING];
    int length = 0;
    MPI_Error_string(status, text, &length);
    throw RuntimeError(std::string("MPI error in ") + call + ": " + std::string(text, std::size_t(length)));
  }
}

int as_count(std::int64_t count) {
  if (count > std::numeric_limits<int>::max()) throw RuntimeError("MPI: a collective of more than 2^31 elements");
  return static_cast<int>(count);
}

class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(double timeout_s) : timeout_s_(timeout_s) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      int provided = 0;
      check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread");
      owns_mpi_ = true;
    }
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &world_);
  }
  ~MpiCommunicator() override {
    if (owns_mpi_) MPI_Finalize();
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::string name() const override { return "mpi"; }

  void all_reduce_sum(float* data, std::int64_t count) override {
    MPI_Request r;
    check(MPI_Iallreduce(MPI_IN_PLACE, data, as_count(count), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD, &r), "MPI_Iallreduce");
    wait(r, "all_reduce");
  }
  void all_reduce_sum(double* data, std::int64_t count) override {
    MPI_Request r;
    check(MPI_Iallreduce(MPI_IN_PLACE, data, as_count(count), MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD, &r), "MPI_Iallreduce");
    wait(r, "all_reduce");
  }
  void all_reduce_max(std::int64_t* data, std::int64_t count) override {
    MPI_Request r;
    check(MPI_Iallreduce(MPI_IN_PLACE, data, as_count(count), MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD, &r),
          "MPI_Iallreduce");
    wait(r, "all_reduce (max)");
  }

  std::unique_ptr<Request> start_all_reduce_sum(float* data, std::int64_t count) override {
    auto request = std::make_unique<Pending>(*this);
    check(MPI_Iallreduce(MPI_IN_PLACE, data, as_count(count), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD, &request->mpi),
          "MPI_Iallreduce");
    return request;
  }

  void reduce_scatter_sum(const float* send, float* recv, std::int64_t shard) override {
    MPI_Request r;
    check(MPI_Ireduce_scatter_block(send, recv, as_count(shard), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD, &r),
          "MPI_Ireduce_scatter_block");
    wait(r, "reduce_scatter");
  }

  void all_gather(const float* send, float* recv, std::int64_t shard) override {
    MPI_Request r;
    // This rank's part already in place in recv is MPI_IN_PLACE (MPI forbids overlapping buffers).
    const void* source = send == recv + rank_ * shard ? MPI_IN_PLACE : send;
    check(MPI_Iallgather(source, as_count(shard), MPI_FLOAT, recv, as_count(shard), MPI_FLOAT, MPI_COMM_WORLD, &r),
          "MPI_Iallgather");
    wait(r, "all_gather");
  }

  void broadcast(float* data, std::int64_t count, int root) override {
    MPI_Request r;
    check(MPI_Ibcast(data, as_count(count), MPI_FLOAT, root, MPI_COMM_WORLD, &r), "MPI_Ibcast");
    wait(r, "broadcast");
  }

  void barrier() override {
    MPI_Request r;
    check(MPI_Ibarrier(MPI_COMM_WORLD, &r), "MPI_Ibarrier");
    wait(r, "barrier");
  }

  // Polls until done; past the timeout, stops every rank (MPI_Abort) with a message.
  void wait(MPI_Request& request, const char* operation) {
    const auto start = std::chrono::steady_clock::now();
    int done = 0;
    for (int spins = 0;; ++spins) {
      check(MPI_Test(&request, &done, MPI_STATUS_IGNORE), "MPI_Test");
      if (done) return;
      if (spins > 1000) std::this_thread::sleep_for(std::chrono::microseconds(50));
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (waited > timeout_s_) {
        std::fprintf(stderr,
                     "llmtrain: error: rank %d: %s did not finish within dist.timeout_s = %.0f s: another rank "
                     "died or hangs; stopping every rank\n",
                     rank_, operation, timeout_s_);
        std::fflush(stderr);
        MPI_Abort(MPI_COMM_WORLD, 1);
        std::_Exit(1);
      }
    }
  }

 private:
  struct Pending final : Request {
    explicit Pending(MpiCommunicator& c) : comm(c) {}
    void wait() override { comm.wait(mpi, "all_reduce (gradient bucket)"); }
    MpiCommunicator& comm;
    MPI_Request mpi = MPI_REQUEST_NULL;
  };

  double timeout_s_;
  bool owns_mpi_ = false;
  int rank_ = 0;
  int world_ = 1;
};

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator(double timeout_s) {
  return std::make_unique<MpiCommunicator>(timeout_s);
}

}  // namespace llmtrain::dist
