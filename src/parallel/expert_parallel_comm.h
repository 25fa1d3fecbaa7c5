// Expert parallelism's parts outside the model: the MoE layers' all-to-alls over the expert
// group's communicators, and which gradients the ranks of an expert group hold alike (every
// parameter but the experts'), which are summed over the group after the data-parallel reduction.
#pragma once

#include <cstdint>
#include <vector>

#include "dist/communicator.h"
#include "model/flat_layout.h"
#include "model/model.h"
#include "model/moe_layer.h"

namespace llmtrain::parallel {

/// Expert parallelism as a model's share of the experts: this rank's place in the expert group,
/// whose communicators carry the exchange, `host` the counts and `device` the rows (in the memory
/// the activations live in; the same as `host` on the CPU).
class ExpertParallel final : public model::ExpertShare {
 public:
  ExpertParallel(dist::Communicator& host, dist::Communicator& device)
      : rank_(host.rank()), size_(host.world_size()), host_(&host), device_(&device) {}
  /// Rank `rank` of `size` with nothing to exchange over (a layout measured, never run).
  ExpertParallel(int rank, int size) : rank_(rank), size_(size) {}
  int index() const override { return rank_; }
  int parts() const override { return size_; }
  void exchange_counts(const std::vector<std::int32_t>& send, std::vector<std::int32_t>& recv) override;
  void all_to_all(const Tensor& send, const std::vector<std::int64_t>& send_rows, const Tensor& recv,
                  const std::vector<std::int64_t>& recv_rows) override;

 private:
  dist::Communicator& host() const;
  dist::Communicator& device() const;

  int rank_, size_;
  dist::Communicator* host_ = nullptr;
  dist::Communicator* device_ = nullptr;
};

/// The flat ranges of a local buffer laid out by `infos` (a model's, or plan's rank share's) that
/// every rank of an expert group holds alike: the runs of the parameters that are not an expert's.
std::vector<model::FlatRange> expert_shared_ranges(const std::vector<model::ParamInfo>& infos);

/// Sums over `group` the gradients of `grads` (the local buffer's elements [begin, begin +
/// grads.numel())) that lie in `shared` (expert_shared_ranges): one all-reduce per range.
void sum_shared_grads(dist::Communicator& group, const Tensor& grads, std::int64_t begin,
                      const std::vector<model::FlatRange>& shared);

}  // namespace llmtrain::parallel
