#include "parallel/gradient_strategy.h"

#include "ops/ops.h"
#include "parallel/zero3.h"

namespace llmtrain::parallel {
namespace {

// ZeRO 0, 1 and 2: every rank keeps all weights and gradients; GradientSync reduces them, from
// the model's pass events during the update's last backward where the executor allows it.
class BucketedSync final : public GradientStrategy, public model::PassObserver {
 public:
  BucketedSync(model::Model& model, const config::DistConfig& dist, dist::Communicator& comm,
               dist::Communicator& host_comm, NormScope norm, ExpertScope expert)
      : model_(model), sync_(comm, host_comm, model.grads(), dist.bucket_mb, int(dist.zero_stage)) {
    sync_.set_norm_scope(std::move(norm));
    sync_.set_expert_scope(std::move(expert));
    model_.set_observer(this);
  }
  ~BucketedSync() override { model_.set_observer(nullptr); }
  BucketedSync(const BucketedSync&) = delete;
  BucketedSync& operator=(const BucketedSync&) = delete;

  // The first n elements of the gradients are final after layer l's backward (n: where its
  // parameters end) and all of them at the end; only during the backward armed for it.
  void on(model::PassEvent event, int layer) override {
    if (!reducing_) return;
    if (event == model::PassEvent::after_backward) sync_.on_ready(model_.layer_params(layer).end);
    if (event == model::PassEvent::backward_ends) {
      sync_.on_ready(model_.num_params());
      reducing_ = false;
    }
  }

  std::vector<optim::Piece> held() const override { return {{{0, model_.num_params()}, 0}}; }
  Tensor held_weights() const override { return model_.params(); }
  void weights_loaded() override {}  // the next forward converts params() afresh
  std::vector<optim::Piece> pieces() const override { return {{sync_.begin(), sync_.end(), 0}}; }

  void zero_grads() override { model_.zero_grads(); }
  void reduce_during_next_backward() override { reducing_ = true; }
  double finish(double& loss_sum) override { return sync_.finish(loss_sum); }

  Tensor master() const override {
    return Tensor(model_.params().as<float>() + sync_.begin(), DType::f32, model_.device(),
                  {sync_.end() - sync_.begin()});
  }
  Tensor grads() const override { return sync_.grads(); }
  // Mixed precision: when this rank updates every weight, the optimizer writes the bf16 working
  // copy in the same pass; a ZeRO 1/2 shard's update leaves the rest to the all-gather, and the
  // next forward converts all of it (once per update either way, not once per micro-step).
  Tensor working_weights() const override { return updates_all() ? model_.working_weights() : Tensor(); }
  void weights_updated() override {
    const bool working_written = working_weights().data != nullptr;
    sync_.gather_params(model_.params().as<float>());
    if (working_written) model_.working_weights_written();
  }

  bool replicated() const override { return true; }
  bool shards_optimizer() const override { return sync_.zero_stage() > 0; }
  std::size_t state_bytes() const override { return sync_.state_bytes(); }

 private:
  bool updates_all() const { return sync_.begin() == 0 && sync_.end() == model_.num_params(); }

  model::Model& model_;
  GradientSync sync_;
  bool reducing_ = false;  // reduce_during_next_backward until its backward ends
};

// ZeRO 3: each rank keeps its shards of every unit; Zero3 gathers and reduce-scatters them as
// forward and backward reach each layer (the model's pass events, which it observes).
class ShardedUnits final : public GradientStrategy {
 public:
  ShardedUnits(model::Model& model, const config::DistConfig& dist, dist::Communicator& comm,
               dist::Communicator& host_comm, NormScope norm, ExpertScope expert)
      : zero3_(model, comm, host_comm, dist.reshard_after_forward) {
    zero3_.set_norm_scope(std::move(norm));
    zero3_.set_expert_scope(std::move(expert));
  }

  std::vector<optim::Piece> held() const override { return zero3_.pieces(); }
  Tensor held_weights() const override { return zero3_.master(); }
  void weights_loaded() override { zero3_.weights_changed(); }
  std::vector<optim::Piece> pieces() const override { return zero3_.pieces(); }

  void zero_grads() override { zero3_.zero_grads(); }
  void reduce_during_next_backward() override {}  // Zero3 reduces each unit as backward leaves it
  double finish(double& loss_sum) override { return zero3_.finish(loss_sum); }

  Tensor master() const override { return zero3_.master(); }
  Tensor grads() const override { return zero3_.grads(); }
  Tensor working_weights() const override { return Tensor(); }  // gathered in the compute dtype
  void weights_updated() override { zero3_.weights_changed(); }

  bool replicated() const override { return false; }
  bool shards_optimizer() const override { return true; }
  std::size_t state_bytes() const override { return zero3_.state_bytes(); }

 private:
  Zero3 zero3_;
};

}  // namespace

std::unique_ptr<GradientStrategy> make_gradient_strategy(model::Model& model, const config::DistConfig& dist,
                                                         dist::Communicator& comm, dist::Communicator& host_comm,
                                                         NormScope norm, ExpertScope expert) {
  if (dist.zero_stage == 3) {
    return std::make_unique<ShardedUnits>(model, dist, comm, host_comm, std::move(norm), std::move(expert));
  }
  return std::make_unique<BucketedSync>(model, dist, comm, host_comm, std::move(norm), std::move(expert));
}

}  // namespace llmtrain::parallel
