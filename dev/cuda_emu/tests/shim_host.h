// A host communicator for the NCCL communicator on the NCCL shim: rank `rank` of `world`, of which
// only the broadcast of NCCL's id is used (the shim ignores the id, so nothing is sent).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "dist/communicator.h"

namespace llmtrain::test {

class ShimHost final : public dist::Communicator {
 public:
  explicit ShimHost(int world = 2, int rank = 0) : world_(world), rank_(rank) {}
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::string name() const override { return "shim-host"; }
  std::unique_ptr<dist::Communicator> split(int, int) override { return nullptr; }

 protected:
  void do_all_reduce_sum(float*, std::int64_t) override {}
  void do_all_reduce_sum(double*, std::int64_t) override {}
  void do_all_reduce_max(std::int64_t*, std::int64_t) override {}
  void do_all_reduce_max(float*, std::int64_t) override {}
  std::unique_ptr<dist::Request> do_start_all_reduce_sum(float*, std::int64_t) override { return nullptr; }
  std::unique_ptr<dist::Request> do_start_reduce_scatter_sum(const float*, float*, std::int64_t) override {
    return nullptr;
  }
  std::unique_ptr<dist::Request> do_start_all_gather(const void*, void*, std::int64_t, DType) override { return nullptr; }
  void do_broadcast(float*, std::int64_t, int) override {}
  void do_barrier() override {}
  std::unique_ptr<dist::Request> do_start_send(const void*, std::int64_t, DType, int) override { return nullptr; }
  std::unique_ptr<dist::Request> do_start_recv(void*, std::int64_t, DType, int) override { return nullptr; }
  std::unique_ptr<dist::Request> do_start_exchange(const void*, void*, std::int64_t, DType, int, int) override {
    return nullptr;
  }

 private:
  int world_, rank_;
};

}  // namespace llmtrain::test
