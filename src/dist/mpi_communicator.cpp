// MPI over host memory. Every collective and transfer is started non-blocking and polled, so that
// one that does not finish within the timeout (a rank died or hangs) stops the job with a clear
// message instead of hanging it. Each surviving rank stops with one line naming the lost ranks and
// their hosts (dist/lost_ranks.h), exit status 76. The calls in pieces: dist/mpi_pieces.h.
#include <mpi.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <deque>
#include <exception>
#include <functional>
#include <vector>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <thread>

#include "core/error.h"
#include "dist/communicator.h"
#include "dist/lost_ranks.h"
#include "dist/mpi_pieces.h"

namespace llmtrain::dist {
namespace {

class MpiCommunicator;

// How long a rank unwound by an error waits at a barrier before asking if the others are alive.
constexpr double leave_grace_s = 3.0;

class MpiCommunicator final : public Communicator {
  using Clock = std::chrono::steady_clock;

 public:
  /// The job's processes (MPI_COMM_WORLD); initialises MPI unless something already did.
  explicit MpiCommunicator(double timeout_s) : timeout_s_(timeout_s) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      int provided = 0;
      check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread");
      owns_mpi_ = true;
    }
    adopt(MPI_COMM_WORLD);
    lost_ranks::gather_hosts(comm_);
    // Threads per rank: OMP_NUM_THREADS when set; otherwise the cores this rank may run on, shared
    // among the node's ranks. OpenMP's default, a thread per core in every rank, oversubscribes
    // the node, and each parallel region then waits for descheduled threads.
    if (local_size_ > 1 && !std::getenv("OMP_NUM_THREADS")) {
      omp_set_num_threads(std::max(1, omp_get_num_procs() / local_size_));
    }
  }
  /// A group split from another (owns `comm`).
  MpiCommunicator(MPI_Comm comm, double timeout_s) : timeout_s_(timeout_s), owns_comm_(true) { adopt(comm); }
  ~MpiCommunicator() override {
    if (!owns_mpi_ && !owns_comm_) return;
    if (leaving_alone()) return;  // another group found it: nothing collective can follow
    if (std::uncaught_exceptions() > 0) {
      if (!others_follow()) {
        set_leaving_alone();
        return;
      }
    } else {
      do_barrier();
    }
    drain_heartbeats();
    if (owns_comm_) MPI_Comm_free(&comm_);
    if (owns_mpi_) MPI_Finalize();
  }

  // The barrier of a communicator unwound by an error: whether the other ranks reach it. They do
  // when they met the same error. While they have not, this rank asks every few seconds whether
  // they are alive; once all answer, they are elsewhere (waiting in a collective for this rank,
  // where roll calls are answered) and it leaves alone (false). A rank that never answers may be
  // lost: the watchdog then stops the job and names it, as in any collective.
  bool others_follow() {
    Pending request(*this, "barrier");
    check(MPI_Ibarrier(comm_, &request.pieces.add()), "MPI_Ibarrier");
    ++seq_;
    send_heartbeat();
    std::vector<int> others;
    for (int r = 0; r < world_; ++r) {
      if (r != rank_) others.push_back(job_ranks_[std::size_t(r)]);
    }
    const auto grace = std::chrono::duration<double>(std::min(timeout_s_, leave_grace_s));
    auto asked = Clock::now();
    bool alone = false;
    poll([&] {
      if (request.pieces.test()) return true;
      if (Clock::now() - asked < grace) return false;
      alone = lost_ranks::unanswered(others, std::min(timeout_s_, 2.0)).empty();
      asked = Clock::now();
      return alone;
    }, [&] { abort_job("barrier"); });
    return !alone;
  }

  std::unique_ptr<Communicator> split(int color, int key) override {
    MPI_Comm group;
    check(MPI_Comm_split(comm_, color, key, &group), "MPI_Comm_split");
    return std::make_unique<MpiCommunicator>(group, timeout_s_);
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  int local_rank() const override { return local_rank_; }
  int job_rank(int rank) const override { return job_ranks_[std::size_t(rank)]; }
  std::string name() const override { return "mpi"; }

  void do_all_reduce_sum(float* data, std::int64_t count) override {
    start_all_reduce(data, count, MPI_FLOAT, MPI_SUM, "all_reduce")->wait();
  }
  void do_all_reduce_sum(double* data, std::int64_t count) override {
    start_all_reduce(data, count, MPI_DOUBLE, MPI_SUM, "all_reduce")->wait();
  }
  void do_all_reduce_max(std::int64_t* data, std::int64_t count) override {
    start_all_reduce(data, count, MPI_INT64_T, MPI_MAX, "all_reduce (max)")->wait();
  }

  void do_all_reduce_max(float* data, std::int64_t count) override {
    start_all_reduce(data, count, MPI_FLOAT, MPI_MAX, "all_reduce (max)")->wait();
  }

  std::unique_ptr<Request> do_start_all_reduce_sum(float* data, std::int64_t count) override {
    return start_all_reduce(data, count, MPI_FLOAT, MPI_SUM, "all_reduce (gradient bucket)");
  }

  // A call is whole while its total (every rank's block) stays within MPI's ints, in elements and
  // in bytes (dist/mpi_pieces.h). In pieces, piece j of every rank's block is packed into a
  // staging buffer and reduce-scattered from there, one piece after another (each reuses the
  // buffer): MPI's reduce-scatter takes the blocks contiguous, and the same call on fewer elements
  // sums them in the same order.
  std::unique_ptr<Request> do_start_reduce_scatter_sum(const float* send, float* recv, std::int64_t shard) override {
    auto request = std::make_unique<Pending>(*this, "reduce_scatter");
    if (shard <= collective_piece(world_, sizeof(float))) {
      check(MPI_Ireduce_scatter_block(send, recv, int(shard), MPI_FLOAT, MPI_SUM, comm_, &request->pieces.add()),
            "MPI_Ireduce_scatter_block");
      return request;
    }
    const int world = world_;
    const MPI_Comm comm = comm_;
    for_each_piece(shard, staged_piece(world_, sizeof(float)), [&](std::int64_t offset, std::int64_t length) {
      request->pieces.later.push_back([=](Pieces& pieces) {
        pieces.staging.resize(std::size_t(world * length));
        for (int r = 0; r < world; ++r) {
          std::copy_n(send + std::int64_t(r) * shard + offset, length, pieces.staging.data() + r * length);
        }
        check(MPI_Ireduce_scatter_block(pieces.staging.data(), recv + offset, int(length), MPI_FLOAT, MPI_SUM, comm,
                                        &pieces.add()),
              "MPI_Ireduce_scatter_block");
      });
    });
    request->pieces.test();  // starts the first piece
    return request;
  }

  // Whole within the same bounds as a reduce-scatter. In pieces, piece j gathers the same elements
  // of every rank's shard: received through a type of `length` elements whose extent is a whole
  // shard, so that each lands in its rank's block. Every count, total and byte count of a call is
  // within the bounds; the blocks' distance is the type's extent, an MPI_Aint. All pieces start
  // at once (none waits on another), so that collectives start in the same order on every rank.
  std::unique_ptr<Request> do_start_all_gather(const void* send, void* recv, std::int64_t shard, DType dtype) override {
    auto request = std::make_unique<Pending>(*this, "all_gather");
    // bf16 travels as 16-bit words: a gather only moves them.
    const MPI_Datatype type = dtype == DType::f32 ? MPI_FLOAT : MPI_UINT16_T;
    const std::size_t size = dtype_size(dtype);
    // This rank's part already in place in recv is MPI_IN_PLACE (MPI forbids overlapping buffers).
    const char* mine = static_cast<const char*>(recv) + std::size_t(rank_ * shard) * size;
    const bool in_place = send == mine;
    if (shard <= collective_piece(world_, size)) {
      check(MPI_Iallgather(in_place ? MPI_IN_PLACE : send, int(shard), type, recv, int(shard), type, comm_,
                           &request->pieces.add()),
            "MPI_Iallgather");
      return request;
    }
    for_each_piece(shard, collective_piece(world_, size), [&](std::int64_t offset, std::int64_t length) {
      MPI_Datatype block, strided;
      check(MPI_Type_contiguous(int(length), type, &block), "MPI_Type_contiguous");
      check(MPI_Type_create_resized(block, 0, MPI_Aint(shard) * MPI_Aint(size), &strided), "MPI_Type_create_resized");
      MPI_Type_free(&block);
      check(MPI_Type_commit(&strided), "MPI_Type_commit");
      request->pieces.types.push_back(strided);
      const void* source = in_place ? MPI_IN_PLACE : static_cast<const char*>(send) + std::size_t(offset) * size;
      check(MPI_Iallgather(source, int(length), type, static_cast<char*>(recv) + std::size_t(offset) * size, 1, strided,
                           comm_, &request->pieces.add()),
            "MPI_Iallgather");
    });
    return request;
  }

  void do_broadcast(float* data, std::int64_t count, int root) override {
    Pending request(*this, "broadcast");
    for_each_piece(count, collective_piece(1, sizeof(float)), [&](std::int64_t offset, std::int64_t length) {
      check(MPI_Ibcast(data + offset, int(length), MPI_FLOAT, root, comm_, &request.pieces.add()), "MPI_Ibcast");
    });
    request.wait();
  }

  void do_barrier() override {
    Pending request(*this, "barrier");
    check(MPI_Ibarrier(comm_, &request.pieces.add()), "MPI_Ibarrier");
    request.wait();
  }

  std::unique_ptr<Request> do_start_send(const void* data, std::int64_t count, DType dtype, int peer) override {
    auto request = std::make_unique<Transfer>(*this, "send of " + elements(count, dtype) + " to " + rank_phrase(peer));
    start_send_part(request->parts, data, count, dtype, peer);
    return request;
  }

  std::unique_ptr<Request> do_start_recv(void* data, std::int64_t count, DType dtype, int peer) override {
    auto request = std::make_unique<Transfer>(*this, "recv of " + elements(count, dtype) + " from " + rank_phrase(peer));
    start_recv_part(request->parts, data, count, dtype, peer);
    return request;
  }

  // Both posted before either is waited for: MPI lets them progress together.
  std::unique_ptr<Request> do_start_exchange(const void* send, void* recv, std::int64_t count, DType dtype, int send_to,
                                             int recv_from) override {
    auto request = std::make_unique<Transfer>(*this, "exchange (send of " + elements(count, dtype) + " to " +
                                                         rank_phrase(send_to) + ", recv from " + rank_phrase(recv_from) + ")");
    start_recv_part(request->parts, recv, count, dtype, recv_from);
    start_send_part(request->parts, send, count, dtype, send_to);
    return request;
  }

  // Polls the parts of a transfer until all are done; past the timeout, stops every rank with a
  // message that names the peers whose part never finished. Only the two ranks take part, so the
  // count of collectives (seq_) stays as it is.
  void wait_transfer(std::vector<TransferPart>& parts, const std::string& operation) {
    init_tables();
    poll(
        [&] {
          bool done = true;
          for (TransferPart& part : parts) {
            int finished = 1;  // a finished request has become MPI_REQUEST_NULL
            if (part.mpi != MPI_REQUEST_NULL) check(MPI_Test(&part.mpi, &finished, MPI_STATUS_IGNORE), "MPI_Test");
            done = done && finished;
          }
          return done;
        },
        [&] {
          std::string who;
          for (const TransferPart& part : parts) {
            // The pieces of one transfer share their blame: named once.
            if (part.mpi != MPI_REQUEST_NULL && who.find(part.blame) == std::string::npos) {
              who += (who.empty() ? "" : "; ") + part.blame;
            }
          }
          stop_job(operation, who + " (dead or hung)", {});
        });
  }

  // Polls until every piece is done; past the timeout, stops every rank (MPI_Abort) with a
  // message. A collective is one number in the count (seq_), however many pieces it takes. On the
  // side, every other rank tells rank 0 when it enters a collective and, while it waits in one,
  // once a second that it is alive; so rank 0 can name the ranks that never arrived or stopped
  // answering.
  void wait(Pieces& pieces, const char* operation) {
    ++seq_;
    send_heartbeat();
    poll([&] { return pieces.test(); }, [&] { abort_job(operation); });
  }

 private:
  // Calls `done` until it returns true, and `late` (which does not return) once the timeout has
  // passed. Meanwhile rank 0 takes the heartbeats that arrive and every other rank sends one a
  // second (also while it waits in a transfer: it is alive, though not in the collective).
  template <class Done, class Late>
  void poll(Done done, Late late) {
    const auto start = Clock::now();
    auto last_beat = start;
    for (int spins = 0;; ++spins) {
      const bool finished = done();
      if (rank_ == 0) collect_heartbeats();
      if (finished) return;
      if (spins % 64 == 0) {
        lost_ranks::answer_roll_calls();
        if (lost_ranks::take_verdicts()) stop_job("rank " + lost_ranks::verdict_from() + "'s collective", "", {});
      }
      if (spins > 1000) std::this_thread::sleep_for(std::chrono::microseconds(50));
      const auto now = Clock::now();
      if (rank_ != 0 && now - last_beat > std::chrono::seconds(1)) {
        send_heartbeat();
        last_beat = now;
      }
      if (patience_s() > 0) patience_tick(now, spins);  // file work: dist/file_work.h
      const double waited = std::chrono::duration<double>(now - start).count();
      if (waited > timeout_s_ && !patient(now, waited)) late();
    }
  }

 public:
  // ---- Patience after file work (dist/file_work.h). Heartbeats go to rank 0 as above; rank 0,
  // while it hears every rank within dist.timeout_s, grants patience to the others once a second
  // (grant_tag). A patient collective waits past dist.timeout_s, up to patience_s() in all: on
  // rank 0 while every rank not yet in it was heard within dist.timeout_s, elsewhere while rank
  // 0's last grant is younger than dist.timeout_s.
  void keep_alive() override {
    const auto now = Clock::now();
    lost_ranks::answer_roll_calls();
    if (lost_ranks::take_verdicts()) stop_job("rank " + lost_ranks::verdict_from() + "'s collective", "", {});
    if (rank_ == 0) {
      init_tables();
      collect_heartbeats();
      send_grants(now, false);
      return;
    }
    take_grants();
    if (now - last_keep_alive_ > std::chrono::seconds(1)) {
      send_heartbeat();
      last_keep_alive_ = now;
    }
  }

 private:
  void patience_tick(Clock::time_point now, int spins) {
    if (rank_ == 0) {
      send_grants(now, true);
    } else if (spins % 64 == 0) {
      take_grants();
    }
  }

  // Whether a collective that has waited `waited` seconds (past dist.timeout_s) may go on.
  bool patient(Clock::time_point now, double waited) {
    if (patience_s() <= 0 || waited > patience_s()) return false;
    if (rank_ == 0) return every_rank_heard(now, true);
    return std::chrono::duration<double>(now - last_grant_).count() <= timeout_s_;
  }

  // Rank 0: every other rank sent a heartbeat within dist.timeout_s (`in_collective`: or has
  // entered the collective this rank waits in).
  bool every_rank_heard(Clock::time_point now, bool in_collective) const {
    for (int r = 1; r < world_; ++r) {
      if (in_collective && arrived_[std::size_t(r)] >= seq_) continue;
      if (std::chrono::duration<double>(now - last_heard_[std::size_t(r)]).count() > timeout_s_) return false;
    }
    return true;
  }

  // Rank 0, once a second while every rank is heard: a grant to every other rank.
  void send_grants(Clock::time_point now, bool in_collective) {
    init_tables();
    if (world_ < 2 || now - last_grant_ < std::chrono::seconds(1) || !every_rank_heard(now, in_collective)) return;
    last_grant_ = now;
    while (!grant_sends_.empty()) {  // completed ones are dropped
      int done = 0;
      MPI_Test(&grant_sends_.front(), &done, MPI_STATUS_IGNORE);
      if (!done) break;
      grant_sends_.pop_front();
    }
    for (int r = 1; r < world_; ++r) {
      grant_sends_.push_back(MPI_REQUEST_NULL);
      MPI_Isend(&grants_sent_, 0, MPI_INT64_T, r, grant_tag, comm_, &grant_sends_.back());
    }
    ++grants_sent_;
  }

  // Ranks > 0: takes rank 0's grants that have arrived.
  void take_grants() {
    for (int flag = 1; flag;) {
      MPI_Iprobe(0, grant_tag, comm_, &flag, MPI_STATUS_IGNORE);
      if (!flag) break;
      MPI_Recv(nullptr, 0, MPI_INT64_T, 0, grant_tag, comm_, MPI_STATUS_IGNORE);
      ++grants_taken_;
      last_grant_ = Clock::now();
    }
  }

  static constexpr int heartbeat_tag = 7301;
  static constexpr int count_tag = 7302;
  // 7303 and 7306 on MPI_COMM_WORLD: verdicts and roll calls (dist/lost_ranks.cpp).
  static constexpr int grant_tag = 7304;    // rank 0 to the others: every rank heard (patience)
  static constexpr int grant_count_tag = 7305;
  // Transfers (send, recv, exchange) use one tag of their own: MPI matches the messages between
  // two ranks on one tag in the order they were posted, which is the order the interface promises.
  static constexpr int transfer_tag = 7310;

  struct Heartbeat {
    std::int64_t seq;
    MPI_Request request;
  };

  // Takes `comm` as this communicator's group: rank, size, rank within the node, and the job
  // ranks of its members (messages name ranks as mpirun numbers them).
  void adopt(MPI_Comm comm) {
    comm_ = comm;
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &world_);
    MPI_Comm node;  // the ranks that share this node's memory
    check(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &node), "MPI_Comm_split_type");
    MPI_Comm_rank(node, &local_rank_);
    MPI_Comm_size(node, &local_size_);
    MPI_Comm_free(&node);
    MPI_Group group, job;
    MPI_Comm_group(comm_, &group);
    MPI_Comm_group(MPI_COMM_WORLD, &job);
    std::vector<int> members(static_cast<std::size_t>(world_));
    for (int r = 0; r < world_; ++r) members[std::size_t(r)] = r;
    job_ranks_.resize(std::size_t(world_));
    MPI_Group_translate_ranks(group, world_, members.data(), job, job_ranks_.data());
    MPI_Group_free(&group);
    MPI_Group_free(&job);
  }

  // Rank 0 names the ranks that went silent and do not answer a roll call either. A rank still
  // heard from is alive and waiting on others (in an earlier collective that the lost ranks never
  // finished for it, in a transfer, in file work); so is one that answers the roll call (it waits
  // in another group's collective, and its heartbeats go to that group's rank 0). Such ranks are
  // named only when no rank is lost, as the ones that never arrived.
  [[noreturn]] void abort_job(const char* operation) {
    std::vector<int> silent, behind;
    for (int r = 1; r < world_ && rank_ == 0; ++r) {
      if (Clock::now() - last_heard_[std::size_t(r)] > std::chrono::milliseconds(2500)) {
        silent.push_back(job_ranks_[std::size_t(r)]);
      } else if (arrived_[std::size_t(r)] < seq_) {
        behind.push_back(job_ranks_[std::size_t(r)]);
      }
    }
    if (!silent.empty()) {
      const std::vector<int> lost = lost_ranks::unanswered(silent, std::min(timeout_s_, 2.0));
      for (int job : silent) {
        if (std::find(lost.begin(), lost.end(), job) == lost.end()) behind.push_back(job);
      }
      std::sort(behind.begin(), behind.end());
      silent = lost;
    }
    const std::vector<int>& missing = silent.empty() ? behind : silent;
    const std::string who = rank_ != 0        ? "rank " + std::to_string(job_ranks_[0]) + " names the missing rank(s)"
                            : missing.empty() ? "every rank is in it, but it did not complete"
                                              : "";
    stop_job(std::string(operation) + " (collective #" + std::to_string(seq_) + ")", who, missing);
  }

  // Prints "llmtrain: error: rank R: OPERATION did not finish within dist.timeout_s = T s: WHO;
  // stopping every rank" and stops the whole job, not just this group, with exit status 76. WHO
  // names the lost ranks and their hosts (dist/lost_ranks.h: the ranks this one found `lost`, the
  // verdicts of others, or, when no rank has names, a roll call of the survivors); else `who`.
  [[noreturn]] void stop_job(const std::string& operation, const std::string& who, const std::vector<int>& lost) {
    // Whatever happens to MPI_Abort (it can wait on a daemon that is gone), the process ends.
    std::thread([wait_s = std::min(timeout_s_, 10.0)] {
      std::this_thread::sleep_for(std::chrono::duration<double>(wait_s + 5.0));
      std::_Exit(lost_ranks::exit_status());
    }).detach();
    const bool no_names = who.find("names the missing") != std::string::npos;
    const std::string line = lost_ranks::settle(lost, who, no_names, std::min(timeout_s_, 10.0),
                                                [this](int job) { return job_rank_place(job); });
    std::fprintf(stderr, "llmtrain: error: rank %d: %s did not finish within dist.timeout_s = %.0f s: %s; stopping every rank\n",
                 job_ranks_[std::size_t(rank_)], operation.c_str(), timeout_s_, line.c_str());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, lost_ranks::exit_status());
    std::_Exit(lost_ranks::exit_status());
  }

  // A transfer of more elements than a count holds is several messages, matched in order (one tag).
  void start_send_part(std::vector<TransferPart>& parts, const void* data, std::int64_t count, DType dtype, int peer) {
    for_each_piece(count, mpi_piece_limit(), [&](std::int64_t offset, std::int64_t length) {
      parts.push_back({MPI_REQUEST_NULL, rank_phrase(peer) + " never received it"});
      check(MPI_Isend(static_cast<const char*>(data) + std::size_t(offset) * dtype_size(dtype), int(length),
                      element_type(dtype), peer, transfer_tag, comm_, &parts.back().mpi),
            "MPI_Isend");
    });
  }

  void start_recv_part(std::vector<TransferPart>& parts, void* data, std::int64_t count, DType dtype, int peer) {
    for_each_piece(count, mpi_piece_limit(), [&](std::int64_t offset, std::int64_t length) {
      parts.push_back({MPI_REQUEST_NULL, rank_phrase(peer) + " never sent it"});
      check(MPI_Irecv(static_cast<char*>(data) + std::size_t(offset) * dtype_size(dtype), int(length),
                      element_type(dtype), peer, transfer_tag, comm_, &parts.back().mpi),
            "MPI_Irecv");
    });
  }

  // A collective of `count` elements in place, in pieces within MPI's ints (elements and bytes),
  // all started.
  template <class T>
  std::unique_ptr<Request> start_all_reduce(T* data, std::int64_t count, MPI_Datatype type, MPI_Op op,
                                            const char* operation) {
    auto request = std::make_unique<Pending>(*this, operation);
    for_each_piece(count, collective_piece(1, sizeof(T)), [&](std::int64_t offset, std::int64_t length) {
      check(MPI_Iallreduce(MPI_IN_PLACE, data + offset, int(length), type, op, comm_, &request->pieces.add()),
            "MPI_Iallreduce");
    });
    return request;
  }

  // Rank 0's record of the others (the side channel of heartbeats), made on first use.
  void init_tables() {
    if (rank_ != 0 || !arrived_.empty()) return;
    arrived_.assign(std::size_t(world_), 0);
    received_.assign(std::size_t(world_), 0);
    last_heard_.assign(std::size_t(world_), Clock::now());
  }

  void send_heartbeat() {
    if (rank_ == 0) {
      init_tables();
      return;
    }
    while (!sends_.empty()) {  // completed sends are dropped; the rest stay alive until taken
      int done = 0;
      MPI_Test(&sends_.front().request, &done, MPI_STATUS_IGNORE);
      if (!done) break;
      sends_.pop_front();
    }
    sends_.push_back({seq_, MPI_REQUEST_NULL});
    MPI_Isend(&sends_.back().seq, 1, MPI_INT64_T, 0, heartbeat_tag, comm_, &sends_.back().request);
    ++sent_;
  }

  void receive_heartbeat(int source) {
    std::int64_t seq = 0;
    MPI_Recv(&seq, 1, MPI_INT64_T, source, heartbeat_tag, comm_, MPI_STATUS_IGNORE);
    auto& last = arrived_[std::size_t(source)];
    last = std::max(last, seq);
    received_[std::size_t(source)] += 1;
    last_heard_[std::size_t(source)] = Clock::now();
  }

  void collect_heartbeats() {
    for (int flag = 1; flag;) {
      MPI_Status status;
      MPI_Iprobe(MPI_ANY_SOURCE, heartbeat_tag, comm_, &flag, &status);
      if (flag) receive_heartbeat(status.MPI_SOURCE);
    }
  }

  // At the end every rank says how many heartbeats it sent and rank 0 takes them all, so no
  // send is left pending when MPI shuts down.
  // Then rank 0 says how many grants it sent, and each rank takes the rest of them.
  void drain_heartbeats() {
    if (rank_ == 0) {
      init_tables();
      for (int r = 1; r < world_; ++r) {
        std::int64_t count = 0;
        MPI_Recv(&count, 1, MPI_INT64_T, r, count_tag, comm_, MPI_STATUS_IGNORE);
        while (received_[std::size_t(r)] < count) receive_heartbeat(r);
      }
      for (int r = 1; r < world_; ++r) MPI_Send(&grants_sent_, 1, MPI_INT64_T, r, grant_count_tag, comm_);
      for (auto& g : grant_sends_) MPI_Wait(&g, MPI_STATUS_IGNORE);
    } else {
      MPI_Send(&sent_, 1, MPI_INT64_T, 0, count_tag, comm_);
      for (auto& h : sends_) MPI_Wait(&h.request, MPI_STATUS_IGNORE);
      std::int64_t grants = 0;
      MPI_Recv(&grants, 1, MPI_INT64_T, 0, grant_count_tag, comm_, MPI_STATUS_IGNORE);
      for (; grants_taken_ < grants; ++grants_taken_) {
        MPI_Recv(nullptr, 0, MPI_INT64_T, 0, grant_tag, comm_, MPI_STATUS_IGNORE);
      }
    }
  }

  struct Pending final : Request {
    Pending(MpiCommunicator& c, const char* what) : comm(c), operation(what) {}
    void wait() override { comm.wait(pieces, operation); }
    MpiCommunicator& comm;
    const char* operation;
    Pieces pieces;
  };

  // A started transfer: one part (send or recv) or two (exchange).
  struct Transfer final : Request {
    Transfer(MpiCommunicator& c, std::string what) : comm(c), operation(std::move(what)) {}
    void wait() override { comm.wait_transfer(parts, operation); }
    MpiCommunicator& comm;
    std::string operation;
    std::vector<TransferPart> parts;
  };

  double timeout_s_;
  std::int64_t seq_ = 0;                       // collectives entered by this rank
  std::int64_t sent_ = 0;                      // ranks > 0: heartbeats sent
  std::deque<Heartbeat> sends_;                // ranks > 0: heartbeats in flight (deque: stable addresses)
  std::vector<std::int64_t> arrived_;          // rank 0: the last collective each rank entered
  std::vector<std::int64_t> received_;         // rank 0: heartbeats taken from each rank
  std::vector<Clock::time_point> last_heard_;  // rank 0: when each rank last sent one
  // Patience (dist/file_work.h): rank 0's grants sent (to each other rank alike) and in flight;
  // the others' grants taken and when the last came; when rank 0 last granted, or keep_alive last beat.
  std::int64_t grants_sent_ = 0, grants_taken_ = 0;
  std::deque<MPI_Request> grant_sends_;
  Clock::time_point last_grant_{}, last_keep_alive_{};
  MPI_Comm comm_ = MPI_COMM_NULL;
  std::vector<int> job_ranks_;  // MPI_COMM_WORLD rank of each member
  bool owns_mpi_ = false;
  bool owns_comm_ = false;
  int rank_ = 0;
  int world_ = 1;
  int local_rank_ = 0;
  int local_size_ = 1;  // ranks of this group on this node
};

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator(double timeout_s) {
  return std::make_unique<MpiCommunicator>(timeout_s);
}

}  // namespace llmtrain::dist
