// The counting half of every communicator: each collective adds what this rank sends, as the ring
// algorithm sends it, and each transfer what it sends to its peer, before the implementation runs
// it; transfers to a rank that is not another member of the group are refused here.
#include "dist/communicator.h"

#include <cstring>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <string>

#include "core/error.h"

namespace llmtrain::dist {

namespace {
bool leaving_alone_ = false;
}  // namespace

bool leaving_alone() { return leaving_alone_; }
void set_leaving_alone() { leaving_alone_ = true; }

double Traffic::total_bytes() const {
  double sum = 0;
  for (double b : bytes) sum += b;
  return sum;
}

std::int64_t Traffic::total_calls() const {
  std::int64_t sum = 0;
  for (std::int64_t c : calls) sum += c;
  return sum;
}

Traffic Traffic::since(const Traffic& earlier) const {
  Traffic out;
  for (int k = 0; k < kinds; ++k) {
    out.calls[k] = calls[k] - earlier.calls[k];
    out.bytes[k] = bytes[k] - earlier.bytes[k];
  }
  out.wait_s = wait_s - earlier.wait_s;
  return out;
}

Traffic& Traffic::operator+=(const Traffic& more) {
  for (int k = 0; k < kinds; ++k) {
    calls[k] += more.calls[k];
    bytes[k] += more.bytes[k];
  }
  wait_s += more.wait_s;
  return *this;
}

const char* Traffic::name(Kind kind) {
  switch (kind) {
    case all_reduce: return "all-reduce";
    case reduce_scatter: return "reduce-scatter";
    case all_gather: return "all-gather";
    case broadcast: return "broadcast";
    case barrier: return "barrier";
    case send: return "send";
    case recv: return "recv";
    case all_to_all: return "all-to-all";
    case kinds: break;
  }
  return "?";
}

std::int64_t piece_limit(std::int64_t library_limit, const char* variable) {
  const char* text = std::getenv(variable);
  if (!text || !*text) return library_limit;
  char* end = nullptr;
  errno = 0;
  const long long value = std::strtoll(text, &end, 10);
  if (errno != 0 || *end != '\0' || value <= 0) {
    throw InputError(std::string(variable) + " = '" + text + "': not a positive integer");
  }
  return std::min<std::int64_t>(library_limit, value);
}

void Communicator::count(Traffic::Kind kind, double bytes) {
  traffic_.calls[kind] += 1;
  traffic_.bytes[kind] += bytes;
}

namespace {

// The share of a buffer that one rank sends in a ring over n ranks: (n-1)/n.
double ring_share(int n) { return n > 1 ? double(n - 1) / n : 0.0; }

using Clock = std::chrono::steady_clock;

// Adds the seconds since it was made to `into` when it goes out of scope.
class WaitClock {
 public:
  explicit WaitClock(double& into) : into_(into), start_(Clock::now()) {}
  ~WaitClock() { into_ += std::chrono::duration<double>(Clock::now() - start_).count(); }
  WaitClock(const WaitClock&) = delete;
  WaitClock& operator=(const WaitClock&) = delete;

 private:
  double& into_;
  Clock::time_point start_;
};

}  // namespace

class TimedRequest final : public Request {
 public:
  TimedRequest(Communicator& owner, std::unique_ptr<Request> request) : owner_(owner), request_(std::move(request)) {}
  void wait() override {
    WaitClock clock(owner_.traffic_.wait_s);
    request_->wait();
  }
  void queue_wait() override {
    WaitClock clock(owner_.traffic_.wait_s);
    request_->queue_wait();
  }

 private:
  Communicator& owner_;
  std::unique_ptr<Request> request_;
};

std::unique_ptr<Request> Communicator::timed(std::unique_ptr<Request> request) {
  return std::make_unique<TimedRequest>(*this, std::move(request));
}

void Communicator::all_reduce_sum(float* data, std::int64_t count) {
  this->count(Traffic::all_reduce, 2 * ring_share(world_size()) * double(count) * sizeof(float));
  WaitClock clock(traffic_.wait_s);
  do_all_reduce_sum(data, count);
}

void Communicator::all_reduce_sum(double* data, std::int64_t count) {
  this->count(Traffic::all_reduce, 2 * ring_share(world_size()) * double(count) * sizeof(double));
  WaitClock clock(traffic_.wait_s);
  do_all_reduce_sum(data, count);
}

void Communicator::all_reduce_max(std::int64_t* data, std::int64_t count) {
  this->count(Traffic::all_reduce, 2 * ring_share(world_size()) * double(count) * sizeof(std::int64_t));
  WaitClock clock(traffic_.wait_s);
  do_all_reduce_max(data, count);
}

void Communicator::all_reduce_max(float* data, std::int64_t count) {
  this->count(Traffic::all_reduce, 2 * ring_share(world_size()) * double(count) * sizeof(float));
  WaitClock clock(traffic_.wait_s);
  do_all_reduce_max(data, count);
}

std::unique_ptr<Request> Communicator::start_all_reduce_sum(float* data, std::int64_t count) {
  this->count(Traffic::all_reduce, 2 * ring_share(world_size()) * double(count) * sizeof(float));
  return timed(do_start_all_reduce_sum(data, count));
}

void Communicator::reduce_scatter_sum(const float* send, float* recv, std::int64_t shard) {
  start_reduce_scatter_sum(send, recv, shard)->wait();
}

std::unique_ptr<Request> Communicator::start_reduce_scatter_sum(const float* send, float* recv, std::int64_t shard) {
  count(Traffic::reduce_scatter, ring_share(world_size()) * double(world_size()) * double(shard) * sizeof(float));
  return timed(do_start_reduce_scatter_sum(send, recv, shard));
}

void Communicator::all_gather(const float* send, float* recv, std::int64_t shard) {
  start_all_gather(send, recv, shard, DType::f32)->wait();
}

void Communicator::all_gather(const void* send, void* recv, std::int64_t shard, DType dtype) {
  start_all_gather(send, recv, shard, dtype)->wait();
}

std::unique_ptr<Request> Communicator::start_all_gather(const void* send, void* recv, std::int64_t shard, DType dtype) {
  if (dtype != DType::f32 && dtype != DType::bf16) throw RuntimeError("all_gather: f32 or bf16 elements only");
  count(Traffic::all_gather,
        ring_share(world_size()) * double(world_size()) * double(shard) * double(dtype_size(dtype)));
  return timed(do_start_all_gather(send, recv, shard, dtype));
}

void Communicator::broadcast(float* data, std::int64_t count, int root) {
  this->count(Traffic::broadcast, ring_share(world_size()) * double(count) * sizeof(float));
  WaitClock clock(traffic_.wait_s);
  do_broadcast(data, count, root);
}

void Communicator::barrier() {
  count(Traffic::barrier, 0.0);
  WaitClock clock(traffic_.wait_s);
  do_barrier();
}

namespace {

void check_queued(const char* operation, DType dtype, bool sum, bool sums_bf16) {
  if (dtype == DType::f32 || (dtype == DType::bf16 && (!sum || sums_bf16))) return;
  throw RuntimeError(std::string(operation) + ": " + dtype_name(dtype) + " elements are not supported here");
}

}  // namespace

void Communicator::queue_all_reduce_sum(void* data, std::int64_t count, DType dtype) {
  check_queued("queue_all_reduce_sum", dtype, true, sums_bf16());
  this->count(Traffic::all_reduce, 2 * ring_share(world_size()) * double(count) * double(dtype_size(dtype)));
  WaitClock clock(traffic_.wait_s);
  do_queue_all_reduce_sum(data, count, dtype);
}

void Communicator::queue_reduce_scatter_sum(const void* send, void* recv, std::int64_t shard, DType dtype) {
  check_queued("queue_reduce_scatter_sum", dtype, true, sums_bf16());
  count(Traffic::reduce_scatter,
        ring_share(world_size()) * double(world_size()) * double(shard) * double(dtype_size(dtype)));
  WaitClock clock(traffic_.wait_s);
  do_queue_reduce_scatter_sum(send, recv, shard, dtype);
}

void Communicator::queue_all_gather(const void* send, void* recv, std::int64_t shard, DType dtype) {
  check_queued("queue_all_gather", dtype, false, sums_bf16());
  count(Traffic::all_gather, ring_share(world_size()) * double(world_size()) * double(shard) * double(dtype_size(dtype)));
  WaitClock clock(traffic_.wait_s);
  do_queue_all_gather(send, recv, shard, dtype);
}

void Communicator::do_queue_all_reduce_sum(void* data, std::int64_t count, DType dtype) {
  if (dtype != DType::f32) throw RuntimeError("queue_all_reduce_sum: f32 elements only here");
  do_all_reduce_sum(static_cast<float*>(data), count);
}

void Communicator::do_queue_reduce_scatter_sum(const void* send, void* recv, std::int64_t shard, DType dtype) {
  if (dtype != DType::f32) throw RuntimeError("queue_reduce_scatter_sum: f32 elements only here");
  do_start_reduce_scatter_sum(static_cast<const float*>(send), static_cast<float*>(recv), shard)->wait();
}

void Communicator::do_queue_all_gather(const void* send, void* recv, std::int64_t shard, DType dtype) {
  do_start_all_gather(send, recv, shard, dtype)->wait();
}

std::string Communicator::rank_phrase(int rank) const {
  const std::string job = "rank " + std::to_string(job_rank(rank));
  return rank_noun_.empty() ? job : rank_noun_ + " " + std::to_string(rank) + " (" + job + ")";
}

std::string Communicator::elements(std::int64_t count, DType dtype) {
  return std::to_string(count) + " " + dtype_name(dtype);
}

void Communicator::check_transfer(const char* operation, std::int64_t count, int peer) const {
  if (world_size() == 1) throw RuntimeError(std::string(operation) + ": no peer on a one-rank communicator");
  if (peer < 0 || peer >= world_size()) {
    throw RuntimeError(std::string(operation) + ": peer rank " + std::to_string(peer) + " is not in this group of " +
                       std::to_string(world_size()) + " ranks");
  }
  if (peer == rank()) throw RuntimeError(std::string(operation) + ": rank " + std::to_string(peer) + " is this rank");
  if (count < 0) throw RuntimeError(std::string(operation) + ": negative count " + std::to_string(count));
}

std::unique_ptr<Request> Communicator::start_send(const void* data, std::int64_t count, DType dtype, int peer) {
  check_transfer("send", count, peer);
  this->count(Traffic::send, double(count) * double(dtype_size(dtype)));
  return timed(do_start_send(data, count, dtype, peer));
}

std::unique_ptr<Request> Communicator::start_recv(void* data, std::int64_t count, DType dtype, int peer) {
  check_transfer("recv", count, peer);
  this->count(Traffic::recv, 0.0);
  return timed(do_start_recv(data, count, dtype, peer));
}

void Communicator::send(const void* data, std::int64_t count, DType dtype, int peer) {
  start_send(data, count, dtype, peer)->wait();
}

void Communicator::recv(void* data, std::int64_t count, DType dtype, int peer) {
  start_recv(data, count, dtype, peer)->wait();
}

std::unique_ptr<Request> Communicator::start_exchange(const void* send, void* recv, std::int64_t count, DType dtype,
                                                      int send_to, int recv_from) {
  check_transfer("exchange (send)", count, send_to);
  check_transfer("exchange (recv)", count, recv_from);
  this->count(Traffic::send, double(count) * double(dtype_size(dtype)));
  this->count(Traffic::recv, 0.0);
  return timed(do_start_exchange(send, recv, count, dtype, send_to, recv_from));
}

std::unique_ptr<Request> Communicator::start_transfers(const std::vector<PeerTransfer>& transfers) {
  for (const PeerTransfer& t : transfers) {
    check_transfer(t.direction == PeerTransfer::send ? "transfers (send)" : "transfers (recv)", t.count, t.peer);
  }
  for (const PeerTransfer& t : transfers) {
    const bool send = t.direction == PeerTransfer::send;
    this->count(send ? Traffic::send : Traffic::recv, send ? double(t.count) * double(dtype_size(t.dtype)) : 0.0);
  }
  return timed(do_start_transfers(transfers));
}

std::unique_ptr<Request> Communicator::start_all_to_all(const void* send, const std::vector<std::int64_t>& send_counts,
                                                        void* recv, const std::vector<std::int64_t>& recv_counts,
                                                        DType dtype) {
  const std::size_t W = std::size_t(world_size());
  if (send_counts.size() != W || recv_counts.size() != W) {
    throw RuntimeError("all_to_all: expected " + std::to_string(W) + " send and receive counts, got " +
                       std::to_string(send_counts.size()) + " and " + std::to_string(recv_counts.size()));
  }
  double bytes = 0.0;
  for (std::size_t r = 0; r < W; ++r) {
    if (send_counts[r] < 0 || recv_counts[r] < 0) throw RuntimeError("all_to_all: a negative count");
    if (int(r) != rank()) bytes += double(send_counts[r]) * double(dtype_size(dtype));
  }
  count(Traffic::all_to_all, bytes);
  return timed(do_start_all_to_all(send, send_counts, recv, recv_counts, dtype));
}

void Communicator::all_to_all(const void* send, const std::vector<std::int64_t>& send_counts, void* recv,
                              const std::vector<std::int64_t>& recv_counts, DType dtype) {
  start_all_to_all(send, send_counts, recv, recv_counts, dtype)->wait();
}

namespace {

// Finished when every part has.
class AllOf final : public Request {
 public:
  explicit AllOf(std::vector<std::unique_ptr<Request>> parts) : parts_(std::move(parts)) {}
  void wait() override {
    for (auto& part : parts_) part->wait();
  }

 private:
  std::vector<std::unique_ptr<Request>> parts_;
};

}  // namespace

std::unique_ptr<Request> Communicator::do_start_transfers(const std::vector<PeerTransfer>& transfers) {
  std::vector<std::unique_ptr<Request>> parts;
  for (const PeerTransfer& t : transfers) {
    parts.push_back(t.direction == PeerTransfer::send ? do_start_send(t.data, t.count, t.dtype, t.peer)
                                                      : do_start_recv(t.data, t.count, t.dtype, t.peer));
  }
  return std::make_unique<AllOf>(std::move(parts));
}

std::unique_ptr<Request> Communicator::do_start_all_to_all(const void* send, const std::vector<std::int64_t>& send_counts,
                                                           void* recv, const std::vector<std::int64_t>& recv_counts,
                                                           DType dtype) {
  const std::size_t size = dtype_size(dtype);
  std::vector<PeerTransfer> transfers;
  std::int64_t sent = 0, received = 0;  // elements before rank r's part
  for (int r = 0; r < world_size(); ++r) {
    const auto n = std::size_t(r);
    char* from = static_cast<char*>(const_cast<void*>(send)) + std::size_t(sent) * size;
    char* into = static_cast<char*>(recv) + std::size_t(received) * size;
    if (r == rank()) {
      if (send_counts[n] != recv_counts[n]) {
        throw RuntimeError("all_to_all: this rank sends itself " + std::to_string(send_counts[n]) + " elements and receives " +
                           std::to_string(recv_counts[n]));
      }
      if (send_counts[n] > 0) std::memcpy(into, from, std::size_t(send_counts[n]) * size);
    } else {
      if (send_counts[n] > 0) transfers.push_back({PeerTransfer::send, from, send_counts[n], dtype, r});
      if (recv_counts[n] > 0) transfers.push_back({PeerTransfer::recv, into, recv_counts[n], dtype, r});
    }
    sent += send_counts[n];
    received += recv_counts[n];
  }
  if (transfers.empty()) return std::make_unique<AllOf>(std::vector<std::unique_ptr<Request>>{});
  return do_start_transfers(transfers);
}

}  // namespace llmtrain::dist
