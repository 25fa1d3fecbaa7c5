// The NCCL communicator on a non-blocking communicator whose calls return ncclInProgress before
// their work is on the stream (the emulator's NCCL shim does so for its first polls): every
// collective's result must be there when the call returns. Two ranks are emulated, holding the
// same data, so a reduced buffer is twice the input and an unreduced one is not. Transfers: the
// shim's ranks run this same program, so a recv is filled with what this process sent to the
// mirrored rank; it must be there when wait() returns, and a recv no send matches must fail. The
// all-to-all likewise.
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "catch_compat.h"
#include "dist/communicator.h"
#include "dist/nccl_communicator.h"
#include "device/stream.h"
#include "llmtrain_emu/nccl_control.h"
#include "llmtrain_emu/runtime_control.h"
#include "shim_host.h"

using namespace llmtrain;

namespace {

// A device copy of `values`, and a host copy of `n` elements of device memory.
template <class T>
T* device_copy(const std::vector<T>& values) {
  T* p = nullptr;
  REQUIRE(cudaMalloc(reinterpret_cast<void**>(&p), values.size() * sizeof(T)) == cudaSuccess);
  REQUIRE(cudaMemcpy(p, values.data(), values.size() * sizeof(T), cudaMemcpyHostToDevice) == cudaSuccess);
  return p;
}

// The message of what `call` throws ("" if it does not).
template <class Call>
std::string thrown(Call call) {
  try {
    call();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

template <class T>
std::vector<T> host_copy(const T* device, size_t n) {
  std::vector<T> host(n);
  REQUIRE(cudaMemcpy(host.data(), device, n * sizeof(T), cudaMemcpyDeviceToHost) == cudaSuccess);
  return host;
}

}  // namespace

TEST_CASE("NCCL: a collective that returns ncclInProgress is complete when the call returns", "[cuda][dist]") {
  test::ShimHost host;
  const auto nccl = dist::make_nccl_communicator(host, 0, 30.0);
  const std::vector<float> values = {1.5f, -2.0f, 3.25f, 0.0f};
  const size_t n = values.size();
  float* data = nullptr;
  float* gathered = nullptr;
  REQUIRE(cudaMalloc(reinterpret_cast<void**>(&data), n * sizeof(float)) == cudaSuccess);
  REQUIRE(cudaMalloc(reinterpret_cast<void**>(&gathered), 2 * n * sizeof(float)) == cudaSuccess);
  auto upload = [&] {
    REQUIRE(cudaMemcpy(data, values.data(), n * sizeof(float), cudaMemcpyHostToDevice) == cudaSuccess);
  };
  const std::vector<float> doubled = {3.0f, -4.0f, 6.5f, 0.0f};

  upload();
  nccl->all_reduce_sum(data, std::int64_t(n));
  CHECK(host_copy(data, n) == doubled);  // the gradients an update would read

  upload();
  nccl->start_all_reduce_sum(data, std::int64_t(n))->wait();
  CHECK(host_copy(data, n) == doubled);

  upload();
  nccl->all_gather(data, gathered, std::int64_t(n));
  std::vector<float> both = values;
  both.insert(both.end(), values.begin(), values.end());
  CHECK(host_copy(gathered, 2 * n) == both);

  REQUIRE(cudaMemcpy(gathered, both.data(), 2 * n * sizeof(float), cudaMemcpyHostToDevice) == cudaSuccess);
  nccl->reduce_scatter_sum(gathered, data, std::int64_t(n));  // rank 0's shard, summed over 2 ranks
  CHECK(host_copy(data, n) == doubled);

  // ZeRO 3's started collectives: a reduce-scatter, and an in-place all-gather of bf16 words
  // (rank 0's part already at the start of the buffer).
  REQUIRE(cudaMemcpy(gathered, both.data(), 2 * n * sizeof(float), cudaMemcpyHostToDevice) == cudaSuccess);
  nccl->start_reduce_scatter_sum(gathered, data, std::int64_t(n))->wait();
  CHECK(host_copy(data, n) == doubled);
  const std::vector<std::uint16_t> words = {0x3fc0, 0xc000, 0x4050, 0x0000};  // 1.5, -2, 3.25, 0 in bf16
  std::vector<std::uint16_t> out(2 * n, 0xffff);
  REQUIRE(cudaMemcpy(gathered, words.data(), n * 2, cudaMemcpyHostToDevice) == cudaSuccess);
  nccl->start_all_gather(gathered, gathered, std::int64_t(n), DType::bf16)->wait();
  REQUIRE(cudaMemcpy(out.data(), gathered, 2 * n * 2, cudaMemcpyDeviceToHost) == cudaSuccess);
  std::vector<std::uint16_t> twice = words;
  twice.insert(twice.end(), words.begin(), words.end());
  CHECK(out == twice);
  CHECK(nccl->traffic().calls[dist::Traffic::all_gather] == 2);
  CHECK(nccl->traffic().bytes[dist::Traffic::all_gather] == n * 4 + n * 2);  // (2-1)/2 of 2n elements each
  cudaFree(data);
  cudaFree(gathered);
}

TEST_CASE("NCCL: transfers that return ncclInProgress are complete when wait() returns", "[cuda][dist]") {
  test::ShimHost host;
  const auto nccl = dist::make_nccl_communicator(host, 0, 30.0);
  const std::vector<float> values = {1.5f, -2.0f, 3.25f, 0.0f, 7.0f};
  const size_t n = values.size();
  const std::vector<float> blank(n, -99.0f);
  float* send = device_copy(values);
  float* recv = device_copy(blank);

  // An exchange with the other rank (one group): it sends its values, as this process does.
  nccl->start_exchange(send, recv, std::int64_t(n), DType::f32, 1)->wait();
  CHECK(host_copy(recv, n) == values);

  // A send, then a separate recv, each through the polling; then the blocking forms.
  REQUIRE(cudaMemcpy(recv, blank.data(), n * sizeof(float), cudaMemcpyHostToDevice) == cudaSuccess);
  auto sent = nccl->start_send(send, std::int64_t(n), DType::f32, 1);
  auto received = nccl->start_recv(recv, std::int64_t(n), DType::f32, 1);
  sent->wait();
  received->wait();
  CHECK(host_copy(recv, n) == values);
  REQUIRE(cudaMemcpy(recv, blank.data(), n * sizeof(float), cudaMemcpyHostToDevice) == cudaSuccess);
  nccl->send(send, 3, DType::f32, 1);
  nccl->recv(recv, 3, DType::f32, 1);
  CHECK(host_copy(recv, n) == std::vector<float>{1.5f, -2.0f, 3.25f, -99.0f, -99.0f});

  // bf16 and i32 words arrive unchanged.
  const std::vector<std::uint16_t> words = {0x3fc0, 0xc000, 0x4050, 0x0000, 0xff80};
  std::uint16_t* send16 = device_copy(words);
  std::uint16_t* recv16 = device_copy(std::vector<std::uint16_t>(n, 0xffff));
  nccl->start_exchange(send16, recv16, std::int64_t(n), DType::bf16, 1)->wait();
  CHECK(host_copy(recv16, n) == words);
  const std::vector<std::int32_t> ints = {-7, 0, 1 << 30, 42, -1};
  std::int32_t* send32 = device_copy(ints);
  std::int32_t* recv32 = device_copy(std::vector<std::int32_t>(n, 0));
  nccl->start_exchange(send32, recv32, std::int64_t(n), DType::i32, 1)->wait();
  CHECK(host_copy(recv32, n) == ints);

  // Counted: 5 sends (5, 5 and 3 f32, 5 bf16, 5 i32) and as many receives, which send no bytes.
  const dist::Traffic& t = nccl->traffic();
  CHECK(t.calls[dist::Traffic::send] == 5);
  CHECK(t.calls[dist::Traffic::recv] == 5);
  CHECK(t.bytes[dist::Traffic::send] == double((5 + 5 + 3 + 5) * 4 + 5 * 2));
  CHECK(t.bytes[dist::Traffic::recv] == 0.0);

  // Peers that are not another rank of the group are refused before NCCL is called.
  CHECK_THROWS_WITH(nccl->start_send(send, 1, DType::f32, 0), "send: rank 0 is this rank");
  CHECK_THROWS_WITH(nccl->start_recv(recv, 1, DType::f32, 2), "recv: peer rank 2 is not in this group of 2 ranks");
  for (void* p : {static_cast<void*>(send), static_cast<void*>(recv), static_cast<void*>(send16),
                  static_cast<void*>(recv16), static_cast<void*>(send32), static_cast<void*>(recv32)}) {
    cudaFree(p);
  }
}

TEST_CASE("NCCL: a ring exchange on 3 ranks, and recvs that no send matches fail", "[cuda][dist]") {
  const std::vector<float> values = {0.5f, 2.0f, -4.0f};
  float* send = device_copy(values);
  float* recv = device_copy(std::vector<float>(3, 0.0f));
  {
    // Rank 0 of 3 sends to 1 and receives from 2, which sends to 0 what this process sends to 1.
    test::ShimHost host(3);
    const auto nccl = dist::make_nccl_communicator(host, 0, 30.0);
    nccl->start_exchange(send, recv, 3, DType::f32, 1, 2)->wait();
    CHECK(host_copy(recv, 3) == values);
    // Rank 1 sends nothing to this rank: its sends go to rank 2 here, so nothing matches.
    nccl->send(send, 3, DType::f32, 1);
    CHECK(thrown([&] { nccl->recv(recv, 3, DType::f32, 1); }).find("NCCL error in ncclRecv") == 0);
  }
  {
    test::ShimHost host;
    const auto nccl = dist::make_nccl_communicator(host, 0, 30.0);
    nccl->send(send, 2, DType::f32, 1);  // 2 elements sent, 3 expected
    CHECK(thrown([&] { nccl->recv(recv, 3, DType::f32, 1); }).find("NCCL error in ncclRecv") == 0);
  }
  {
    test::ShimHost host;
    const auto nccl = dist::make_nccl_communicator(host, 0, 30.0);
    std::vector<float> on_host(3);  // not device memory
    CHECK(thrown([&] { nccl->start_send(on_host.data(), 3, DType::f32, 1); }).find("NCCL error in ncclSend") == 0);
  }
  cudaFree(send);
  cudaFree(recv);
}

TEST_CASE("NCCL: start_transfers sends and receives in both directions in one group", "[cuda][dist]") {
  // Rank 0 of 3, as a middle pipeline stage would: an activation to 1 and a gradient to 2, an
  // activation from 2 and a gradient from 1, all in one group. Every emulated rank runs this same
  // program, so what arrives from 2 is what this process sends to 1, and from 1 what it sends to 2.
  test::ShimHost host(3);
  const auto nccl = dist::make_nccl_communicator(host, 0, 30.0);
  const std::vector<float> activation = {1.0f, 2.0f, 3.0f, 4.0f};
  const std::vector<std::uint16_t> gradient = {0x3f80, 0xbf80, 0x4000};
  float* act_out = device_copy(activation);
  float* act_in = device_copy(std::vector<float>(4, -99.0f));
  std::uint16_t* grad_out = device_copy(gradient);
  std::uint16_t* grad_in = device_copy(std::vector<std::uint16_t>(3, 0xffff));
  nccl->start_transfers({{dist::PeerTransfer::send, act_out, 4, DType::f32, 1},
                         {dist::PeerTransfer::send, grad_out, 3, DType::bf16, 2},
                         {dist::PeerTransfer::recv, act_in, 4, DType::f32, 2},
                         {dist::PeerTransfer::recv, grad_in, 3, DType::bf16, 1}})
      ->wait();
  CHECK(host_copy(act_in, 4) == activation);
  CHECK(host_copy(grad_in, 3) == gradient);
  const dist::Traffic& t = nccl->traffic();
  CHECK(t.calls[dist::Traffic::send] == 2);
  CHECK(t.calls[dist::Traffic::recv] == 2);
  CHECK(t.bytes[dist::Traffic::send] == 4 * 4 + 3 * 2);
  // A peer outside the group is refused before NCCL is called.
  CHECK_THROWS_WITH(nccl->start_transfers({{dist::PeerTransfer::send, act_out, 4, DType::f32, 3}}),
                    "transfers (send): peer rank 3 is not in this group of 3 ranks");
  for (void* p : {static_cast<void*>(act_out), static_cast<void*>(act_in), static_cast<void*>(grad_out),
                  static_cast<void*>(grad_in)}) {
    cudaFree(p);
  }
}

TEST_CASE("NCCL: an all-to-all of varying counts at 2 and 3 ranks: its own part copied, the others' in one group",
          "[cuda][dist]") {
  const std::vector<float> values = {1.0f, 2.0f, 3.0f, 4.0f, 5.0f, 6.0f, 7.0f};
  float* send = device_copy(values);
  float* recv = device_copy(std::vector<float>(values.size(), -99.0f));
  {
    // Rank 0 of 2 keeps 2 elements and sends 5 to rank 1; rank 1, running this same program
    // mirrored, sends rank 0 the 5 this process sends it.
    test::ShimHost host;
    const auto nccl = dist::make_nccl_communicator(host, 0, 30.0);
    nccl->all_to_all(send, {2, 5}, recv, {2, 5}, DType::f32);
    CHECK(host_copy(recv, 7) == values);
    const dist::Traffic& t = nccl->traffic();
    CHECK(t.calls[dist::Traffic::all_to_all] == 1);
    CHECK(t.bytes[dist::Traffic::all_to_all] == 5 * 4);  // its own part is not sent
    CHECK_THROWS_WITH(nccl->all_to_all(send, {2}, recv, {2, 5}, DType::f32),
                      "all_to_all: expected 2 send and receive counts, got 1 and 2");
  }
  {
    // Rank 0 of 3 keeps 1, sends 2 to rank 1 and 4 to rank 2; from rank 1 comes what this process
    // sends rank 2 (4), from rank 2 what it sends rank 1 (2). A part of 0 elements is no call.
    test::ShimHost host(3);
    const auto nccl = dist::make_nccl_communicator(host, 0, 30.0);
    nccl->all_to_all(send, {1, 2, 4}, recv, {1, 4, 2}, DType::f32);
    CHECK(host_copy(recv, 7) == std::vector<float>{1.0f, 4.0f, 5.0f, 6.0f, 7.0f, 2.0f, 3.0f});
    nccl->all_to_all(send, {3, 0, 0}, recv, {3, 0, 0}, DType::f32);
    CHECK(host_copy(recv, 3) == std::vector<float>{1.0f, 2.0f, 3.0f});
  }
  cudaFree(send);
  cudaFree(recv);
}

namespace {

// Element i of a buffer: distinct everywhere, so a piece in the wrong place shows.
std::vector<float> ramp(std::size_t n, float base) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = base + 0.25f * float(i) - 0.001f * float(i * i % 17);
  return v;
}

// Every collective and transfer of `nccl` (3 emulated ranks) on n elements (per shard), the
// results' bytes in order.
std::vector<std::vector<char>> every_call(dist::Communicator& nccl, std::size_t n) {
  const int W = nccl.world_size();
  std::vector<std::vector<char>> out;
  const auto keep = [&](const void* device, std::size_t bytes) {
    std::vector<char> host(bytes);
    REQUIRE(cudaMemcpy(host.data(), device, bytes, cudaMemcpyDeviceToHost) == cudaSuccess);
    out.push_back(host);
  };
  const std::int64_t count = std::int64_t(n);
  float* a = device_copy(ramp(n, 1.0f));
  nccl.all_reduce_sum(a, count);
  keep(a, n * 4);
  nccl.start_all_reduce_sum(a, count)->wait();
  keep(a, n * 4);
  nccl.all_reduce_max(a, count);
  keep(a, n * 4);
  double* d = device_copy(std::vector<double>(n, 0.125));
  nccl.all_reduce_sum(d, count);
  keep(d, n * 8);
  std::int64_t* k = device_copy(std::vector<std::int64_t>(n, -3));
  nccl.all_reduce_max(k, count);
  keep(k, n * 8);
  float* whole = device_copy(ramp(n * std::size_t(W), -5.0f));
  float* shard = device_copy(std::vector<float>(n, -99.0f));
  nccl.start_reduce_scatter_sum(whole, shard, count)->wait();  // rank 0's shard: 3 x whole[0, n)
  keep(shard, n * 4);
  nccl.all_gather(shard, whole, count);
  keep(whole, n * 4 * std::size_t(W));
  std::vector<std::uint16_t> words(n * std::size_t(W), 0xffff);
  for (std::size_t i = 0; i < n; ++i) words[i] = std::uint16_t(0x3f00 + i);
  std::uint16_t* w = device_copy(words);
  nccl.start_all_gather(w, w, count, DType::bf16)->wait();  // in place: rank 0's part first
  keep(w, words.size() * 2);
  float* b = device_copy(ramp(n, 9.0f));
  nccl.broadcast(b, count, 2);
  keep(b, n * 4);
  float* got = device_copy(std::vector<float>(n, -99.0f));
  nccl.start_exchange(a, got, count, DType::f32, 1, 2)->wait();
  keep(got, n * 4);
  auto sent = nccl.start_send(b, count, DType::f32, 1);
  nccl.recv(got, count, DType::f32, 2);
  sent->wait();
  keep(got, n * 4);
  float* g2 = device_copy(std::vector<float>(n, -99.0f));
  nccl.start_transfers({{dist::PeerTransfer::send, a, count, DType::f32, 1},
                        {dist::PeerTransfer::send, b, count, DType::f32, 2},
                        {dist::PeerTransfer::recv, got, count, DType::f32, 2},
                        {dist::PeerTransfer::recv, g2, count, DType::f32, 1}})
      ->wait();
  keep(got, n * 4);
  keep(g2, n * 4);
  // All-to-all: count elements stay, count + 1 to rank 1, 2 to rank 2; from rank 1 come what this
  // process sends rank 2, from rank 2 what it sends rank 1.
  float* parts = device_copy(ramp(2 * n + 3, 3.0f));
  float* gathered = device_copy(std::vector<float>(2 * n + 3, -99.0f));
  nccl.start_all_to_all(parts, {count, count + 1, 2}, gathered, {count, 2, count + 1}, DType::f32)->wait();
  keep(gathered, (2 * n + 3) * 4);
  for (void* p : {static_cast<void*>(a), static_cast<void*>(d), static_cast<void*>(k), static_cast<void*>(whole),
                  static_cast<void*>(shard), static_cast<void*>(w), static_cast<void*>(b), static_cast<void*>(got),
                  static_cast<void*>(g2), static_cast<void*>(parts), static_cast<void*>(gathered)}) {
    cudaFree(p);
  }
  return out;
}

}  // namespace

// LLMTRAIN_COMM_MAX_ELEMENTS = 7 (and 1): every call of more elements is made in pieces (counted
// here in the shim's calls), with the same bytes as the whole calls; each still counted once.
TEST_CASE("NCCL: collectives and transfers in pieces give the whole calls' bytes", "[cuda][dist]") {
  test::ShimHost host(3);
  const auto nccl = dist::make_nccl_communicator(host, 0, 30.0);
  for (const std::size_t n : {std::size_t(1), std::size_t(7), std::size_t(8), std::size_t(20)}) {
    CAPTURE(n);
    const std::int64_t rs0 = llmtrain_emu::nccl_calls("ncclReduceScatter");
    const dist::Traffic start = nccl->traffic();
    const auto whole = every_call(*nccl, n);
    const dist::Traffic once = nccl->traffic().since(start);
    CHECK(llmtrain_emu::nccl_calls("ncclReduceScatter") - rs0 == 1);
    const dist::Traffic before = nccl->traffic();
    for (const char* limit : {"7", "1"}) {
      CAPTURE(limit);
      const auto pieces_of = [&](std::size_t count) {
        return (count + std::size_t(std::atoi(limit)) - 1) / std::size_t(std::atoi(limit));
      };
      const std::size_t pieces = pieces_of(n);
      const std::int64_t all_reduce0 = llmtrain_emu::nccl_calls("ncclAllReduce"),
                         reduce_scatter0 = llmtrain_emu::nccl_calls("ncclReduceScatter"),
                         all_gather0 = llmtrain_emu::nccl_calls("ncclAllGather"),
                         broadcast0 = llmtrain_emu::nccl_calls("ncclBroadcast"), send0 = llmtrain_emu::nccl_calls("ncclSend");
      setenv("LLMTRAIN_COMM_MAX_ELEMENTS", limit, 1);
      const auto split = every_call(*nccl, n);
      unsetenv("LLMTRAIN_COMM_MAX_ELEMENTS");
      REQUIRE(split.size() == whole.size());
      for (std::size_t i = 0; i < whole.size(); ++i) {
        CAPTURE(i);
        CHECK(split[i] == whole[i]);
      }
      CHECK(llmtrain_emu::nccl_calls("ncclAllReduce") - all_reduce0 == std::int64_t(5 * pieces));
      CHECK(llmtrain_emu::nccl_calls("ncclReduceScatter") - reduce_scatter0 == std::int64_t(pieces));
      CHECK(llmtrain_emu::nccl_calls("ncclAllGather") - all_gather0 == std::int64_t(2 * pieces));
      CHECK(llmtrain_emu::nccl_calls("ncclBroadcast") - broadcast0 == std::int64_t(pieces));
      // 4 transfers of n, then the all-to-all's parts of n + 1 and 2 elements.
      CHECK(llmtrain_emu::nccl_calls("ncclSend") - send0 == std::int64_t(4 * pieces + pieces_of(n + 1) + pieces_of(2)));
    }
    // The split calls (twice: 7 and 1) counted as the whole ones were: once each, the same bytes.
    const dist::Traffic t = nccl->traffic().since(before);
    for (int kind = 0; kind < dist::Traffic::kinds; ++kind) {
      CHECK(t.calls[kind] == 2 * once.calls[kind]);
      CHECK(std::abs(t.bytes[kind] - 2 * once.bytes[kind]) <= 1e-9 * (1 + once.bytes[kind]));
    }
    CHECK(once.calls[dist::Traffic::all_reduce] == 5);
  }
}

namespace {

// Calls of the runtime with which the host waits for the device.
std::int64_t host_syncs() {
  return llmtrain_emu::runtime_calls("cudaDeviceSynchronize") + llmtrain_emu::runtime_calls("cudaStreamSynchronize") +
         llmtrain_emu::runtime_calls("cudaEventSynchronize");
}

}  // namespace

// ZeRO 3 starts a layer's gather, then the next layer's reduce-scatter, and waits for the gather:
// its wait() queries its own event, recorded right after it on the communicator's stream, never
// the whole stream (which would wait for the reduce-scatter queued behind it). The blocking calls
// still wait for the stream.
TEST_CASE("NCCL: a started collective's wait() waits for its own event, not the communicator's stream",
          "[cuda][dist]") {
  test::ShimHost host;
  const auto nccl = dist::make_nccl_communicator(host, 0, 30.0);
  const std::vector<float> values = {1.0f, 2.0f, 3.0f, 4.0f};
  float* part = device_copy(std::vector<float>{0.5f, -1.5f});
  float* gathered = device_copy(std::vector<float>(4, -99.0f));
  float* sums = device_copy(values);
  float* summed = device_copy(std::vector<float>(2, -99.0f));
  auto gather = nccl->start_all_gather(part, gathered, 2, DType::f32);
  auto reduce = nccl->start_reduce_scatter_sum(sums, summed, 2);
  const std::int64_t stream_queries = llmtrain_emu::runtime_calls("cudaStreamQuery");
  const std::int64_t event_queries = llmtrain_emu::runtime_calls("cudaEventQuery");
  const std::int64_t syncs = host_syncs();
  gather->wait();
  CHECK(llmtrain_emu::runtime_calls("cudaStreamQuery") == stream_queries);
  CHECK(llmtrain_emu::runtime_calls("cudaEventQuery") > event_queries);
  CHECK(host_copy(gathered, 4) == std::vector<float>{0.5f, -1.5f, 0.5f, -1.5f});
  reduce->wait();
  CHECK(llmtrain_emu::runtime_calls("cudaStreamQuery") == stream_queries);
  CHECK(host_syncs() == syncs);
  CHECK(host_copy(summed, 2) == std::vector<float>{2.0f, 4.0f});
  // A bucket's all-reduce too; a blocking all-reduce waits for the stream.
  auto bucket = nccl->start_all_reduce_sum(sums, 4);
  bucket->wait();
  CHECK(llmtrain_emu::runtime_calls("cudaStreamQuery") == stream_queries);
  nccl->all_reduce_sum(sums, 4);
  CHECK(llmtrain_emu::runtime_calls("cudaStreamQuery") > stream_queries);
  CHECK(host_copy(sums, 4) == std::vector<float>{4.0f, 8.0f, 12.0f, 16.0f});
  for (void* p : {static_cast<void*>(part), static_cast<void*>(gathered), static_cast<void*>(sums),
                  static_cast<void*>(summed)}) {
    cudaFree(p);
  }
}

// Tensor parallelism's collectives: queued, each makes the compute stream wait for its event (two
// stream-event waits: the communicator's stream after the compute stream's work, the compute
// stream after the collective) and returns without the host waiting (no synchronize, no stream
// query); bf16 is summed as bf16 (2-byte elements counted); wait_queued() waits on the host.
TEST_CASE("NCCL: queued collectives are ordered on the compute stream without a host wait, bf16 summed in bf16",
          "[cuda][dist]") {
  test::ShimHost host;
  const auto nccl = dist::make_nccl_communicator(host, 0, 30.0);
  REQUIRE(nccl->sums_bf16());
  const std::vector<std::uint16_t> words = {0x3fc0, 0xc000, 0x4050, 0x3f81};  // 1.5, -2, 3.25, 1.0078125
  std::uint16_t* activations = device_copy(words);
  std::uint16_t* full = device_copy(std::vector<std::uint16_t>{0x3f80, 0x4000, 0x4040, 0x4080});  // 1 2 3 4
  std::uint16_t* part = device_copy(std::vector<std::uint16_t>(2, 0xffff));
  std::uint16_t* gathered = device_copy(std::vector<std::uint16_t>(4, 0xffff));
  float* f32 = device_copy(std::vector<float>{0.25f, 8.0f});
  const std::int64_t syncs = host_syncs(), stream_queries = llmtrain_emu::runtime_calls("cudaStreamQuery");
  const std::int64_t waits = llmtrain_emu::runtime_calls("cudaStreamWaitEvent");
  const dist::Traffic before = nccl->traffic();
  nccl->queue_all_reduce_sum(activations, 4, DType::bf16);
  nccl->queue_reduce_scatter_sum(full, part, 2, DType::bf16);
  nccl->queue_all_gather(part, gathered, 2, DType::bf16);
  nccl->queue_all_reduce_sum(f32, 2, DType::f32);
  CHECK(host_syncs() == syncs);
  CHECK(llmtrain_emu::runtime_calls("cudaStreamQuery") == stream_queries);
  CHECK(llmtrain_emu::runtime_calls("cudaStreamWaitEvent") - waits == 2 * 4);
  const std::int64_t event_queries = llmtrain_emu::runtime_calls("cudaEventQuery");
  nccl->wait_queued();
  CHECK(llmtrain_emu::runtime_calls("cudaEventQuery") > event_queries);
  // Twice each value, in bf16: 3, -4, 6.5, 2.015625.
  CHECK(host_copy(activations, 4) == std::vector<std::uint16_t>{0x4040, 0xc080, 0x40d0, 0x4001});
  CHECK(host_copy(part, 2) == std::vector<std::uint16_t>{0x4000, 0x4080});  // rank 0's shard, twice 1 2
  CHECK(host_copy(gathered, 4) == std::vector<std::uint16_t>{0x4000, 0x4080, 0x4000, 0x4080});
  CHECK(host_copy(f32, 2) == std::vector<float>{0.5f, 16.0f});
  const dist::Traffic t = nccl->traffic().since(before);
  CHECK(t.calls[dist::Traffic::all_reduce] == 2);
  CHECK(t.bytes[dist::Traffic::all_reduce] == 2 * 0.5 * (4 * 2 + 2 * 4));  // ring: 2 (n-1)/n of 8 + 8 bytes
  CHECK(t.bytes[dist::Traffic::reduce_scatter] == 0.5 * 2 * 2 * 2);
  CHECK(t.bytes[dist::Traffic::all_gather] == 0.5 * 2 * 2 * 2);
  for (void* p : {static_cast<void*>(activations), static_cast<void*>(full), static_cast<void*>(part),
                  static_cast<void*>(gathered), static_cast<void*>(f32)}) {
    cudaFree(p);
  }
}

namespace {

// What the compute stream's next work reads at `device` (n floats): copied there on the compute
// stream, then read once it is done.
std::vector<float> read_on_compute(const float* device, size_t n) {
  std::vector<float> host(n);
  const cudaStream_t compute = device::compute_stream();
  REQUIRE(cudaMemcpyAsync(host.data(), device, n * sizeof(float), cudaMemcpyDeviceToHost, compute) == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(compute) == cudaSuccess);
  return host;
}

}  // namespace

// Context parallelism's ring: a started exchange's queue_wait() makes the compute stream wait for
// its event (one stream-event wait) without the host waiting (no synchronize, no query), and the
// compute stream's later work sees what arrived. The shim holds a transfer's data until something
// is ordered after it, so the compute stream reads the old contents without that wait (what a
// dropped wait would read). wait_queued() then checks the exchange on the host.
TEST_CASE("NCCL: queue_wait() orders the compute stream after a started exchange without a host wait",
          "[cuda][dist]") {
  test::ShimHost host;
  const auto nccl = dist::make_nccl_communicator(host, 0, 30.0);
  const std::vector<float> values = {1.5f, -2.0f, 3.25f}, blank(3, -99.0f);
  float* send = device_copy(values);
  float* recv = device_copy(blank);
  auto exchange = nccl->start_exchange(send, recv, 3, DType::f32, 1);
  CHECK(read_on_compute(recv, 3) == blank);  // not ordered after the exchange: not arrived yet
  const std::int64_t syncs = host_syncs(), stream_queries = llmtrain_emu::runtime_calls("cudaStreamQuery");
  const std::int64_t event_queries = llmtrain_emu::runtime_calls("cudaEventQuery");
  const std::int64_t waits = llmtrain_emu::runtime_calls("cudaStreamWaitEvent");
  exchange->queue_wait();
  exchange.reset();  // the communicator keeps what it needs
  CHECK(llmtrain_emu::runtime_calls("cudaStreamWaitEvent") - waits == 1);
  CHECK(host_syncs() == syncs);
  CHECK(llmtrain_emu::runtime_calls("cudaStreamQuery") == stream_queries);
  CHECK(llmtrain_emu::runtime_calls("cudaEventQuery") == event_queries);
  CHECK(read_on_compute(recv, 3) == values);
  nccl->wait_queued();
  CHECK(llmtrain_emu::runtime_calls("cudaEventQuery") > event_queries);

  // A ring's step: the next exchange starts after the compute stream's work so far, then is
  // queue-waited in turn; a later call retires the finished ones without a host wait.
  REQUIRE(cudaMemcpy(recv, blank.data(), 3 * sizeof(float), cudaMemcpyHostToDevice) == cudaSuccess);
  float* passed = device_copy(blank);
  nccl->start_exchange(send, recv, 3, DType::f32, 1)->queue_wait();
  nccl->start_exchange(recv, passed, 3, DType::f32, 1)->queue_wait();  // passes on what just arrived
  CHECK(read_on_compute(passed, 3) == values);
  CHECK(nccl->traffic().calls[dist::Traffic::send] == 3);
  nccl->wait_queued();
  for (float* p : {send, recv, passed}) cudaFree(p);
}
