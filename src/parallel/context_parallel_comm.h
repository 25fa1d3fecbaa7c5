// Context parallelism's part outside the model: the model's key/value exchanges over a
// dist::Communicator of the context-parallel group.
#pragma once

#include "dist/communicator.h"
#include "parallel/context_attention.h"

namespace llmtrain::parallel {

/// ContextGroup over communicators of the context-parallel group: `comm` in the memory the
/// activations live in, `host` in host memory.
class CommContextGroup final : public ContextGroup {
 public:
  CommContextGroup(dist::Communicator& comm, dist::Communicator& host) : comm_(comm), host_(host) {}
  std::unique_ptr<Pending> start_exchange(const Tensor& send, const Tensor& recv, int send_to,
                                          int recv_from) override;
  void all_gather(const Tensor& part, const Tensor& full) override;
  void reduce_scatter(const Tensor& full, const Tensor& part) override;
  void sum(std::vector<double>& values) override;

 private:
  dist::Communicator& comm_;
  dist::Communicator& host_;
};

}  // namespace llmtrain::parallel
