#include "eval/val_loss.h"

#include <algorithm>

namespace llmtrain::eval {

double evaluate(model::Model& model, const data::TokenDataset& data, const config::Config& config,
                std::int64_t batches, dist::Communicator* comm) {
  const auto& t = config.train;
  const int T = int(config.model.context_length), B = int(t.micro_batch_size);
  const int context = model.sequence_parts();  // the ranks of a context group read the same sequences
  const int W = comm ? comm->world_size() / context : 1, rank = comm ? comm->rank() / context : 0;
  const data::SamplerOptions in_order{data.num_samples(), t.global_batch_size, B, W, rank, false, 0};
  data::BatchLoader loader(data, in_order, {});
  batches = std::min(batches, data.num_samples() / t.global_batch_size);
  double sum = 0.0;
  std::int64_t count = 0;
  for (std::int64_t k = 0; k < batches; ++k) {
    for (std::int64_t m = 0; m < loader.micro_steps(); ++m) {
      const data::MicroBatch batch = loader.next();
      sum += model.forward(batch.inputs.data(), batch.targets.data(), B, T, 0.0f);
      count += std::int64_t(B) * T;
    }
  }
  double totals[2] = {sum, double(count) / context};  // each rank holds 1 / context of the tokens
  if (comm) comm->all_reduce_sum(totals, 2);
  return totals[0] / totals[1];
}

}  // namespace llmtrain::eval
