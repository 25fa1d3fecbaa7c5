// ZeRO 0's bucketed all-reduce starts during the update's last backward, from the model's pass
// events, and not during the backwards before it. A stand-in for a group of two ranks counts the
// all-reduces started (its collectives leave the data as it is: only when they start matters).
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "catch_compat.h"
#include "config/config.h"
#include "core/error.h"
#include "dist/communicator.h"
#include "model/model.h"
#include "parallel/gradient_strategy.h"

using namespace llmtrain;

namespace {

class Done final : public dist::Request {
 public:
  void wait() override {}
};

// Rank 0 of two whose collectives change nothing; transfers are not expected.
class TwoRankStandIn final : public dist::Communicator {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 2; }
  std::string name() const override { return "stand-in"; }
  std::int64_t started = 0;  // all-reduces started (not the blocking ones)
  std::unique_ptr<dist::Communicator> split(int, int) override { throw RuntimeError("stand-in: no split"); }

 protected:
  void do_all_reduce_sum(float*, std::int64_t) override {}
  void do_all_reduce_sum(double*, std::int64_t) override {}
  void do_all_reduce_max(std::int64_t*, std::int64_t) override {}
  void do_all_reduce_max(float*, std::int64_t) override {}
  std::unique_ptr<dist::Request> do_start_all_reduce_sum(float*, std::int64_t) override {
    ++started;
    return std::make_unique<Done>();
  }
  std::unique_ptr<dist::Request> do_start_reduce_scatter_sum(const float*, float*, std::int64_t) override {
    return std::make_unique<Done>();
  }
  std::unique_ptr<dist::Request> do_start_all_gather(const void*, void*, std::int64_t, DType) override {
    return std::make_unique<Done>();
  }
  void do_broadcast(float*, std::int64_t, int) override {}
  void do_barrier() override {}
  std::unique_ptr<dist::Request> do_start_send(const void*, std::int64_t, DType, int) override {
    throw RuntimeError("stand-in: no transfers");
  }
  std::unique_ptr<dist::Request> do_start_recv(void*, std::int64_t, DType, int) override {
    throw RuntimeError("stand-in: no transfers");
  }
  std::unique_ptr<dist::Request> do_start_exchange(const void*, void*, std::int64_t, DType, int, int) override {
    throw RuntimeError("stand-in: no transfers");
  }
};

}  // namespace

TEST_CASE("ZeRO 0 starts its all-reduces during the backward armed for it, from the model's pass events",
          "[parallel][zero]") {
  config::ModelConfig c;
  c.arch = config::Arch::gpt2;
  c.vocab_size = 64;
  c.context_length = 8;
  c.n_layer = 3;
  c.n_head = 2;
  c.n_kv_head = 2;
  c.d_model = 16;
  c.ffn_hidden = 64;
  const auto model = model::make_model(c, Device::cpu);
  model->init_weights(3);
  config::DistConfig dist;
  dist.zero_stage = 0;
  dist.bucket_mb = 4.0 * 1024 / (1024.0 * 1024.0);  // buckets of 1,024 elements
  TwoRankStandIn comm;
  const auto gradients = parallel::make_gradient_strategy(*model, dist, comm, comm, {}, {});
  const std::int64_t P = model->num_params(), buckets = (P + 1023) / 1024;
  REQUIRE(buckets > 3);

  const int B = 2, T = 8;
  std::vector<std::int32_t> inputs(B * T), targets(B * T);
  for (int i = 0; i < B * T; ++i) inputs[std::size_t(i)] = (7 * i) % 64, targets[std::size_t(i)] = (5 * i + 1) % 64;
  const auto started = [&] { return comm.started; };

  gradients->zero_grads();
  // A micro-step before the last: its backward starts nothing.
  model->forward(inputs.data(), targets.data(), B, T, 1.0f);
  model->backward();
  CHECK(started() == 0);
  // The last: each layer's backward starts the buckets its gradients complete, the rest start
  // when backward ends, every one of them before finish().
  gradients->reduce_during_next_backward();
  model->forward(inputs.data(), targets.data(), B, T, 1.0f);
  model->backward();
  CHECK(started() == buckets);
  double loss = 0.0;
  gradients->finish(loss);
  CHECK(started() == buckets);  // finish() only waits for them
  // The next update's backwards start nothing until armed again.
  gradients->zero_grads();
  model->forward(inputs.data(), targets.data(), B, T, 1.0f);
  model->backward();
  CHECK(started() == buckets);
}
