#include <cstdio>
#include <cstdlib>

#include "core/error.h"
#include "dist/communicator.h"
#include "dist/nccl_communicator.h"
#include "ops/buffer.h"

namespace llmtrain::dist {

#if LLMTRAIN_HAVE_MPI
std::unique_ptr<Communicator> make_mpi_communicator(double timeout_s);
#endif

bool launched_by_mpi() {
  // Open MPI's mpirun, MPICH/Hydra and PMIx launchers, and Slurm's srun with several tasks.
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"}) {
    if (std::getenv(name)) return true;
  }
  const char* slurm_tasks = std::getenv("SLURM_NTASKS");
  return slurm_tasks && std::atoi(slurm_tasks) > 1 && std::getenv("SLURM_PROCID");
}

std::unique_ptr<Communicator> make_communicator(bool verbose, double timeout_s) {
  std::unique_ptr<Communicator> comm;
  if (launched_by_mpi()) {
#if LLMTRAIN_HAVE_MPI
    comm = make_mpi_communicator(timeout_s);
#else
    (void)timeout_s;
    throw RuntimeError("started by mpirun/srun, but this llmtrain was built without MPI (-DLLMTRAIN_MPI=ON)");
#endif
  } else {
    comm = make_single_communicator();
  }
  if (verbose && comm->rank() == 0) {
    std::fprintf(stderr, "dist: %s communicator, %d rank(s)\n", comm->name().c_str(), comm->world_size());
  }
  if (verbose && comm->world_size() > 1) {
    std::fprintf(stderr, "dist: rank %d is local rank %d of its node\n", comm->rank(), comm->local_rank());
  }
  return comm;
}

Communicators split_mesh(std::unique_ptr<Communicator> world, const Mesh& mesh) {
  if (mesh.world() != world->world_size()) {
    throw RuntimeError("a mesh of " + std::to_string(mesh.world()) + " ranks on a job of " +
                       std::to_string(world->world_size()));
  }
  Communicators comms;
  comms.mesh = mesh;
  const Mesh::Coord at = mesh.coord(world->rank());
  // Each group: the ranks that agree on the other coordinates (the color), in the order of the
  // group's own coordinate (the key). The data-parallel group (the ranks whose gradients are
  // summed: the same tensor index and stage) holds the context and data axes together, context
  // index fastest.
  const int C = mesh.context, D = mesh.data, Tn = mesh.tensor;
  comms.data_group = world->split(at.tensor + Tn * at.pipeline, at.context + C * at.data);
  comms.tensor_group = world->split(at.context + C * (at.data + D * at.pipeline), at.tensor);
  comms.pipeline_group = world->split(at.tensor + Tn * (at.context + C * at.data), at.pipeline);
  comms.context_group = world->split(at.tensor + Tn * (at.data + D * at.pipeline), at.context);
  comms.pipeline_group->set_rank_noun("stage");  // a transfer that never completes names the stage
  // A collective that times out names each missing rank's place on the mesh's split axes.
  const auto place = [mesh](int job_rank) {
    const Mesh::Coord c = mesh.coord(job_rank);
    std::string out;
    if (mesh.pipeline > 1) out += "stage " + std::to_string(c.pipeline);
    if (mesh.tensor > 1) out += (out.empty() ? "" : ", ") + std::string("tensor rank ") + std::to_string(c.tensor);
    if (mesh.context > 1) out += (out.empty() ? "" : ", ") + std::string("context rank ") + std::to_string(c.context);
    return out.empty() ? out : " (" + out + ")";
  };
  for (Communicator* group : {world.get(), comms.data_group.get(), comms.tensor_group.get(), comms.pipeline_group.get(),
                              comms.context_group.get()}) {
    group->set_job_rank_place(place);
  }
  comms.world = std::move(world);
  return comms;
}

Communicators make_communicators(Device device, double timeout_s, int tensor_parallel, int pipeline_parallel,
                                 int context_parallel) {
  return make_communicators([device](Communicator&) { return device; }, timeout_s, tensor_parallel, pipeline_parallel,
                            context_parallel);
}

Communicators make_communicators(const std::function<Device(Communicator& world)>& choose, double timeout_s,
                                 int tensor_parallel, int pipeline_parallel, int context_parallel) {
  std::unique_ptr<Communicator> world = make_communicator(false, timeout_s);
  const Mesh mesh = Mesh::of(world->world_size(), tensor_parallel, pipeline_parallel, context_parallel);
  const Device device = choose(*world);
  Communicators comms = split_mesh(std::move(world), mesh);
  if (device == Device::cuda) {
    const int gpu = ops::use_cuda_device(comms.world->local_rank());
    // One GPU process has nothing to reduce: no device communicator.
#if LLMTRAIN_HAVE_CUDA
    if (comms.data_group->world_size() > 1) comms.data_device = make_nccl_communicator(*comms.data_group, gpu, timeout_s);
    if (comms.tensor_group->world_size() > 1) {
      comms.tensor_device = make_nccl_communicator(*comms.tensor_group, gpu, timeout_s);
    }
    if (comms.pipeline_group->world_size() > 1) {
      comms.pipeline_device = make_nccl_communicator(*comms.pipeline_group, gpu, timeout_s);
      comms.pipeline_device->set_rank_noun("stage");  // a transfer that never completes names the stage
    }
    if (comms.context_group->world_size() > 1) {
      comms.context_device = make_nccl_communicator(*comms.context_group, gpu, timeout_s);
    }
#else
    (void)gpu;
#endif
  }
  return comms;
}

}  // namespace llmtrain::dist
