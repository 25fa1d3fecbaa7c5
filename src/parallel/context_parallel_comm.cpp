#include "parallel/context_parallel_comm.h"

#include "core/error.h"

namespace llmtrain::parallel {
namespace {

class Started final : public ContextGroup::Pending {
 public:
  explicit Started(std::unique_ptr<dist::Request> request) : request_(std::move(request)) {}
  void wait() override {
    if (request_) request_->wait();
    request_.reset();
  }
  void queue_wait() override {
    if (request_) request_->queue_wait();
    request_.reset();
  }

 private:
  std::unique_ptr<dist::Request> request_;
};

}  // namespace

std::unique_ptr<ContextGroup::Pending> CommContextGroup::start_exchange(const Tensor& send, const Tensor& recv,
                                                                             int send_to, int recv_from) {
  if (send.numel() != recv.numel() || send.dtype != recv.dtype) {
    throw RuntimeError("context group: exchange of mismatched blocks");
  }
  return std::make_unique<Started>(comm_.start_exchange(send.data, recv.data, send.numel(), send.dtype, send_to, recv_from));
}

void CommContextGroup::all_gather(const Tensor& part, const Tensor& full) {
  if (full.numel() != part.numel() * comm_.world_size() || full.dtype != part.dtype) {
    throw RuntimeError("context group: all_gather of mismatched parts");
  }
  comm_.all_gather(part.data, full.data, part.numel(), part.dtype);
}

void CommContextGroup::reduce_scatter(const Tensor& full, const Tensor& part) {
  if (full.numel() != part.numel() * comm_.world_size() || full.dtype != DType::f32 || part.dtype != DType::f32) {
    throw RuntimeError("context group: reduce_scatter of mismatched or non-f32 parts");
  }
  comm_.reduce_scatter_sum(full.as<float>(), part.as<float>(), part.numel());
}

void CommContextGroup::sum(std::vector<double>& values) {
  if (!values.empty()) host_.all_reduce_sum(values.data(), std::int64_t(values.size()));
}

}  // namespace llmtrain::parallel
