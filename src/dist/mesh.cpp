#include "dist/mesh.h"

#include "config/config.h"
#include "core/error.h"

namespace llmtrain::dist {

namespace {

// The axes a description or an error names: those always named, and the others above size 1.
bool named(const AxisRow& row, int size) { return row.always_named || size > 1; }

}  // namespace

Mesh Mesh::of(int world, std::initializer_list<std::pair<Axis, int>> asked) {
  Mesh mesh;
  for (const auto& [axis, size] : asked) mesh.sizes[axis] = size;
  std::string keys, values, lows;
  long long model_ranks = 1;
  for (const AxisRow& row : mesh_axes) {
    if (!row.size_key) continue;
    const int size = mesh.sizes[row.axis];
    if (size < 1) lows += std::string(lows.empty() ? "" : ", ") + row.size_key + " = " + std::to_string(size);
    model_ranks *= size;
    if (!named(row, size)) continue;
    keys += std::string(keys.empty() ? "" : " x ") + row.size_key;
    values += (values.empty() ? "" : " x ") + std::to_string(size);
  }
  if (!lows.empty()) throw InputError("the mesh's sizes must be at least 1, got " + lows);
  if (world % model_ranks != 0) {
    throw InputError(keys + " (" + values + " = " + std::to_string(model_ranks) +
                     ") must divide the number of ranks, " + std::to_string(world));
  }
  mesh.sizes[Axis::data] = static_cast<int>(world / model_ranks);
  return mesh;
}

Mesh Mesh::of(int world, const config::DistConfig& dist) {
  return of(world, {{Axis::tensor, int(dist.tensor_parallel)},
                    {Axis::context, int(dist.context_parallel)},
                    {Axis::expert, int(dist.expert_parallel)},
                    {Axis::pipeline, int(dist.pipeline_parallel)}});
}

int Mesh::world() const {
  int w = 1;
  for (const int s : sizes.values) w *= s;
  return w;
}

Mesh::Coord Mesh::coord(int rank) const {
  Coord c;
  for (const AxisRow& row : mesh_axes) {
    c[row.axis] = rank % sizes[row.axis];
    rank /= sizes[row.axis];
  }
  return c;
}

int Mesh::rank(const Coord& c) const {
  int rank = 0;
  for (int a = axis_count - 1; a >= 0; --a) rank = rank * sizes.values[std::size_t(a)] + c.values[std::size_t(a)];
  return rank;
}

std::string Mesh::describe() const {
  std::string axes, order;
  for (const AxisRow& row : mesh_axes) {
    if (!named(row, sizes[row.axis])) continue;
    axes += std::string(axes.empty() ? "" : " x ") + row.name + " " + std::to_string(sizes[row.axis]);
    order += order.empty() ? std::string(row.order_name) + " fastest" : std::string(", then ") + row.order_name;
  }
  return std::to_string(world()) + " rank(s) = " + axes + " (" + order + ")";
}

}  // namespace llmtrain::dist
