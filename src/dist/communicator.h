// The one interface distributed code talks to: collectives over the ranks of a job. Counts are
// element counts of typed buffers. Implementations: a single process (world size 1) and MPI over
// host memory (the CPU backend); NCCL over device memory joins with the CUDA training path.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "core/tensor.h"

namespace llmtrain::dist {

/// A started non-blocking collective; wait() finishes it.
class Request {
 public:
  virtual ~Request() = default;
  virtual void wait() = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  /// The rank among the processes of this node (which GPU a rank uses).
  virtual int local_rank() const { return rank(); }
  /// "single", "mpi", ...
  virtual std::string name() const = 0;

  /// data (count) = sum over ranks, in place.
  virtual void all_reduce_sum(float* data, std::int64_t count) = 0;
  virtual void all_reduce_sum(double* data, std::int64_t count) = 0;
  /// data (count) = max over ranks, in place.
  virtual void all_reduce_max(std::int64_t* data, std::int64_t count) = 0;
  /// Starts data (count) = sum over ranks; the buffer must not be touched until wait().
  virtual std::unique_ptr<Request> start_all_reduce_sum(float* data, std::int64_t count) = 0;
  /// recv (shard) = sum over ranks of send[rank * shard, (rank + 1) * shard); send is (W * shard).
  virtual void reduce_scatter_sum(const float* send, float* recv, std::int64_t shard) = 0;
  /// recv (W * shard) = every rank's send (shard), in rank order.
  virtual void all_gather(const float* send, float* recv, std::int64_t shard) = 0;
  /// data (count) = root's data.
  virtual void broadcast(float* data, std::int64_t count, int root) = 0;
  virtual void barrier() = 0;
};

/// World size 1: every collective is the identity.
std::unique_ptr<Communicator> make_single_communicator();

/// The job's processes: MPI when this process was started by mpirun or srun (and the build has
/// MPI), else a single process. Logs its choice on rank 0 when `verbose`. A collective that
/// does not finish within `timeout_s` (a rank died or hangs) aborts every rank with a message.
std::unique_ptr<Communicator> make_communicator(bool verbose, double timeout_s = 600.0);

/// The communicators of one training process. Today every rank is a data-parallel replica of the
/// whole model, so there is one group, reached over host memory (`world`) and, on GPUs, over
/// device memory (`data_device`, NCCL). A mesh (data x tensor x pipeline) adds its groups here.
struct Communicators {
  std::unique_ptr<Communicator> world;        // every rank, host memory: losses, checksums, barriers, checkpoints
  std::unique_ptr<Communicator> data_device;  // the data-parallel group over device memory; null: `world` serves

  /// The data-parallel group over host memory (scalars: losses, norms; the sampler's rank).
  Communicator& data_host() const { return *world; }
  /// The data-parallel group over the memory the gradients live in (NCCL for CUDA with several ranks).
  Communicator& data() const { return data_device ? *data_device : *world; }
};

/// make_communicator's choice for the host, and for `device` cuda: binds this process to its GPU
/// (by local rank) and, with several ranks, adds NCCL over that GPU for the gradients.
Communicators make_communicators(Device device, double timeout_s = 600.0);
/// The same, with the device chosen by `choose` once the host communicator exists (it may run
/// collectives on it, so that every rank makes the same choice).
Communicators make_communicators(const std::function<Device(Communicator& world)>& choose, double timeout_s);

/// True when the environment says this process is one of several started by mpirun or srun.
bool launched_by_mpi();

}  // namespace llmtrain::dist
