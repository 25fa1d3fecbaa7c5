// The one interface distributed code talks to: collectives over the ranks of a job, and transfers
// between two of them (pipeline stages). Counts are element counts of typed buffers.
// Implementations: a single process (world size 1) and MPI over host memory (the CPU backend);
// NCCL over device memory joins with the CUDA training path.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "core/tensor.h"
#include "dist/mesh.h"

namespace llmtrain::dist {

/// A started non-blocking collective or transfer; wait() or queue_wait() finishes it. Its buffers
/// must stay untouched (and alive) until wait() has returned, and every request must be waited for.
class Request {
 public:
  virtual ~Request() = default;
  virtual void wait() = 0;
  /// Finishes it as a queued collective is finished: over device memory (NCCL) the compute
  /// stream's later work waits for it and sees what arrived, the host does not wait, and the
  /// communicator watches it for errors and its timeout at its later calls and in wait_queued();
  /// the buffers may then be used by the compute stream's later work (the host must not read
  /// them before wait_queued()). Over host memory: wait(). Either this or wait(), once.
  virtual void queue_wait() { wait(); }
};

/// One transfer of Communicator::start_transfers: `count` elements of `dtype` from `data` to
/// `peer` (send), or from `peer` into `data` (receive).
struct PeerTransfer {
  enum Direction { send, recv } direction;
  void* data;
  std::int64_t count;
  DType dtype;
  int peer;
};

/// What this rank sent through one communicator, counted as the ring algorithms send it (the
/// volume a bandwidth-optimal implementation moves, whatever the library picks): for a buffer of
/// S bytes over n ranks an all-reduce sends 2 (n-1)/n S, a reduce-scatter or all-gather of a
/// full buffer S (n shards) (n-1)/n S, a broadcast (n-1)/n S. A barrier sends nothing. A send to
/// another rank counts its bytes (count x element size) under `send`; a receive sends nothing and
/// is counted, with 0 bytes, under `recv` (the bytes arrive in the sender's count). An all-to-all
/// counts the bytes this rank sends the other ranks (its own part stays).
///
/// `wait_s`: the time the host spent waiting for this communicator, in its blocking calls and in
/// the wait() of its requests (communication that compute did not hide).
struct Traffic {
  enum Kind { all_reduce, reduce_scatter, all_gather, broadcast, barrier, send, recv, all_to_all, kinds };
  std::int64_t calls[kinds] = {};
  double bytes[kinds] = {};
  double wait_s = 0;

  double total_bytes() const;
  std::int64_t total_calls() const;
  /// What was counted after `earlier` (an earlier copy of the same counts).
  Traffic since(const Traffic& earlier) const;
  Traffic& operator+=(const Traffic& more);
  static const char* name(Kind kind);
};

/// The collectives of a group of ranks, and transfers between two of them. Every call is counted
/// in traffic() and then done by the implementation's do_ method.
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  /// The rank among the processes of this node (which GPU a rank uses).
  virtual int local_rank() const { return rank(); }
  /// The rank in the job (as mpirun numbers it) of member `rank` of this group.
  virtual int job_rank(int rank) const { return rank; }
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

  /// Collectives ordered on the compute stream, for the model's activations (tensor parallelism):
  /// over device memory (NCCL) each starts after the work the compute stream has been given so
  /// far, the compute stream's later work sees its result, and the host does not wait for it (the
  /// communicator watches them for errors and its timeout at its later calls, and in
  /// wait_queued()). Elements: f32, or bf16 where sums_bf16() (bf16 additions: NCCL reduces bf16
  /// natively); gathers move f32 or bf16. Over host memory they are done when the call returns.
  void queue_all_reduce_sum(void* data, std::int64_t count, DType dtype);
  void queue_reduce_scatter_sum(const void* send, void* recv, std::int64_t shard, DType dtype);
  void queue_all_gather(const void* send, void* recv, std::int64_t shard, DType dtype);
  /// Whether queue_all_reduce_sum and queue_reduce_scatter_sum take bf16 elements.
  virtual bool sums_bf16() const { return false; }
  /// Waits (on the host) for every queued collective and request (Request::queue_wait); the
  /// timeout applies.
  virtual void wait_queued() {}
  void barrier();

  /// Point-to-point transfers: `count` elements of `dtype` (any: the bytes are moved as they are)
  /// to or from `peer`, a rank of this group other than this one (RuntimeError otherwise; on a
  /// one-rank group there is none). Only the two ranks take part. Matching: the sends from rank
  /// A to rank B meet B's receives from A in the order each side started them (the k-th send
  /// with the k-th receive), with the same count and dtype; every one must be matched.
  ///
  /// Progress: over MPI each started transfer proceeds on its own. Over NCCL (device memory) the
  /// transfers and collectives of a communicator run one after the other in the order they were
  /// started, and a transfer finishes only once its peer has reached the matching call. So two
  /// ranks that each start a send to the other before the receive deadlock there, as does a ring
  /// in which every rank sends on before it receives, or a rank that starts a receive from B
  /// before a send to B while B starts the matching receive after its own send. Transfers that
  /// must be under way together go in one start_exchange or start_transfers (one NCCL group); separate calls are
  /// safe when both sides start them in the same order (1F1B: the earlier stage sends an
  /// activation when the later one receives it). Under NCCL a transfer also comes after the work
  /// the compute stream has been given before it (which wrote the buffer sent, or still reads
  /// the one a receive fills), and the compute stream's work after wait() sees what arrived.
  ///
  /// Every call, blocking or started, is counted in traffic() as a `send` or a `recv`; a request's
  /// wait() gives up after the communicator's timeout, naming this rank and the peer: MPI stops
  /// every rank of the job, NCCL throws (RuntimeError) after aborting its communicator.
  std::unique_ptr<Request> start_send(const void* data, std::int64_t count, DType dtype, int peer);
  std::unique_ptr<Request> start_recv(void* data, std::int64_t count, DType dtype, int peer);
  /// The same, finished before returning. A blocking send may wait until the peer receives.
  void send(const void* data, std::int64_t count, DType dtype, int peer);
  void recv(void* data, std::int64_t count, DType dtype, int peer);
  /// Sends `send` (count) to `send_to` and receives `recv` (count) from `recv_from` together:
  /// both are under way before either must finish, so two ranks may exchange with each other
  /// (send_to == recv_from), or a ring pass data on, without deadlock on any implementation.
  /// Counted as one send and one receive. The buffers must not overlap.
  std::unique_ptr<Request> start_exchange(const void* send, void* recv, std::int64_t count, DType dtype, int send_to,
                                          int recv_from);
  std::unique_ptr<Request> start_exchange(const void* send, void* recv, std::int64_t count, DType dtype, int peer) {
    return start_exchange(send, recv, count, dtype, peer, peer);
  }
  /// Starts `transfers` together, any number to and from any peers: all are under way before any
  /// must finish (over NCCL, one group), and the request finishes when all have. Two ranks whose
  /// groups hold each other's counterparts never deadlock, whatever the order inside the groups;
  /// the k-th send from A to B still meets B's k-th receive from A, in the order of the groups and
  /// within them. Counted as their sends and receives. No two buffers may overlap.
  std::unique_ptr<Request> start_transfers(const std::vector<PeerTransfer>& transfers);

  /// All-to-all of varying counts (a MoE layer's tokens to their experts' ranks and back): `send`
  /// holds send_counts[r] elements for each rank r of the group, end to end in rank order (this
  /// rank's own part included), and `recv` receives recv_counts[r] elements from each rank r, end
  /// to end in rank order; recv_counts[r] must be what rank r sends this one (exchange the counts
  /// first: an all-to-all of one count per rank). Elements of `dtype`, moved as they are; the
  /// buffers must not overlap. A send and a receive per other rank, all under way together (over
  /// MPI non-blocking ones, in pieces where a count would exceed an int: the ranks need not agree
  /// on any size, as one MPI_Alltoallv call would have them; over NCCL one group, in pieces),
  /// under the communicator's timeout like every collective.
  std::unique_ptr<Request> start_all_to_all(const void* send, const std::vector<std::int64_t>& send_counts, void* recv,
                                            const std::vector<std::int64_t>& recv_counts, DType dtype);
  void all_to_all(const void* send, const std::vector<std::int64_t>& send_counts, void* recv,
                  const std::vector<std::int64_t>& recv_counts, DType dtype);

  /// Long work outside collectives (reading or writing checkpoint files): tells the other ranks
  /// that this one is alive, so that a collective waiting for it under patience (set_patience)
  /// goes on waiting. Cheap; sends at most a message a second. Call it from the thread that makes
  /// this rank's collectives, every chunk or every 50-100 ms (dist/file_work.h does). Stops the
  /// job, as a collective would, when another rank found ranks lost. Over MPI only; elsewhere nothing.
  virtual void keep_alive() {}
  /// Patience for the collectives after file work (dist::Patience sets and clears it): while
  /// limit_s > 0, a collective or transfer that has waited dist.timeout_s goes on waiting, up to
  /// limit_s in all, as long as every rank is heard alive: rank 0 hears the others (each sends a
  /// heartbeat a second while it waits or calls keep_alive) and tells them, once a second, that it
  /// heard everyone within dist.timeout_s; a rank silent for dist.timeout_s (dead, hung, cut off)
  /// still stops the job after about dist.timeout_s. 0: no patience (dist.timeout_s alone). Over
  /// MPI only; NCCL collectives keep dist.timeout_s.
  void set_patience(double limit_s) { patience_s_ = limit_s; }
  double patience_s() const { return patience_s_; }

  /// The collectives and transfers this rank has made on this communicator so far.
  const Traffic& traffic() const { return traffic_; }

  /// What error messages call the ranks of this group ("stage": "stage 1 (rank 3)" for the
  /// pipeline group); unset, they are named by rank alone.
  void set_rank_noun(std::string noun) { rank_noun_ = std::move(noun); }
  /// Where a job rank sits (" (stage 1)" on a mesh with a pipeline), appended to the ranks a
  /// timed-out collective names; unset, nothing.
  void set_job_rank_place(std::function<std::string(int job_rank)> place) { job_rank_place_ = std::move(place); }
  std::string job_rank_place(int job_rank) const { return job_rank_place_ ? job_rank_place_(job_rank) : ""; }

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
  /// Defaults: the started collective, waited for (f32 sums only).
  virtual void do_queue_all_reduce_sum(void* data, std::int64_t count, DType dtype);
  virtual void do_queue_reduce_scatter_sum(const void* send, void* recv, std::int64_t shard, DType dtype);
  virtual void do_queue_all_gather(const void* send, void* recv, std::int64_t shard, DType dtype);
  // Point-to-point: `peer` has been checked (another rank of this group), count >= 0.
  virtual std::unique_ptr<Request> do_start_send(const void* data, std::int64_t count, DType dtype, int peer) = 0;
  virtual std::unique_ptr<Request> do_start_recv(void* data, std::int64_t count, DType dtype, int peer) = 0;
  virtual std::unique_ptr<Request> do_start_exchange(const void* send, void* recv, std::int64_t count, DType dtype,
                                                     int send_to, int recv_from) = 0;
  /// Default: each transfer started on its own (do_start_send, do_start_recv), for an
  /// implementation that moves every started transfer on its own (MPI); NCCL groups them.
  virtual std::unique_ptr<Request> do_start_transfers(const std::vector<PeerTransfer>& transfers);
  /// The own part copied (host memory), the others' through do_start_transfers.
  virtual std::unique_ptr<Request> do_start_all_to_all(const void* send, const std::vector<std::int64_t>& send_counts,
                                                       void* recv, const std::vector<std::int64_t>& recv_counts,
                                                       DType dtype);
  /// "rank J" or, with a noun set, "stage R (rank J)": member `rank` of this group, whose rank in
  /// the job is J.
  std::string rank_phrase(int rank) const;
  /// "16 bf16": what a transfer moves, for messages.
  static std::string elements(std::int64_t count, DType dtype);

 private:
  void count(Traffic::Kind kind, double bytes);
  // A request whose wait() adds the time it took to traffic_.wait_s.
  std::unique_ptr<Request> timed(std::unique_ptr<Request> request);
  friend class TimedRequest;
  // RuntimeError unless `peer` is another rank of this group and count is not negative.
  void check_transfer(const char* operation, std::int64_t count, int peer) const;
  Traffic traffic_;
  double patience_s_ = 0.0;
  std::string rank_noun_;
  std::function<std::string(int)> job_rank_place_;
};

/// The most elements one call of the library under a communicator carries: `library_limit` (MPI
/// counts are ints: 2^31 - 1), or fewer when the environment variable LLMTRAIN_COMM_MAX_ELEMENTS
/// holds a smaller positive number (tests force small pieces with it; every rank must see the
/// same value). A collective or transfer of more elements is made as several calls of at most
/// this many, each over the same part of every rank's block (a reduce-scatter's or all-gather's
/// piece j is the same elements of each rank's shard), so that the result is that of one call.
/// It stays one collective: counted once in traffic(), one wait, one timeout. InputError for a
/// value that is not a positive integer. `variable` names another limit forced the same way
/// (LLMTRAIN_COMM_MAX_BYTES: MPI's bytes per call, dist/mpi_pieces.h).
std::int64_t piece_limit(std::int64_t library_limit, const char* variable = "LLMTRAIN_COMM_MAX_ELEMENTS");

/// Calls `piece(offset, length)` for consecutive pieces of at most `limit` elements covering
/// [0, count), in order; once with (0, 0) when count is 0 (every rank still takes part).
template <class Piece>
void for_each_piece(std::int64_t count, std::int64_t limit, Piece piece) {
  if (count <= 0) {
    piece(std::int64_t(0), std::int64_t(0));
    return;
  }
  for (std::int64_t offset = 0; offset < count; offset += limit) piece(offset, std::min(limit, count - offset));
}

/// World size 1: every collective is the identity.
std::unique_ptr<Communicator> make_single_communicator();

/// The job's processes: MPI when this process was started by mpirun or srun (and the build has
/// MPI), else a single process. Logs its choice on rank 0 when `verbose`. A collective that
/// does not finish within `timeout_s` (a rank died or hangs) aborts every rank with a message.
std::unique_ptr<Communicator> make_communicator(bool verbose, double timeout_s = 600.0);

/// The communicators of one training process on its mesh (dist/mesh.h): every rank, and for each
/// axis the group of ranks that share every coordinate but those the axis's row spans. Over host
/// memory always; also over device memory on GPUs (NCCL), where the gradients and activations live.
struct Communicators {
  /// One axis's group: over host memory, and over device memory where that is another communicator.
  struct Group {
    std::unique_ptr<Communicator> host;
    std::unique_ptr<Communicator> device;  // null: `host` serves
  };

  Mesh mesh;
  std::unique_ptr<Communicator> world;  // every rank, host memory: losses, checksums, barriers, checkpoints
  PerAxis<Group> groups;

  /// Axis a's group over host memory (scalars: losses, norms; the sampler's rank).
  Communicator& host(Axis a) const { return *groups[a].host; }
  /// Axis a's group over the memory the gradients and activations live in (NCCL for CUDA with
  /// several ranks).
  Communicator& device(Axis a) const { return groups[a].device ? *groups[a].device : *groups[a].host; }
  /// The ranks that read different sequences: the data axis's times the expert axis's.
  int readers() const { return mesh.size(Axis::data) * mesh.size(Axis::expert); }
  /// Which of them this rank is (the data index without the context axis, times the expert
  /// group's size, plus the expert index): which sequences it reads.
  int data_index() const {
    return host(Axis::data).rank() / mesh.size(Axis::context) * mesh.size(Axis::expert) + host(Axis::expert).rank();
  }
  /// What this rank has sent over axis a's group, host and device communicators together.
  Traffic traffic(Axis a) const;
};

/// Splits `world` into the groups of `mesh` (mesh.world() must be world's size).
Communicators split_mesh(std::unique_ptr<Communicator> world, const Mesh& mesh);

/// make_communicator's choice for the host, split into the groups of `mesh_of(world size)`
/// (which may throw InputError naming the keys that do not divide it), and for `device` cuda:
/// binds this process to its GPU (by local rank) and adds NCCL over that GPU for every group
/// with more than one rank. The device is chosen by `choose` once the host communicator exists
/// (it may run collectives on it, so that every rank makes the same choice).
Communicators make_communicators(const std::function<Device(Communicator& world)>& choose, double timeout_s,
                                 const std::function<Mesh(int world)>& mesh_of);
/// The same on a fixed device.
Communicators make_communicators(Device device, double timeout_s, const std::function<Mesh(int world)>& mesh_of);

/// True when the environment says this process is one of several started by mpirun or srun.
bool launched_by_mpi();

/// Whether this process is leaving its job alone on an error: the error unwound its MPI
/// communicators while the other ranks, all answering, were elsewhere (waiting in a collective for
/// this rank), so nothing collective can follow. MPI is not finalized; the process reports its
/// own error (whichever rank it is) and exits with that error's status, and the launcher stops
/// the other ranks. Ranks that meet the same error together leave together, as without an error.
bool leaving_alone();
void set_leaving_alone();

}  // namespace llmtrain::dist
