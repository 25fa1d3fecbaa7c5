// The device mesh: the job's ranks as a grid with one axis per kind of parallelism, spelled once
// in the table `mesh_axes` below. Tensor parallelism splits each layer over the ranks of a tensor
// group, context parallelism each sequence over a context group, pipeline parallelism places
// consecutive layers on the stages, and the data-parallel replicas of each part share gradients.
// The axes' order is the rank order: the tensor index varies fastest, then the context index,
// then the expert index, then the data index, then the stage, so that a tensor group (the most
// talkative) sits on consecutive ranks, inside one node, with the context group (a ring of
// key/value blocks per layer) and the expert group (two all-to-alls per MoE layer) next to it.
// Expert parallelism is carved out of the data-parallel ranks: the ranks of an expert group read
// different batches and hold different experts of every MoE layer, and the data axis's group is
// then the expert-data group (the ranks holding the same experts).
//
// A new axis is a row of the table plus the code that uses it: its config key (Mesh::of), what
// its group does, and its memory and traffic in plan. The communicators, the traffic counted per
// update, the metrics and the stop messages iterate the table.
#pragma once

#include <array>
#include <cstddef>
#include <initializer_list>
#include <string>
#include <utility>

namespace llmtrain::config {
struct DistConfig;
}

namespace llmtrain::dist {

/// The mesh's axes, in rank order (the first varies fastest).
enum class Axis { tensor, context, expert, data, pipeline };
inline constexpr int axis_count = 5;

/// A bit per axis: the axes a group spans.
constexpr unsigned axis_bit(Axis a) { return 1u << unsigned(a); }

/// One row of the table: how the program names an axis and what its communicator spans.
struct AxisRow {
  Axis axis;
  const char* name;         // logs, metrics and errors: "tensor"
  const char* size_key;     // the config key that sets its size; null: the ranks left (data)
  bool always_named;        // named in the mesh's description and errors even at size 1
  const char* order_name;   // in the description's rank order: "tensor index", ..., "stage"
  const char* rank_label;   // a timed-out collective names a rank's index on it ("tensor rank"); null: not named
  const char* rank_noun;    // what its communicator calls a member in errors ("stage"); null: "rank"
  unsigned group_axes;      // the axes its communicator spans: the gradients' group spans context and data
  const char* metrics_prefix;  // metrics.jsonl: PREFIX "collectives", PREFIX "sent_bytes"
  bool in_comm_wait;        // its waits count in metrics.jsonl's comm_wait_s
};

inline constexpr std::array<AxisRow, axis_count> mesh_axes{{
    {Axis::tensor, "tensor", "dist.tensor_parallel", true, "tensor index", "tensor rank", nullptr,
     axis_bit(Axis::tensor), "tensor_", true},
    {Axis::context, "context", "dist.context_parallel", false, "context", "context rank", nullptr,
     axis_bit(Axis::context), "context_", true},
    {Axis::expert, "expert", "dist.expert_parallel", false, "expert", "expert rank", nullptr,
     axis_bit(Axis::expert), "expert_", true},
    // The data-parallel group holds every replica of a model part, the context axis's too: the
    // ranks whose gradients are summed (context index fastest).
    {Axis::data, "data", nullptr, true, "data", nullptr, nullptr, axis_bit(Axis::context) | axis_bit(Axis::data), "",
     true},
    {Axis::pipeline, "pipeline", "dist.pipeline_parallel", true, "stage", "stage", "stage", axis_bit(Axis::pipeline),
     "pipeline_", false},
}};

constexpr const AxisRow& axis_row(Axis a) { return mesh_axes[std::size_t(a)]; }

/// One value per axis, in the table's order.
template <class T>
struct PerAxis {
  std::array<T, axis_count> values{};
  T& operator[](Axis a) { return values[std::size_t(a)]; }
  const T& operator[](Axis a) const { return values[std::size_t(a)]; }
  bool operator==(const PerAxis&) const = default;
};

struct Mesh {
  PerAxis<int> sizes{{1, 1, 1, 1, 1}};

  /// The mesh of `world` ranks for the sizes asked of the keyed axes (those not named: 1); the
  /// data axis takes the ranks left. InputError naming the keys when their product does not
  /// divide `world`, or when a size is below 1.
  static Mesh of(int world, std::initializer_list<std::pair<Axis, int>> sizes);
  /// The same for the sizes a config's `dist` section asks for.
  static Mesh of(int world, const config::DistConfig& dist);

  int size(Axis a) const { return sizes[a]; }
  int world() const;
  /// A rank's index on each axis.
  using Coord = PerAxis<int>;
  Coord coord(int rank) const;
  int rank(const Coord& c) const;
  /// "8 rank(s) = tensor 2 x data 2 x pipeline 2 (tensor index fastest, then data, then stage)";
  /// an axis that is not always named appears when it has more than one rank.
  std::string describe() const;
};

}  // namespace llmtrain::dist
