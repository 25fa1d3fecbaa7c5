#include "parallel/expert_parallel_comm.h"

#include <algorithm>
#include <string>

#include "core/error.h"

namespace llmtrain::parallel {

dist::Communicator& ExpertParallel::host() const {
  if (!host_) throw RuntimeError("expert group: a measured layout has no communicators to exchange rows over");
  return *host_;
}

dist::Communicator& ExpertParallel::device() const {
  if (!device_) throw RuntimeError("expert group: a measured layout has no communicators to exchange rows over");
  return *device_;
}

void ExpertParallel::exchange_counts(const std::vector<std::int32_t>& send, std::vector<std::int32_t>& recv) {
  const std::int64_t P = parts(), E = std::int64_t(send.size());
  if (E % P != 0) throw RuntimeError("expert group: " + std::to_string(E) + " experts over " + std::to_string(P) + " ranks");
  recv.assign(std::size_t(E), 0);
  const std::vector<std::int64_t> each(std::size_t(P), E / P);
  host().all_to_all(send.data(), each, recv.data(), each, DType::i32);
}

void ExpertParallel::all_to_all(const Tensor& send, const std::vector<std::int64_t>& send_rows, const Tensor& recv,
                                 const std::vector<std::int64_t>& recv_rows) {
  if (send.dtype != recv.dtype || send.ndim != 2 || recv.ndim != 2 || send.shape[1] != recv.shape[1]) {
    throw RuntimeError("expert group: all-to-all of mismatched rows: " + send.describe() + " to " + recv.describe());
  }
  const std::int64_t C = send.shape[1];
  std::vector<std::int64_t> send_counts, recv_counts;
  std::int64_t sent = 0, received = 0;
  for (const std::int64_t n : send_rows) send_counts.push_back(n * C), sent += n;
  for (const std::int64_t n : recv_rows) recv_counts.push_back(n * C), received += n;
  if (sent > send.shape[0] || received > recv.shape[0]) {
    throw RuntimeError("expert group: " + std::to_string(sent) + " rows sent from " + std::to_string(send.shape[0]) +
                       ", " + std::to_string(received) + " received into " + std::to_string(recv.shape[0]));
  }
  device().all_to_all(send.data, send_counts, recv.data, recv_counts, send.dtype);
}

std::vector<model::FlatRange> expert_shared_ranges(const std::vector<model::ParamInfo>& infos) {
  std::vector<model::FlatRange> out;
  for (const model::ParamInfo& info : infos) {
    if (info.slice.expert) continue;
    if (!out.empty() && out.back().end == info.offset) {
      out.back().end += info.numel;
    } else {
      out.push_back({info.offset, info.offset + info.numel});
    }
  }
  return out;
}

void sum_shared_grads(dist::Communicator& group, const Tensor& grads, std::int64_t begin,
                      const std::vector<model::FlatRange>& shared) {
  if (group.world_size() == 1) return;
  const std::int64_t end = begin + grads.numel();
  for (const model::FlatRange& r : shared) {
    const std::int64_t lo = std::max(r.begin, begin), hi = std::min(r.end, end);
    if (lo < hi) group.all_reduce_sum(grads.as<float>() + (lo - begin), hi - lo);
  }
}

}  // namespace llmtrain::parallel
