// Context parallelism's part outside the model: the model's key/value exchanges over a
// dist::Communicator of the context-parallel group.
#pragma once

#include "dist/communicator.h"
#include "model/context_parallel.h"

namespace llmtrain::parallel {

/// model::ContextGroup over a communicator of the context-parallel group (the memory the
/// activations live in).
class CommContextGroup final : public model::ContextGroup {
 public:
  explicit CommContextGroup(dist::Communicator& comm) : comm_(comm) {}
  std::unique_ptr<Pending> start_exchange(const Tensor& send, const Tensor& recv, int send_to,
                                          int recv_from) override;
  void all_gather(const Tensor& part, const Tensor& full) override;
  void reduce_scatter(const Tensor& full, const Tensor& part) override;

 private:
  dist::Communicator& comm_;
};

}  // namespace llmtrain::parallel
