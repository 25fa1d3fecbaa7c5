// The device mesh: the job's ranks as a tensor x data x pipeline grid. Tensor parallelism splits
// each layer over the ranks of a tensor group, pipeline parallelism places consecutive layers on
// the stages, and the data-parallel replicas of each part share gradients. The tensor index varies
// fastest in the rank order, then the data index, then the stage, so that a tensor group (the most
// talkative) sits on consecutive ranks, inside one node.
#pragma once

#include <string>

namespace llmtrain::dist {

struct Mesh {
  int tensor = 1;    // dist.tensor_parallel
  int data = 1;      // world / (tensor x pipeline)
  int pipeline = 1;  // dist.pipeline_parallel

  /// A rank's place on each axis.
  struct Coord {
    int tensor = 0, data = 0, pipeline = 0;
    bool operator==(const Coord&) const = default;
  };

  /// The mesh of `world` ranks for the configured tensor and pipeline sizes; InputError naming
  /// dist.tensor_parallel and dist.pipeline_parallel when their product does not divide `world`.
  static Mesh of(int world, int tensor_parallel, int pipeline_parallel);

  int world() const { return tensor * data * pipeline; }
  Coord coord(int rank) const;
  int rank(const Coord& c) const { return c.tensor + tensor * (c.data + data * c.pipeline); }
  /// "8 ranks = tensor 2 x data 2 x pipeline 2 (tensor index fastest)".
  std::string describe() const;
};

}  // namespace llmtrain::dist
