#include <cstring>

#include "core/error.h"
#include "dist/communicator.h"

namespace llmtrain::dist {
namespace {

class Done final : public Request {
 public:
  void wait() override {}
};

class SingleCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  std::string name() const override { return "single"; }
  std::unique_ptr<Communicator> split(int, int) override { return std::make_unique<SingleCommunicator>(); }

 protected:
  void do_all_reduce_sum(float*, std::int64_t) override {}
  void do_all_reduce_sum(double*, std::int64_t) override {}
  void do_all_reduce_max(std::int64_t*, std::int64_t) override {}
  void do_all_reduce_max(float*, std::int64_t) override {}
  std::unique_ptr<Request> do_start_all_reduce_sum(float*, std::int64_t) override { return std::make_unique<Done>(); }
  // Host memory only (on a GPU one rank has no device communicator): a copy unless in place.
  std::unique_ptr<Request> do_start_reduce_scatter_sum(const float* send, float* recv, std::int64_t shard) override {
    if (send != recv) std::memmove(recv, send, std::size_t(shard) * sizeof(float));
    return std::make_unique<Done>();
  }
  std::unique_ptr<Request> do_start_all_gather(const void* send, void* recv, std::int64_t shard, DType dtype) override {
    if (send != recv) std::memmove(recv, send, std::size_t(shard) * dtype_size(dtype));
    return std::make_unique<Done>();
  }
  void do_broadcast(float*, std::int64_t, int) override {}
  void do_barrier() override {}
  // Communicator::check_transfer refuses every peer of a one-rank group before these.
  std::unique_ptr<Request> do_start_send(const void*, std::int64_t, DType, int) override { no_peer(); }
  std::unique_ptr<Request> do_start_recv(void*, std::int64_t, DType, int) override { no_peer(); }
  std::unique_ptr<Request> do_start_exchange(const void*, void*, std::int64_t, DType, int, int) override { no_peer(); }

 private:
  [[noreturn]] static void no_peer() { throw RuntimeError("no peer on a one-rank communicator"); }
};

}  // namespace

std::unique_ptr<Communicator> make_single_communicator() { return std::make_unique<SingleCommunicator>(); }

}  // namespace llmtrain::dist
