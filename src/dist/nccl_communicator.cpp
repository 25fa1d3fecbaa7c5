// NCCL over device memory: the communicator of the CUDA backend. The unique id goes from rank 0
// to every rank over MPI; the communicator is created non-blocking and every operation is polled
// (stream query plus ncclCommGetAsyncError), so that a dead or hung rank makes it abort the
// communicator and stop with a message instead of hanging. Buffers passed in are device memory.
// On a non-blocking communicator a call may return ncclInProgress before its work is on the
// stream: each call is then polled (ncclCommGetAsyncError) until it has left that state, before
// the stream is queried, else the stream would look idle and the caller read unreduced data.
// Ordering: each collective's stream first waits (an event) for the work enqueued so far on the
// ops' compute stream, which wrote its input; the host then waits for a blocking collective
// (finish), so whatever the compute stream does next sees its result. A started collective or
// transfer records an event after itself on the communicator's stream, and its wait() waits for
// that event only, not for what was started after it (ZeRO 3's gathers and reduce-scatters
// overlap: waiting for one layer's gather does not wait for the next layer's reduce-scatter). A
// queued collective (tensor parallelism) makes the compute stream wait for its event and
// returns: the host waits only in wait_queued() or when too many are still in flight, and each
// later call checks the oldest for errors and the timeout. A started one's queue_wait() hands its
// event to the same watch (context parallelism's ring: no host wait per step). An exchange's
// send and receive are one NCCL group, so that both are under way together (NCCL runs the
// operations of a communicator one after the other, each until its peer has taken part).
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "dist/communicator.h"
#include "device/stream.h"
#include "dist/nccl_communicator.h"

namespace llmtrain::dist {
namespace {

[[noreturn]] void nccl_failed(ncclResult_t status, const char* call) {
  const std::string message = std::string("NCCL error in ") + call + ": " + ncclGetErrorString(status);
  // A peer that exited or a network that failed under NCCL: ranks lost, as a timeout (exit 76).
  if (status == ncclRemoteError) throw RanksLostError(message + " (a rank died or was cut off)");
  throw RuntimeError(message);
}

// For calls after which nothing waits on NCCL's state (the communicator's own set-up is polled).
void check(ncclResult_t status, const char* call) {
  if (status != ncclSuccess && status != ncclInProgress) nccl_failed(status, call);
}

void check(cudaError_t status, const char* call) {
  if (status != cudaSuccess) throw RuntimeError(std::string("CUDA error in ") + call + ": " + cudaGetErrorString(status));
}

// What travels: NCCL has no 16-bit integers, and moves u16 words as bf16 ones, unchanged.
ncclDataType_t element_type(DType dtype) {
  switch (dtype) {
    case DType::f32: return ncclFloat;
    case DType::i32: return ncclInt32;
    case DType::bf16:
    case DType::u16: return ncclBfloat16;
  }
  return ncclFloat;
}

// NCCL's counts are size_t, but pieces of at most 2^30 elements keep every count inside 32 bits
// (fewer when LLMTRAIN_COMM_MAX_ELEMENTS says so).
std::int64_t nccl_piece_limit() { return piece_limit(std::int64_t(1) << 30); }

// A reduce-scatter or all-gather in pieces goes through a staging buffer of piece j of every
// rank's block: at most this many elements in all (1 GiB of floats), whatever the piece limit.
constexpr std::int64_t staging_elements = std::int64_t(1) << 28;

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(std::unique_ptr<Communicator> owned_host, int device, double timeout_s)
      : NcclCommunicator(*owned_host, device, timeout_s) {
    owned_host_ = std::move(owned_host);
  }
  NcclCommunicator(Communicator& host, int device, double timeout_s)
      : host_(host), device_(device), timeout_s_(timeout_s) {
    check(cudaSetDevice(device), "cudaSetDevice");
    check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    check(cudaEventCreateWithFlags(&compute_done_, cudaEventDisableTiming), "cudaEventCreate");
    ncclUniqueId id;
    if (host.rank() == 0) check(ncclGetUniqueId(&id), "ncclGetUniqueId");
    // The id is 128 bytes: sent as 32 floats over the host communicator.
    static_assert(sizeof(ncclUniqueId) % sizeof(float) == 0, "ncclUniqueId is not a whole number of floats");
    std::vector<float> words(sizeof(ncclUniqueId) / sizeof(float));
    std::memcpy(words.data(), &id, sizeof id);
    host.broadcast(words.data(), std::int64_t(words.size()), 0);
    std::memcpy(&id, words.data(), sizeof id);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    check(ncclCommInitRankConfig(&comm_, host.world_size(), id, host.rank(), &config), "ncclCommInitRankConfig");
    poll_comm("ncclCommInitRank");
  }
  ~NcclCommunicator() override {
    for (const Queued& q : queued_) cudaEventSynchronize(q.event);
    for (const Queued& q : queued_) cudaEventDestroy(q.event);
    for (cudaEvent_t e : spare_events_) cudaEventDestroy(e);
    if (comm_) ncclCommDestroy(comm_);
    if (compute_done_) cudaEventDestroy(compute_done_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  int rank() const override { return host_.rank(); }
  int world_size() const override { return host_.world_size(); }
  int job_rank(int rank) const override { return host_.job_rank(rank); }
  std::string name() const override { return "nccl"; }
  /// The host group splits; the new group gets its own NCCL id over it and owns it.
  std::unique_ptr<Communicator> split(int color, int key) override {
    return std::make_unique<NcclCommunicator>(host_.split(color, key), device_, timeout_s_);
  }

 protected:

  void do_all_reduce_sum(float* data, std::int64_t count) override {
    after_compute();
    all_reduce(data, count, ncclFloat, ncclSum);
    finish("all_reduce");
  }
  void do_all_reduce_sum(double* data, std::int64_t count) override {
    after_compute();
    all_reduce(data, count, ncclDouble, ncclSum);
    finish("all_reduce");
  }
  void do_all_reduce_max(std::int64_t* data, std::int64_t count) override {
    after_compute();
    all_reduce(data, count, ncclInt64, ncclMax);
    finish("all_reduce (max)");
  }
  void do_all_reduce_max(float* data, std::int64_t count) override {
    after_compute();
    all_reduce(data, count, ncclFloat, ncclMax);
    finish("all_reduce (max)");
  }
  std::unique_ptr<Request> do_start_all_reduce_sum(float* data, std::int64_t count) override {
    after_compute();
    all_reduce(data, count, ncclFloat, ncclSum);
    return std::make_unique<Transfer>(*this, "all_reduce (gradient bucket)", "another rank died or hangs");
  }
  std::unique_ptr<Request> do_start_reduce_scatter_sum(const float* send, float* recv, std::int64_t shard) override {
    after_compute();
    reduce_scatter(send, recv, shard, DType::f32);
    return std::make_unique<Transfer>(*this, "reduce_scatter", "another rank died or hangs");
  }
  std::unique_ptr<Request> do_start_all_gather(const void* send, void* recv, std::int64_t shard, DType dtype) override {
    after_compute();
    all_gather(send, recv, shard, dtype);
    return std::make_unique<Transfer>(*this, "all_gather", "another rank died or hangs");
  }
  void do_broadcast(float* data, std::int64_t count, int root) override {
    after_compute();
    for_each_piece(count, nccl_piece_limit(), [&](std::int64_t offset, std::int64_t length) {
      enqueued(ncclBroadcast(data + offset, data + offset, std::size_t(length), ncclFloat, root, comm_, stream_),
               "ncclBroadcast");
    });
    finish("broadcast");
  }
  void do_barrier() override { host_.barrier(); }

  bool sums_bf16() const override { return true; }
  void do_queue_all_reduce_sum(void* data, std::int64_t count, DType dtype) override {
    after_compute();
    if (dtype == DType::f32) {
      all_reduce(static_cast<float*>(data), count, ncclFloat, ncclSum);
    } else {
      all_reduce(static_cast<std::uint16_t*>(data), count, ncclBfloat16, ncclSum);
    }
    queued("all_reduce (tensor group)");
  }
  void do_queue_reduce_scatter_sum(const void* send, void* recv, std::int64_t shard, DType dtype) override {
    after_compute();
    reduce_scatter(send, recv, shard, dtype);
    queued("reduce_scatter (tensor group)");
  }
  void do_queue_all_gather(const void* send, void* recv, std::int64_t shard, DType dtype) override {
    after_compute();
    all_gather(send, recv, shard, dtype);
    queued("all_gather (tensor group)");
  }
  void wait_queued() override {
    while (!queued_.empty()) retire_oldest(true);
  }

  // A transfer of more elements than a piece is a group of pieces, matched in order by the peer's.
  std::unique_ptr<Request> do_start_send(const void* data, std::int64_t count, DType dtype, int peer) override {
    if (count > nccl_piece_limit()) {
      return do_start_transfers({{PeerTransfer::send, const_cast<void*>(data), count, dtype, peer}});
    }
    after_compute();
    enqueued(ncclSend(data, std::size_t(count), element_type(dtype), peer, comm_, stream_), "ncclSend");
    return std::make_unique<Transfer>(*this, "send of " + elements(count, dtype) + " to " + rank_phrase(peer),
                                      rank_phrase(peer) + " never received it (dead or hung)");
  }
  std::unique_ptr<Request> do_start_recv(void* data, std::int64_t count, DType dtype, int peer) override {
    if (count > nccl_piece_limit()) return do_start_transfers({{PeerTransfer::recv, data, count, dtype, peer}});
    after_compute();
    enqueued(ncclRecv(data, std::size_t(count), element_type(dtype), peer, comm_, stream_), "ncclRecv");
    return std::make_unique<Transfer>(*this, "recv of " + elements(count, dtype) + " from " + rank_phrase(peer),
                                      rank_phrase(peer) + " never sent it (dead or hung)");
  }
  // One group: inside it the calls only queue (NCCL returns ncclSuccess); ncclGroupEnd starts
  // both, and on a non-blocking communicator it may return ncclInProgress like any call.
  std::unique_ptr<Request> do_start_exchange(const void* send, void* recv, std::int64_t count, DType dtype, int send_to,
                                             int recv_from) override {
    after_compute();
    const ncclDataType_t type = element_type(dtype);
    const std::size_t size = dtype_size(dtype);
    check(ncclGroupStart(), "ncclGroupStart");
    ncclResult_t sent = ncclSuccess, received = ncclSuccess;
    for_each_piece(count, nccl_piece_limit(), [&](std::int64_t offset, std::int64_t length) {
      const std::size_t at = std::size_t(offset) * size;
      if (sent == ncclSuccess) sent = ncclSend(static_cast<const char*>(send) + at, std::size_t(length), type, send_to, comm_, stream_);
      if (received == ncclSuccess) {
        received = ncclRecv(static_cast<char*>(recv) + at, std::size_t(length), type, recv_from, comm_, stream_);
      }
    });
    const ncclResult_t ended = ncclGroupEnd();
    check(sent, "ncclSend");
    check(received, "ncclRecv");
    enqueued(ended, "ncclGroupEnd");
    const std::string peers =
        send_to == recv_from ? rank_phrase(send_to) : rank_phrase(send_to) + " or " + rank_phrase(recv_from);
    return std::make_unique<Transfer>(*this,
                                      "exchange (send of " + elements(count, dtype) + " to " + rank_phrase(send_to) +
                                          ", recv from " + rank_phrase(recv_from) + ")",
                                      peers + " never answered (dead or hung)");
  }

  // One group of a send and a receive per other rank (each in pieces), after this rank's own part
  // is copied on the stream: the all-to-all of grouped point-to-point calls.
  std::unique_ptr<Request> do_start_all_to_all(const void* send, const std::vector<std::int64_t>& send_counts,
                                               void* recv, const std::vector<std::int64_t>& recv_counts,
                                               DType dtype) override {
    after_compute();
    const std::size_t size = dtype_size(dtype);
    const ncclDataType_t type = element_type(dtype);
    const std::int64_t limit = nccl_piece_limit();
    std::int64_t sent = 0, received = 0;
    ncclResult_t queued = ncclSuccess;
    check(ncclGroupStart(), "ncclGroupStart");
    for (int r = 0; r < world_size(); ++r) {
      const auto n = std::size_t(r);
      const char* from = static_cast<const char*>(send) + std::size_t(sent) * size;
      char* into = static_cast<char*>(recv) + std::size_t(received) * size;
      if (r == rank()) {
        if (send_counts[n] > 0) {
          check(cudaMemcpyAsync(into, from, std::size_t(send_counts[n]) * size, cudaMemcpyDeviceToDevice, stream_),
                "cudaMemcpyAsync");
        }
      } else {  // an empty part is no call on either side (the counts agree)
        if (send_counts[n] > 0) {
          for_each_piece(send_counts[n], limit, [&](std::int64_t offset, std::int64_t length) {
            if (queued == ncclSuccess) queued = ncclSend(from + std::size_t(offset) * size, std::size_t(length), type, r, comm_, stream_);
          });
        }
        if (recv_counts[n] > 0) {
          for_each_piece(recv_counts[n], limit, [&](std::int64_t offset, std::int64_t length) {
            if (queued == ncclSuccess) queued = ncclRecv(into + std::size_t(offset) * size, std::size_t(length), type, r, comm_, stream_);
          });
        }
      }
      sent += send_counts[n];
      received += recv_counts[n];
    }
    if (queued != ncclSuccess) {
      ncclGroupEnd();
      check(queued, "ncclSend/ncclRecv");
    }
    enqueued(ncclGroupEnd(), "ncclGroupEnd");
    return std::make_unique<Transfer>(*this, "all_to_all of " + elements(sent, dtype) + " sent, " + elements(received, dtype) + " received",
                                      "a rank of this group never answered (dead or hung)");
  }

  // One group: every send and receive queued, then started together by ncclGroupEnd.
  std::unique_ptr<Request> do_start_transfers(const std::vector<PeerTransfer>& transfers) override {
    after_compute();
    std::string what;
    std::vector<int> peers;
    check(ncclGroupStart(), "ncclGroupStart");
    const std::int64_t limit = nccl_piece_limit();
    for (const PeerTransfer& t : transfers) {
      const bool send = t.direction == PeerTransfer::send;
      ncclResult_t queued = ncclSuccess;
      for_each_piece(t.count, limit, [&](std::int64_t offset, std::int64_t length) {
        char* at = static_cast<char*>(t.data) + std::size_t(offset) * dtype_size(t.dtype);
        if (queued != ncclSuccess) return;
        queued = send ? ncclSend(at, std::size_t(length), element_type(t.dtype), t.peer, comm_, stream_)
                      : ncclRecv(at, std::size_t(length), element_type(t.dtype), t.peer, comm_, stream_);
      });
      if (queued != ncclSuccess) {
        ncclGroupEnd();
        check(queued, send ? "ncclSend" : "ncclRecv");
      }
      what += (what.empty() ? "" : ", ") + std::string(send ? "send of " : "recv of ") + elements(t.count, t.dtype) +
              (send ? " to " : " from ") + rank_phrase(t.peer);
      if (std::find(peers.begin(), peers.end(), t.peer) == peers.end()) peers.push_back(t.peer);
    }
    enqueued(ncclGroupEnd(), "ncclGroupEnd");
    std::string suspects;
    for (const int peer : peers) suspects += (suspects.empty() ? "" : " or ") + rank_phrase(peer);
    return std::make_unique<Transfer>(*this, "transfers (" + what + ")", suspects + " never answered (dead or hung)");
  }

 private:
  // A started collective or transfer: done when the stream has passed the event recorded right
  // after it (not what was started after it).
  class Transfer final : public Request {
   public:
    Transfer(NcclCommunicator& owner, std::string operation, std::string suspect)
        : owner_(owner), operation_(std::move(operation)), suspect_(std::move(suspect)) {
      check(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming), "cudaEventCreate");
      check(cudaEventRecord(done_, owner.stream_), "cudaEventRecord");
    }
    ~Transfer() override {
      if (done_) cudaEventDestroy(done_);
    }
    void wait() override {
      if (done_) owner_.finish(operation_.c_str(), done_, suspect_.c_str());
    }
    // The event goes to the queued collectives' watch, which owns it from then on.
    void queue_wait() override {
      if (!done_) return;
      owner_.watch(done_, std::move(operation_), std::move(suspect_));
      done_ = nullptr;
    }

   private:
    NcclCommunicator& owner_;
    std::string operation_, suspect_;
    cudaEvent_t done_ = nullptr;
  };

  // Enqueues a reduce-scatter of f32 or bf16 elements. In pieces: piece j of every rank's block is
  // copied into a staging buffer (on the stream, reused piece after piece) and reduce-scattered
  // from there, so each rank's piece j of its shard is the sum of the same elements as in one call.
  void reduce_scatter(const void* send, void* recv, std::int64_t shard, DType dtype) {
    const ncclDataType_t type = dtype == DType::f32 ? ncclFloat : ncclBfloat16;
    const std::int64_t limit = nccl_piece_limit();
    if (shard <= limit) {
      enqueued(ncclReduceScatter(send, recv, std::size_t(shard), type, ncclSum, comm_, stream_), "ncclReduceScatter");
      return;
    }
    const int world = world_size();
    const std::size_t size = dtype_size(dtype);
    const std::int64_t piece = std::min(limit, std::max<std::int64_t>(1, staging_elements / world));
    void* staging = nullptr;
    check(cudaMallocAsync(&staging, std::size_t(world * piece) * size, stream_), "cudaMallocAsync");
    char* packed = static_cast<char*>(staging);
    for_each_piece(shard, piece, [&](std::int64_t offset, std::int64_t length) {
      const std::size_t bytes = std::size_t(length) * size;
      for (int r = 0; r < world; ++r) {
        check(cudaMemcpyAsync(packed + std::size_t(r) * bytes,
                              static_cast<const char*>(send) + std::size_t(std::int64_t(r) * shard + offset) * size, bytes,
                              cudaMemcpyDeviceToDevice, stream_),
              "cudaMemcpyAsync");
      }
      enqueued(ncclReduceScatter(packed, static_cast<char*>(recv) + std::size_t(offset) * size, std::size_t(length), type,
                                 ncclSum, comm_, stream_),
               "ncclReduceScatter");
    });
    check(cudaFreeAsync(staging, stream_), "cudaFreeAsync");
  }

  // Enqueues an all-gather, in place when send is this rank's part of recv (NCCL's rule for
  // in-place all-gathers). In pieces: piece j of every rank's shard is gathered into a staging
  // buffer, then copied to each rank's block.
  void all_gather(const void* send, void* recv, std::int64_t shard, DType dtype) {
    const ncclDataType_t type = dtype == DType::f32 ? ncclFloat : ncclBfloat16;
    const std::int64_t limit = nccl_piece_limit();
    if (shard <= limit) {
      enqueued(ncclAllGather(send, recv, std::size_t(shard), type, comm_, stream_), "ncclAllGather");
      return;
    }
    const int world = world_size();
    const std::size_t size = dtype_size(dtype);
    const std::int64_t piece = std::min(limit, std::max<std::int64_t>(1, staging_elements / world));
    void* staging = nullptr;
    check(cudaMallocAsync(&staging, std::size_t(world * piece) * size, stream_), "cudaMallocAsync");
    char* gathered = static_cast<char*>(staging);
    for_each_piece(shard, piece, [&](std::int64_t offset, std::int64_t length) {
      const std::size_t bytes = std::size_t(length) * size;
      enqueued(ncclAllGather(static_cast<const char*>(send) + std::size_t(offset) * size, gathered, std::size_t(length),
                             type, comm_, stream_),
               "ncclAllGather");
      for (int r = 0; r < world; ++r) {
        check(cudaMemcpyAsync(static_cast<char*>(recv) + std::size_t(std::int64_t(r) * shard + offset) * size,
                              gathered + std::size_t(r) * bytes, bytes, cudaMemcpyDeviceToDevice, stream_),
              "cudaMemcpyAsync");
      }
    });
    check(cudaFreeAsync(staging, stream_), "cudaFreeAsync");
  }

  // The collective just enqueued is ordered before the compute stream's later work, which waits
  // for an event recorded after it; the host goes on. The oldest queued ones are retired: those
  // done without waiting, and with more than max_queued in flight the oldest waited for (bounded
  // run-ahead); one older than the timeout aborts.
  void queued(const char* operation) {
    cudaEvent_t event = nullptr;
    if (!spare_events_.empty()) {
      event = spare_events_.back();
      spare_events_.pop_back();
    } else {
      check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate");
    }
    check(cudaEventRecord(event, stream_), "cudaEventRecord");
    watch(event, operation, "another rank died or hangs");
  }

  // Makes the compute stream's later work wait for `event` (recorded on this communicator's
  // stream after an operation) and keeps it among the queued ones, which then own it.
  void watch(cudaEvent_t event, std::string operation, std::string suspect) {
    queued_.push_back({event, std::chrono::steady_clock::now(), std::move(operation), std::move(suspect)});
    check(cudaStreamWaitEvent(device::compute_stream(), event, 0), "cudaStreamWaitEvent");
    while (queued_.size() > max_queued) retire_oldest(true);
  }

  // Takes the oldest queued collective off the list once it is done: waiting for it (`wait`,
  // with the timeout counted from when it was queued) or only when it already is.
  bool retire_oldest(bool wait) {
    const Queued& q = queued_.front();
    if (wait) {
      finish(q.operation.c_str(), q.event, q.suspect.c_str(), q.at);
    } else if (cudaEventQuery(q.event) != cudaSuccess) {
      return false;
    }
    spare_events_.push_back(q.event);
    queued_.pop_front();
    return true;
  }

  // An in-place all-reduce of `count` elements, in pieces of at most the piece limit.
  template <class T>
  void all_reduce(T* data, std::int64_t count, ncclDataType_t type, ncclRedOp_t op) {
    for_each_piece(count, nccl_piece_limit(), [&](std::int64_t offset, std::int64_t length) {
      enqueued(ncclAllReduce(data + offset, data + offset, std::size_t(length), type, op, comm_, stream_), "ncclAllReduce");
    });
  }

  // Makes this communicator's stream wait for what the compute stream has been given so far, and
  // retires the queued collectives already done (an old one still in flight: the timeout).
  void after_compute() {
    while (!queued_.empty() && retire_oldest(false)) {
    }
    if (!queued_.empty()) {
      timeout_if_late(queued_.front().at, queued_.front().operation.c_str(), queued_.front().suspect.c_str());
    }
    check(cudaEventRecord(compute_done_, device::compute_stream()), "cudaEventRecord");
    check(cudaStreamWaitEvent(stream_, compute_done_, 0), "cudaStreamWaitEvent");
  }

  // Waits for the communicator's pending work (its set-up, or a call that returned
  // ncclInProgress) without blocking inside NCCL; an error or the timeout aborts it.
  void poll_comm(const char* operation) {
    const auto start = std::chrono::steady_clock::now();
    ncclResult_t state = ncclInProgress;
    while (true) {
      check(ncclCommGetAsyncError(comm_, &state), "ncclCommGetAsyncError");
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) {
        ncclCommAbort(comm_);
        comm_ = nullptr;
        nccl_failed(state, operation);
      }
      timeout_if_late(start, operation);
      std::this_thread::yield();
    }
  }

  // A collective's status: returns once its work is on the stream (ncclInProgress: polled until then).
  void enqueued(ncclResult_t status, const char* call) {
    if (status == ncclSuccess) return;
    if (status != ncclInProgress) nccl_failed(status, call);
    poll_comm(call);
  }

  // Waits for the stream (or, given `until`, for the stream to pass that event), watching for
  // asynchronous NCCL errors and the timeout (which blames `suspect`).
  void finish(const char* operation, cudaEvent_t until = nullptr, const char* suspect = "another rank died or hangs",
              std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now()) {
    while (true) {
      const cudaError_t done = until ? cudaEventQuery(until) : cudaStreamQuery(stream_);
      if (done == cudaSuccess) return;
      if (done != cudaErrorNotReady) check(done, operation);
      ncclResult_t state = ncclSuccess;
      check(ncclCommGetAsyncError(comm_, &state), "ncclCommGetAsyncError");
      if (state != ncclSuccess && state != ncclInProgress) {
        ncclCommAbort(comm_);
        comm_ = nullptr;
        nccl_failed(state, operation);
      }
      timeout_if_late(start, operation, suspect);
      std::this_thread::yield();
    }
  }

  void timeout_if_late(std::chrono::steady_clock::time_point start, const char* operation,
                       const char* suspect = "another rank died or hangs") {
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (waited <= timeout_s_) return;
    ncclCommAbort(comm_);
    comm_ = nullptr;
    throw RanksLostError("rank " + std::to_string(job_rank(rank())) + ": NCCL " + operation +
                       " did not finish within dist.timeout_s = " + std::to_string(int(timeout_s_)) + " s: " + suspect +
                       "; communicator aborted");
  }

  Communicator& host_;
  std::unique_ptr<Communicator> owned_host_;  // a split's host group, which host_ then refers to
  int device_;
  double timeout_s_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t compute_done_ = nullptr;
  // Queued collectives (and queue_wait()ed requests) not yet retired, oldest first, and events
  // for reuse.
  struct Queued {
    cudaEvent_t event;
    std::chrono::steady_clock::time_point at;
    std::string operation, suspect;
  };
  static constexpr std::size_t max_queued = 64;
  std::deque<Queued> queued_;
  std::vector<cudaEvent_t> spare_events_;
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(Communicator& host, int device, double timeout_s) {
  return std::make_unique<NcclCommunicator>(host, device, timeout_s);
}

}  // namespace llmtrain::dist
