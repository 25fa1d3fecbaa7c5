// A communicator of device buffers over one of host buffers, for the device tests of tensor and
// context parallelism under mpirun: each call copies its device input to the host, runs it there
// (MPI between the processes), and copies the result back. Two ranks may then share one GPU, and
// the CUDA emulator (dev/cuda_emu), which has no NCCL between processes, runs them. Only what
// CommTensorGroup, CommContextGroup and ExpertParallel call; the rest throws. Also the job those
// tests run in, and whether a case can run there.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "dist/communicator.h"
#include "ops/buffer.h"

namespace llmtrain::test {

class StagedCommunicator final : public dist::Communicator {
 public:
  explicit StagedCommunicator(dist::Communicator& host) : host_(host) {}
  int rank() const override { return host_.rank(); }
  int world_size() const override { return host_.world_size(); }
  std::string name() const override { return "staged " + host_.name(); }
  std::unique_ptr<dist::Communicator> split(int, int) override { unsupported("split"); }

 protected:
  void do_all_reduce_sum(float* data, std::int64_t count) override {
    std::vector<float> host = staged_out<float>(data, count);
    host_.all_reduce_sum(host.data(), count);
    staged_in(data, host);
  }
  void do_all_reduce_max(float* data, std::int64_t count) override {
    std::vector<float> host = staged_out<float>(data, count);
    host_.all_reduce_max(host.data(), count);
    staged_in(data, host);
  }
  std::unique_ptr<dist::Request> do_start_reduce_scatter_sum(const float* send, float* recv,
                                                             std::int64_t shard) override {
    const std::vector<float> whole = staged_out<float>(send, shard * world_size());
    std::vector<float> part(static_cast<std::size_t>(shard));
    host_.reduce_scatter_sum(whole.data(), part.data(), shard);
    staged_in(recv, part);
    return std::make_unique<Done>();
  }
  std::unique_ptr<dist::Request> do_start_all_gather(const void* send, void* recv, std::int64_t shard,
                                                     DType dtype) override {
    if (dtype != DType::f32 && dtype != DType::bf16) unsupported("all_gather of this dtype");
    const std::int64_t words = shard * std::int64_t(dtype_size(dtype) / 2);  // 16-bit words
    const std::vector<std::uint16_t> part = staged_out<std::uint16_t>(send, words);
    std::vector<std::uint16_t> whole(std::size_t(words * world_size()));
    host_.all_gather(part.data(), whole.data(), shard, dtype);
    staged_in(recv, whole);
    return std::make_unique<Done>();
  }
  // The host exchange is started here; its wait() waits for it and copies what came to the device.
  std::unique_ptr<dist::Request> do_start_exchange(const void* send, void* recv, std::int64_t count, DType dtype,
                                                   int send_to, int recv_from) override {
    if (dtype != DType::f32 && dtype != DType::bf16) unsupported("exchange of this dtype");
    const std::int64_t words = count * std::int64_t(dtype_size(dtype) / 2);
    auto exchange = std::make_unique<Exchange>();
    exchange->sent = staged_out<std::uint16_t>(send, words);
    exchange->received.resize(std::size_t(words));
    exchange->device = recv;
    exchange->host = host_.start_exchange(exchange->sent.data(), exchange->received.data(), count, dtype, send_to,
                                          recv_from);
    return exchange;
  }
  // Rows of f32 or bf16 (16-bit words) to every rank and back.
  std::unique_ptr<dist::Request> do_start_all_to_all(const void* send, const std::vector<std::int64_t>& send_counts,
                                                     void* recv, const std::vector<std::int64_t>& recv_counts,
                                                     DType dtype) override {
    if (dtype != DType::f32 && dtype != DType::bf16) unsupported("all_to_all of this dtype");
    const std::int64_t per = std::int64_t(dtype_size(dtype) / 2);
    std::vector<std::int64_t> sends, recvs;
    std::int64_t sent = 0, received = 0;
    for (const std::int64_t n : send_counts) sends.push_back(n * per), sent += n * per;
    for (const std::int64_t n : recv_counts) recvs.push_back(n * per), received += n * per;
    const std::vector<std::uint16_t> out = staged_out<std::uint16_t>(send, sent);
    std::vector<std::uint16_t> in(static_cast<std::size_t>(received));
    host_.all_to_all(out.data(), sends, in.data(), recvs, DType::u16);
    staged_in(recv, in);
    return std::make_unique<Done>();
  }
  void do_all_reduce_sum(double*, std::int64_t) override { unsupported("all_reduce_sum of f64"); }
  void do_all_reduce_max(std::int64_t*, std::int64_t) override { unsupported("all_reduce_max of i64"); }
  std::unique_ptr<dist::Request> do_start_all_reduce_sum(float*, std::int64_t) override {
    unsupported("start_all_reduce_sum");
  }
  void do_broadcast(float*, std::int64_t, int) override { unsupported("broadcast"); }
  void do_barrier() override { host_.barrier(); }
  std::unique_ptr<dist::Request> do_start_send(const void*, std::int64_t, DType, int) override { unsupported("send"); }
  std::unique_ptr<dist::Request> do_start_recv(void*, std::int64_t, DType, int) override { unsupported("recv"); }

 private:
  struct Done final : dist::Request {
    void wait() override {}
  };
  struct Exchange final : dist::Request {
    std::vector<std::uint16_t> sent, received;
    void* device = nullptr;
    std::unique_ptr<dist::Request> host;
    void wait() override {
      if (!host) return;
      host->wait();
      host.reset();
      staged_in(device, received);
    }
  };
  [[noreturn]] static void unsupported(const char* what) {
    throw RuntimeError(std::string("StagedCommunicator: no ") + what + " (the model's groups do not call it)");
  }
  // Elements of 4 bytes (f32) or 2 (bf16 as 16-bit words).
  template <class T>
  static std::vector<T> staged_out(const void* device, std::int64_t n) {
    std::vector<T> host(static_cast<std::size_t>(n));
    const DType as = sizeof(T) == 4 ? DType::f32 : DType::u16;
    if (n == 0) return host;
    ops::copy(Tensor(host.data(), as, Device::cpu, {n}), Tensor(const_cast<void*>(device), as, Device::cuda, {n}));
    return host;
  }
  template <class T>
  static void staged_in(void* device, std::vector<T>& host) {
    const DType as = sizeof(T) == 4 ? DType::f32 : DType::u16;
    const std::int64_t n = std::int64_t(host.size());
    if (n == 0) return;
    ops::copy(Tensor(device, as, Device::cuda, {n}), Tensor(host.data(), as, Device::cpu, {n}));
  }

  dist::Communicator& host_;
};

/// The job's ranks, made once per process (MPI is finalised at exit, not after the first case).
inline dist::Communicator& job() {
  static const std::unique_ptr<dist::Communicator> comm = dist::make_communicator(false, 300.0);
  return *comm;
}

/// Whether a case with one `axis` rank per process ("tensor", "context", "expert") can run: a CUDA
/// device, and a job of 2 or 4 ranks; else `why` says what is missing.
inline bool device_job(const char* axis, std::string* why) {
  if (!ops::cuda_available(why)) {
    *why = "no CUDA device: " + *why;
    return false;
  }
  const int N = job().world_size();
  if (N != 2 && N != 4) {
    *why = std::string("needs mpirun -np 2 or -np 4 (one ") + axis + " rank per process), got " + std::to_string(N) +
           " rank(s)";
    return false;
  }
  return true;
}

}  // namespace llmtrain::test
