#include "dist/mesh.h"

#include "core/error.h"

namespace llmtrain::dist {

Mesh Mesh::of(int world, int tensor_parallel, int pipeline_parallel, int context_parallel) {
  if (tensor_parallel < 1 || pipeline_parallel < 1 || context_parallel < 1) {
    throw InputError("dist.tensor_parallel, dist.pipeline_parallel and dist.context_parallel must be at least 1, got " +
                     std::to_string(tensor_parallel) + ", " + std::to_string(pipeline_parallel) + " and " +
                     std::to_string(context_parallel));
  }
  const long long model_ranks = static_cast<long long>(tensor_parallel) * pipeline_parallel * context_parallel;
  if (world % model_ranks != 0) {
    if (context_parallel == 1) {
      throw InputError("dist.tensor_parallel x dist.pipeline_parallel (" + std::to_string(tensor_parallel) + " x " +
                       std::to_string(pipeline_parallel) + " = " + std::to_string(model_ranks) +
                       ") must divide the number of ranks, " + std::to_string(world));
    }
    throw InputError("dist.tensor_parallel x dist.context_parallel x dist.pipeline_parallel (" +
                     std::to_string(tensor_parallel) + " x " + std::to_string(context_parallel) + " x " +
                     std::to_string(pipeline_parallel) + " = " + std::to_string(model_ranks) +
                     ") must divide the number of ranks, " + std::to_string(world));
  }
  return Mesh{tensor_parallel, static_cast<int>(world / model_ranks), pipeline_parallel, context_parallel};
}

Mesh::Coord Mesh::coord(int rank) const {
  return {rank % tensor, (rank / (tensor * context)) % data, rank / (tensor * context * data),
          (rank / tensor) % context};
}

std::string Mesh::describe() const {
  if (context == 1) {
    return std::to_string(world()) + " rank(s) = tensor " + std::to_string(tensor) + " x data " +
           std::to_string(data) + " x pipeline " + std::to_string(pipeline) +
           " (tensor index fastest, then data, then stage)";
  }
  return std::to_string(world()) + " rank(s) = tensor " + std::to_string(tensor) + " x context " +
         std::to_string(context) + " x data " + std::to_string(data) + " x pipeline " + std::to_string(pipeline) +
         " (tensor index fastest, then context, then data, then stage)";
}

}  // namespace llmtrain::dist
