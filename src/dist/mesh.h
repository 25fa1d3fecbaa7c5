// The device mesh: the job's ranks as a tensor x context x data x pipeline grid. Tensor
// parallelism splits each layer over the ranks of a tensor group, context parallelism splits each
// sequence over the ranks of a context group, pipeline parallelism places consecutive layers on
// the stages, and the data-parallel replicas of each part share gradients. The tensor index varies
// fastest in the rank order, then the context index, then the data index, then the stage, so that
// a tensor group (the most talkative) sits on consecutive ranks, inside one node, with the context
// group (a ring of key/value blocks per layer) next to it.
#pragma once

#include <string>

namespace llmtrain::dist {

struct Mesh {
  int tensor = 1;    // dist.tensor_parallel
  int data = 1;      // world / (tensor x context x pipeline)
  int pipeline = 1;  // dist.pipeline_parallel
  int context = 1;   // dist.context_parallel

  /// A rank's place on each axis.
  struct Coord {
    int tensor = 0, data = 0, pipeline = 0, context = 0;
    bool operator==(const Coord&) const = default;
  };

  /// The mesh of `world` ranks for the configured tensor, pipeline and context sizes; InputError
  /// naming the keys when their product does not divide `world`.
  static Mesh of(int world, int tensor_parallel, int pipeline_parallel, int context_parallel = 1);

  int world() const { return tensor * context * data * pipeline; }
  Coord coord(int rank) const;
  int rank(const Coord& c) const { return c.tensor + tensor * (c.context + context * (c.data + data * c.pipeline)); }
  /// "8 ranks = tensor 2 x data 2 x pipeline 2 (tensor index fastest)"; the context axis is
  /// named when it has more than one rank.
  std::string describe() const;
};

}  // namespace llmtrain::dist
