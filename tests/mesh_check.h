// Helpers shared by the mesh tests (mesh_test.cpp, mesh_transfer_test.cpp, mesh_pieces_test.cpp):
// the job's communicator, and meshes and places on them as the tests spell them.
#pragma once

#include <memory>

#include "dist/communicator.h"
#include "dist/mesh.h"

namespace llmtrain::test {

// The job's communicator, made once: MPI starts once per process and stops at exit.
inline dist::Communicator& job() {
  static const std::unique_ptr<dist::Communicator> comm = dist::make_communicator(false, 60.0);
  return *comm;
}

// The mesh of W ranks for tensor, pipeline and context sizes, and a place on it, as the tests
// spell them (the mesh's own table orders the axes tensor, context, data, pipeline).
inline dist::Mesh mesh_of(int W, int tensor, int pipeline, int context = 1) {
  return dist::Mesh::of(
      W, {{dist::Axis::tensor, tensor}, {dist::Axis::pipeline, pipeline}, {dist::Axis::context, context}});
}
inline dist::Mesh::Coord place(int tensor, int data, int pipeline, int context = 0) {
  dist::Mesh::Coord c;
  c[dist::Axis::tensor] = tensor;
  c[dist::Axis::data] = data;
  c[dist::Axis::pipeline] = pipeline;
  c[dist::Axis::context] = context;
  return c;
}

}  // namespace llmtrain::test
