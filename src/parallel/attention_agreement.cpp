#include "parallel/attention_agreement.h"

#include <cstdint>
#include <string>

namespace llmtrain::parallel {
namespace {

// cuDNN's answers agreed by every rank: "yes" only where all say yes. So all ranks choose the same
// kernels, and a "cudnn" refused on one rank is an InputError on every rank (rank 0 reports it;
// the others would otherwise wait for it in the first collective until dist.timeout_s).
// resolve_attention's calls depend only on the config and the agreed answers, so every rank makes
// the same calls.
class AgreedCudnnProbe final : public parallel::CudnnAttentionProbe {
 public:
  AgreedCudnnProbe(parallel::CudnnAttentionProbe& local, dist::Communicator& world) : local_(local), world_(world) {}
  bool available(std::string* why_not) override { return agree(local_.available(why_not), why_not); }
  bool accepts(const parallel::AttentionShape& shape, std::string* why_not) override {
    return agree(local_.accepts(shape, why_not), why_not);
  }
  std::string version() override { return local_.version(); }

 private:
  bool agree(bool here, std::string* why_not) {
    std::int64_t refused = here ? 0 : 1;
    world_.all_reduce_max(&refused, 1);
    if (here && refused != 0) *why_not = "another rank's cuDNN refuses it";
    return refused == 0;
  }
  parallel::CudnnAttentionProbe& local_;
  dist::Communicator& world_;
};

}  // namespace

parallel::AttentionChoice resolve_attention_on_every_rank(const config::Config& config, Device device,
                                                       dist::Communicator& world) {
  const auto cudnn = parallel::make_cudnn_probe();
  AgreedCudnnProbe agreed(*cudnn, world);
  return parallel::resolve_attention(config, device, agreed);
}

}  // namespace llmtrain::parallel
