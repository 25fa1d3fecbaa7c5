// The one interface distributed code talks to: collectives over the ranks of a job. Counts are
// element counts of typed buffers. Implementations: a single process (world size 1) and MPI over
// host memory (the CPU backend); NCCL over device memory joins with the CUDA training path.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "core/tensor.h"
#include "dist/mesh.h"

namespace llmtrain::dist {

/// A started non-blocking collective; wait() finishes it.
class Request {
 public:
  virtual ~Request() = default;
  virtual void wait() = 0;
};

/// What this rank sent through one communicator, counted as the ring algorithms send it (the
/// volume a bandwidth-optimal implementation moves, whatever the library picks): for a buffer of
/// S bytes over n ranks an all-reduce sends 2 (n-1)/n S, a reduce-scatter or all-gather of a
/// full buffer S (n shards) (n-1)/n S, a broadcast (n-1)/n S. A barrier sends nothing.
struct Traffic {
  enum Kind { all_reduce, reduce_scatter, all_gather, broadcast, barrier, kinds };
  std::int64_t calls[kinds] = {};
  double bytes[kinds] = {};

  double total_bytes() const;
  std::int64_t total_calls() const;
  /// What was counted after `earlier` (an earlier copy of the same counts).
  Traffic since(const Traffic& earlier) const;
  static const char* name(Kind kind);
};

/// The collectives of a group of ranks. Every call is counted in traffic() and then done by the
/// implementation's do_ method.
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  /// The rank among the processes of this node (which GPU a rank uses).
  virtual int local_rank() const { return rank(); }
  /// "single", "mpi", ...
  virtual std::string name() const = 0;

  /// The ranks of this group with the same `color` form a new group, ordered by `key` (ties by
  /// rank). Collective over this group; the result must not outlive this communicator.
  virtual std::unique_ptr<Communicator> split(int color, int key) = 0;

  /// data (count) = sum over ranks, in place.
  void all_reduce_sum(float* data, std::int64_t count);
  void all_reduce_sum(double* data, std::int64_t count);
  /// data (count) = max over ranks, in place.
  void all_reduce_max(std::int64_t* data, std::int64_t count);
  void all_reduce_max(float* data, std::int64_t count);
  /// Starts data (count) = sum over ranks; the buffer must not be touched until wait().
  std::unique_ptr<Request> start_all_reduce_sum(float* data, std::int64_t count);
  /// recv (shard) = sum over ranks of send[rank * shard, (rank + 1) * shard); send is (W * shard).
  void reduce_scatter_sum(const float* send, float* recv, std::int64_t shard);
  /// The same, started: neither buffer may be touched until wait().
  std::unique_ptr<Request> start_reduce_scatter_sum(const float* send, float* recv, std::int64_t shard);
  /// recv (W * shard) = every rank's send (shard), in rank order. `send` may be this rank's part
  /// of recv (recv + rank * shard): in place.
  void all_gather(const float* send, float* recv, std::int64_t shard);
  /// The same for elements of `dtype` (f32 or bf16: a working copy of weights).
  void all_gather(const void* send, void* recv, std::int64_t shard, DType dtype);
  /// The same, started: neither buffer may be touched until wait().
  std::unique_ptr<Request> start_all_gather(const void* send, void* recv, std::int64_t shard, DType dtype);
  /// data (count) = root's data.
  void broadcast(float* data, std::int64_t count, int root);
  void barrier();

  /// The collectives this rank has made on this communicator so far.
  const Traffic& traffic() const { return traffic_; }

 protected:
  virtual void do_all_reduce_sum(float* data, std::int64_t count) = 0;
  virtual void do_all_reduce_sum(double* data, std::int64_t count) = 0;
  virtual void do_all_reduce_max(std::int64_t* data, std::int64_t count) = 0;
  virtual void do_all_reduce_max(float* data, std::int64_t count) = 0;
  virtual std::unique_ptr<Request> do_start_all_reduce_sum(float* data, std::int64_t count) = 0;
  virtual std::unique_ptr<Request> do_start_reduce_scatter_sum(const float* send, float* recv,
                                                               std::int64_t shard) = 0;
  virtual std::unique_ptr<Request> do_start_all_gather(const void* send, void* recv, std::int64_t shard,
                                                       DType dtype) = 0;
  virtual void do_broadcast(float* data, std::int64_t count, int root) = 0;
  virtual void do_barrier() = 0;

 private:
  void count(Traffic::Kind kind, double bytes);
  Traffic traffic_;
};

/// World size 1: every collective is the identity.
std::unique_ptr<Communicator> make_single_communicator();

/// The job's processes: MPI when this process was started by mpirun or srun (and the build has
/// MPI), else a single process. Logs its choice on rank 0 when `verbose`. A collective that
/// does not finish within `timeout_s` (a rank died or hangs) aborts every rank with a message.
std::unique_ptr<Communicator> make_communicator(bool verbose, double timeout_s = 600.0);

/// The communicators of one training process on its mesh (dist/mesh.h): every rank, and the
/// groups of ranks that share all mesh coordinates but one. Over host memory always; the
/// data-parallel group also over device memory on GPUs (NCCL), where the gradients live.
struct Communicators {
  Mesh mesh;
  std::unique_ptr<Communicator> world;        // every rank, host memory: losses, checksums, barriers, checkpoints
  std::unique_ptr<Communicator> data_group;   // same tensor index and stage: replicas of one model part
  std::unique_ptr<Communicator> tensor_group;    // same data index and stage: one layer's shards
  std::unique_ptr<Communicator> pipeline_group;  // same tensor and data index: the stages in order
  std::unique_ptr<Communicator> data_device;  // the data-parallel group over device memory; null: data_group serves
  std::unique_ptr<Communicator> tensor_device;  // the tensor-parallel group over device memory; null: tensor_group serves

  /// The data-parallel group over host memory (scalars: losses, norms; the sampler's rank).
  Communicator& data_host() const { return *data_group; }
  /// The data-parallel group over the memory the gradients live in (NCCL for CUDA with several ranks).
  Communicator& data() const { return data_device ? *data_device : *data_group; }
  /// The tensor-parallel group over the memory the activations live in.
  Communicator& tensor() const { return tensor_device ? *tensor_device : *tensor_group; }
};

/// Splits `world` into the groups of `mesh` (mesh.world() must be world's size).
Communicators split_mesh(std::unique_ptr<Communicator> world, const Mesh& mesh);

/// make_communicator's choice for the host, and for `device` cuda: binds this process to its GPU
/// (by local rank) and, with several ranks, adds NCCL over that GPU for the gradients.
/// Its groups are those of a `tensor_parallel` x data x `pipeline_parallel` mesh over the job's
/// ranks (InputError naming the keys when they do not divide the world size).
Communicators make_communicators(Device device, double timeout_s = 600.0, int tensor_parallel = 1,
                                 int pipeline_parallel = 1);
/// The same, with the device chosen by `choose` once the host communicator exists (it may run
/// collectives on it, so that every rank makes the same choice).
Communicators make_communicators(const std::function<Device(Communicator& world)>& choose, double timeout_s,
                                 int tensor_parallel = 1, int pipeline_parallel = 1);

/// True when the environment says this process is one of several started by mpirun or srun.
bool launched_by_mpi();

}  // namespace llmtrain::dist
