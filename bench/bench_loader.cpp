// Loader throughput: tokens per second that BatchLoader delivers from real shards.
//   bench_loader --shards 'DIR/train_*.bin' [--T 256] [--B 8] [--seconds 3]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "data/dataset.h"
#include "data/shard.h"

int main(int argc, char** argv) {
  std::string shards;
  long T = 256, B = 8;
  double seconds = 3.0;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--shards")) shards = argv[i + 1];
    if (!std::strcmp(argv[i], "--T")) T = std::atol(argv[i + 1]);
    if (!std::strcmp(argv[i], "--B")) B = std::atol(argv[i + 1]);
    if (!std::strcmp(argv[i], "--seconds")) seconds = std::atof(argv[i + 1]);
  }
  if (shards.empty()) {
    std::fprintf(stderr, "usage: bench_loader --shards GLOB [--T 256] [--B 8] [--seconds 3]\n");
    return 2;
  }
  using namespace llmtrain::data;
  const TokenDataset data(expand_paths({shards}, "--shards"), T, 1u << 31);
  BatchLoader loader(data, {data.num_samples(), B, B, 1, 0, true, 1}, {});
  const auto start = std::chrono::steady_clock::now();
  long long tokens = 0;
  double elapsed = 0;
  while (elapsed < seconds) {
    const MicroBatch batch = loader.next();
    tokens += static_cast<long long>(batch.inputs.size());
    elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  std::printf("loader: %.3g tokens/s (T=%ld, B=%ld, shuffled, %lld tokens in %.1f s)\n", double(tokens) / elapsed, T, B,
              tokens, elapsed);
  return 0;
}
