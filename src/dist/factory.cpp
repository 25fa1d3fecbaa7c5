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
  // Each group: the ranks that agree on the coordinates outside the axes it spans (the color),
  // in the order of its own coordinates, the faster axis first (the key).
  for (const AxisRow& row : mesh_axes) {
    int color = 0, key = 0;
    for (int a = axis_count - 1; a >= 0; --a) {
      const Axis axis = Axis(a);
      int& into = (row.group_axes & axis_bit(axis)) ? key : color;
      into = into * mesh.size(axis) + at[axis];
    }
    comms.groups[row.axis].host = world->split(color, key);
    if (row.rank_noun) comms.groups[row.axis].host->set_rank_noun(row.rank_noun);  // "stage 1 (rank 3)"
  }
  // A collective that times out names each missing rank's place on the mesh's split axes.
  const auto place = [mesh](int job_rank) {
    const Mesh::Coord c = mesh.coord(job_rank);
    std::string out;
    for (int a = axis_count - 1; a >= 0; --a) {  // the stage first
      const AxisRow& row = mesh_axes[std::size_t(a)];
      if (!row.rank_label || mesh.size(row.axis) == 1) continue;
      out += (out.empty() ? "" : ", ") + std::string(row.rank_label) + " " + std::to_string(c[row.axis]);
    }
    return out.empty() ? out : " (" + out + ")";
  };
  world->set_job_rank_place(place);
  for (const auto& group : comms.groups.values) group.host->set_job_rank_place(place);
  comms.world = std::move(world);
  return comms;
}

Traffic Communicators::traffic(Axis a) const {
  Traffic sent = groups[a].host->traffic();
  if (groups[a].device) sent += groups[a].device->traffic();
  return sent;
}

Communicators make_communicators(Device device, double timeout_s, const std::function<Mesh(int world)>& mesh_of) {
  return make_communicators([device](Communicator&) { return device; }, timeout_s, mesh_of);
}

Communicators make_communicators(const std::function<Device(Communicator& world)>& choose, double timeout_s,
                                 const std::function<Mesh(int world)>& mesh_of) {
  std::unique_ptr<Communicator> world = make_communicator(false, timeout_s);
  const Mesh mesh = mesh_of(world->world_size());
  const Device device = choose(*world);
  Communicators comms = split_mesh(std::move(world), mesh);
  if (device == Device::cuda) {
    const int gpu = ops::use_cuda_device(comms.world->local_rank());
    // One GPU process has nothing to reduce: no device communicator.
#if LLMTRAIN_HAVE_CUDA
    for (const AxisRow& row : mesh_axes) {
      Communicators::Group& group = comms.groups[row.axis];
      if (group.host->world_size() == 1) continue;
      group.device = make_nccl_communicator(*group.host, gpu, timeout_s);
      if (row.rank_noun) group.device->set_rank_noun(row.rank_noun);
    }
#else
    (void)gpu;
#endif
  }
  return comms;
}

}  // namespace llmtrain::dist
