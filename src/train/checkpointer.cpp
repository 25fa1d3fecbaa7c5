#include "train/checkpointer.h"

#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <condition_variable>
#include <fstream>
#include <mutex>
#include <thread>
#include <vector>

#include "dist/file_work.h"
#include "ops/buffer.h"
#include "checkpoint/data_record.h"
#include "train/resume.h"

namespace llmtrain::train {
namespace {

using Clock = std::chrono::steady_clock;

// What this rank writes of a checkpoint: ranges of the whole model's flat buffer, taken from
// these places of its local arrays (master weights and optimizer state alike), and whether it
// writes at all.
struct RankPart {
  std::vector<checkpoint::FlatRange> ranges;
  std::vector<parallel::Placed> placed;
  std::int64_t size = 0;
  bool written = false;
};

RankPart rank_part(const CheckpointSource& source, int world_rank) {
  RankPart part;
  // Runs that continue each other both in the whole model and in the local arrays are one.
  for (const parallel::Placed& p : source.optimizer_placement()) {
    parallel::Placed* last = part.placed.empty() ? nullptr : &part.placed.back();
    if (last && last->logical.end == p.logical.begin && last->local + last->logical.size() == p.local) {
      last->logical.end = p.logical.end;
    } else {
      part.placed.push_back(p);
    }
  }
  for (const parallel::Placed& p : part.placed) {
    part.ranges.push_back(p.logical);
    part.size += p.logical.end - p.logical.begin;
  }
  // Every rank holds the whole state (ZeRO 0 without tensor parallelism): rank 0 alone writes it.
  const bool whole = part.ranges.size() == 1 && part.ranges[0].begin == 0 && part.ranges[0].end == source.num_params();
  part.written = source.writes_optimizer() && (world_rank == 0 || !whole);
  return part;
}

std::vector<float> host_vector(const Tensor& t) {
  std::vector<float> out(std::size_t(t.numel()));
  ops::copy(Tensor(out.data(), DType::f32, Device::cpu, {t.numel()}), t);
  return out;
}

// f32 arrays a rank writes per parameter element: the weights and each optimizer state tensor.
std::int64_t arrays_written(const CheckpointSource& source) {
  return 1 + std::int64_t(source.optimizer().state().size());
}

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// dst = src (src on the GPU): into the pinned staging buffer; zeros for a src without data.
void stage(float* dst, const Tensor& src) {
  if (!src.data) return static_cast<void>(std::fill(dst, dst + src.numel(), 0.0f));
  ops::copy(Tensor(dst, DType::f32, Device::cpu, {src.numel()}), src);
}

// How many ranks share this node, as the MPI launcher says (else, to be safe, all of them).
int ranks_on_this_node(int world_size) {
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"}) {
    if (const char* value = std::getenv(name)) {
      const int n = std::atoi(value);
      if (n > 0) return std::min(n, world_size);
    }
  }
  return world_size;
}

// MemAvailable of /proc/meminfo in bytes; -1 where it cannot be read.
std::int64_t memory_available() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  std::int64_t kb = 0;
  std::string unit;
  while (meminfo >> key >> kb) {
    std::getline(meminfo, unit);
    if (key == "MemAvailable:") return kb * 1024;
  }
  return -1;
}

// How much less a background writer's threads weigh with the scheduler than training's: nice 10
// gives them about a tenth of a core that training also wants, all of one it leaves idle.
constexpr int writer_niceness = 10;

// Test hook (tests/dist_file_work_test.sh): LLMTRAIN_TEST_SLOW_SAVE_S adds that many seconds to
// this rank's file work of every save.
void slow_save_for_test() {
  const double seconds = dist::test_delay_s("LLMTRAIN_TEST_SLOW_SAVE_S");
  if (seconds > 0) std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
}

// Lowers the calling thread's scheduling priority (Linux: per thread, inherited by the threads
// it starts) by `writer_niceness`; best effort.
void writer_priority() {
  errno = 0;
  const int now = ::getpriority(PRIO_PROCESS, 0);
  if (errno == 0) ::setpriority(PRIO_PROCESS, 0, std::min(now + writer_niceness, 19));
}

}  // namespace

// The save being written in the background: what it writes and the thread writing it. On the
// CPU that thread also makes the staging copy, while the next update's forward and backward
// passes (which only read the weights) run; the update waits for `copied` before it changes them.
struct Checkpointer::Pending {
  checkpoint::SaveRequest request;
  std::string dir;
  double stall_s = 0.0, waited_s = 0.0, copy_s = 0.0;
  std::thread writer;
  std::atomic<bool> done{false};
  checkpoint::WrittenPart part;
  std::mutex mutex;
  std::condition_variable copy_done;
  bool copied = true;
};

Checkpointer::Checkpointer(const TrainOptions& options, dist::Communicator& world, Reporter& reporter,
                           CheckpointSource& source)
    : config_(options.config),
      root_(checkpoint_root(options)),
      world_(world),
      reporter_(reporter),
      resolved_(config::to_json(options.config)),
      data_(checkpoint::data_record(options.config.data.train)),
      signals_(std::make_unique<StopSignals>()) {
  // File work: the commit after a save waits for a slow writer that is alive (every rank knows the
  // whole checkpoint's f32 weights and optimizer state: at most what any rank writes).
  file_work_limit_s_ = dist::file_work_limit_s(config_.dist.timeout_s,
                                               4.0 * double(arrays_written(source)) * double(source.num_params()));
  if (!config_.checkpoint.async) return;
  // This rank's staging: the weights and optimizer state of the ranges it writes (none where
  // another rank writes the same state).
  const RankPart part = rank_part(source, world_.rank());
  stages_ = part.written;
  const std::int64_t floats = stages_ ? arrays_written(source) * part.size : 0;
  const std::int64_t bytes = floats * std::int64_t(sizeof(float));
  // Memory allows when the staging buffers of the ranks on this node take at most half of what is
  // available (the ranks of a node hold about equal parts: this rank's times their number).
  const std::int64_t available = memory_available();
  std::int64_t need = bytes;
  world_.all_reduce_max(&need, 1);
  const int local_ranks = ranks_on_this_node(world_.world_size());
  const std::int64_t node_need = need * local_ranks;
  // Every rank decides alike (saves are collectives): synchronously if any rank lacks the memory.
  std::int64_t sync = available >= 0 && node_need > available / 2 ? 1 : 0;
  world_.all_reduce_max(&sync, 1);
  if (sync) {
    reporter_.info("checkpoint: saving synchronously, not in the background: %d rank(s) on this node would need "
                   "up to %.2f GB of host staging buffers, more than half of the memory available (%.2f GB)",
                   local_ranks, double(node_need) / 1e9, double(available) / 1e9);
    return;
  }
  async_ = true;
  staging_ = ops::Buffer::host_staging(std::size_t(bytes));
  source_ = &source;
  source.set_before_update([this] { wait_for_copy(); });
  reporter_.info("checkpoint: saving in the background from a %.1f MB host staging buffer%s",
                 double(bytes) / 1e6, staging_.pinned() ? " (pinned)" : "");
}

Checkpointer::~Checkpointer() {
  if (source_) source_->set_before_update({});
  if (pruner_.joinable()) pruner_.join();
  if (pending_) {
    // Leaving on an error: the files are finished (or their writer abandoned); only alone, and
    // only once they are finished, may we mark them complete.
    const std::shared_ptr<Pending> p = pending_;
    if (!settle(*p)) {
      pending_.reset();
      reporter_.info("checkpoint %s: left incomplete: an error stopped the run and its writer did not finish "
                     "within %.0f s", p->dir.c_str(), file_work_limit_s_);
    } else if (world_.world_size() == 1) {
      try {
        finish("an error stopped the run");
      } catch (const std::exception& e) {
        reporter_.info("checkpoint %s: not completed: %s", p->dir.c_str(), e.what());
      }
    } else {
      reporter_.info("checkpoint %s: files written, but left incomplete: an error stopped the run, so the "
                     "ranks cannot agree that all of theirs are", p->dir.c_str());
    }
  }
  // A commit above may have started the pruner again.
  if (pruner_.joinable()) pruner_.join();
  // An abandoned writer may still read the staging buffer: it is left to the process's end.
  if (abandoned_) new ops::Buffer(std::move(staging_));  // NOLINT: deliberately never freed
}

// On an error path: waits for `p`'s writer to finish, up to the commit's patience, and joins it;
// a writer that does not finish in time (a stalled file system) is detached, still holding its
// share of `p`, so that no joinable thread is ever destroyed. Whether the writer finished.
bool Checkpointer::settle(Pending& p) noexcept {
  if (!p.writer.joinable()) return p.done.load();
  const auto start = Clock::now();
  while (!p.done.load() && seconds_since(start) < file_work_limit_s_) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (!p.done.load()) {
    p.writer.detach();
    abandoned_ = true;
    return false;
  }
  p.writer.join();
  return true;
}

bool Checkpointer::stop_requested() {
  // One reduction for both questions: a stop signal anywhere, and a background writer still busy.
  std::int64_t flags[2] = {signals_->raised() ? 1 : 0, pending_ && !pending_->done.load() ? 1 : 0};
  world_.all_reduce_max(flags, 2);
  if (pending_ && flags[1] == 0) finish(nullptr);
  return flags[0] != 0;
}

bool Checkpointer::due(std::int64_t step) const {
  return config_.checkpoint.every > 0 && step % config_.checkpoint.every == 0;
}

void Checkpointer::wait_for_copy() {
  if (!pending_) return;
  std::unique_lock lock(pending_->mutex);
  if (pending_->copied) return;
  const auto start = Clock::now();
  pending_->copy_done.wait(lock, [&] { return pending_->copied; });
  pending_->stall_s += seconds_since(start);
}

// Rank 0 deletes the checkpoints a commit set aside on a thread of its own (gigabytes take a
// while to delete, and training need not wait), one deletion at a time.
void Checkpointer::remove_pruned() {
  if (world_.rank() != 0) return;
  if (pruner_.joinable()) pruner_.join();
  pruner_ = std::thread([root = root_] {
    writer_priority();
    checkpoint::remove_pruned(root);
  });
}

void Checkpointer::flush() {
  if (pending_) finish("the end of training");
}

// Waits for this rank's writer, then commits with every rank (a collective) and reports.
void Checkpointer::finish(const char* why) {
  const std::shared_ptr<Pending> p = std::move(pending_);
  const auto wait_start = Clock::now();
  // File work (dist/file_work.h): this rank says it is alive while its writer runs, and the
  // commit waits, under patience, for ranks whose writers are slower. An error here (ranks lost)
  // leaves the checkpoint incomplete, its writer settled first.
  try {
    dist::wait_keeping_alive(world_, [&] { return p->done.load(); });
  } catch (...) {
    settle(*p);
    throw;
  }
  if (p->writer.joinable()) p->writer.join();
  const double waited = seconds_since(wait_start);
  if (why && waited >= 0.001) {
    reporter_.info("checkpoint %s: %s waited %.3f s for its background write", p->dir.c_str(), why, waited);
  }
  checkpoint::Committed done;
  {
    const dist::Patience patience(world_, file_work_limit_s_);
    done = checkpoint::commit(p->request, p->part, world_);
  }
  remove_pruned();
  reporter_.checkpoint_saved(p->request.step, done, {p->stall_s, p->waited_s, p->copy_s, true});
}

std::string Checkpointer::save(std::int64_t step, CheckpointSource& source) {
  const data::SamplerState sampler = source.sampler_state();
  nlohmann::json state = {{"tokens_seen", source.tokens_seen()},
                          {"sampler", {{"epoch", sampler.epoch}, {"next_sample", sampler.next_sample}}},
                          {"world_size", world_.world_size()},
                          {"zero_stage", config_.dist.zero_stage},
                          {"config", resolved_},
                          {"data", data_}};
  const auto save_start = Clock::now();
  const std::vector<optim::StateTensor> optimizer = source.optimizer().state();
  checkpoint::SaveRequest request;
  request.root = root_;
  request.step = step;
  request.keep_last = config_.checkpoint.keep_last;
  request.state = std::move(state);
  request.model = &source.logical_model();  // names and shapes of the whole tensors
  const bool on_cpu = source.device() == Device::cpu;
  // Each rank writes the ranges it owns, from its own arrays: no rank gathers the model.
  const RankPart part = rank_part(source, world_.rank());
  request.writes = part.written;
  const Tensor master = source.master();
  if (!async_) {
    // On the CPU the state is written from where it lives; from a GPU through a copy; the parts
    // another rank writes (tensor parallelism) left out.
    std::vector<float> w;
    std::vector<std::vector<float>> states(optimizer.size());
    request.part.ranges = part.ranges;
    request.part.weights = master.as<float>();
    for (const optim::StateTensor& tensor : optimizer) {
      const bool partial = tensor.layout == optim::StateLayout::held_runs;
      request.part.optimizer.push_back({tensor.name, tensor.tensor.as<float>(), partial, tensor.held});
    }
    if (part.written && !on_cpu) {
      w = host_vector(master);
      request.part.weights = w.data();
      for (std::size_t k = 0; k < optimizer.size(); ++k) {
        states[k] = host_vector(optimizer[k].tensor);
        request.part.optimizer[k].data = states[k].data();
      }
    }
    // Written from the places the ranges hold in the local arrays: no compacting copy.
    for (const parallel::Placed& p : part.placed) request.part.at.push_back(p.local);
    const std::string dir = checkpoint::prepare_dir(root_, step, world_);
    // File work (dist/file_work.h): written on a thread of its own while this one says the rank is
    // alive; the commit waits, under patience, for ranks that write longer.
    checkpoint::WrittenPart written;
    dist::run_keeping_alive(world_, [&] {
      slow_save_for_test();
      written = checkpoint::write_part(request, dir, world_.rank(), world_.world_size());
    });
    checkpoint::Committed done;
    {
      const dist::Patience patience(world_, file_work_limit_s_);
      done = checkpoint::commit(request, written, world_);
    }
    remove_pruned();
    const double stall = seconds_since(save_start);
    reporter_.checkpoint_saved(step, done, {stall, 0.0, 0.0, false});
    return done.dir;
  }

  // A save still being written: this one waits for it (its commit is a collective, on every rank).
  double waited = 0.0;
  if (pending_) {
    const std::int64_t previous = pending_->request.step;
    const auto wait_start = Clock::now();
    finish(nullptr);
    waited = seconds_since(wait_start);
    reporter_.info("checkpoint: the save of step %lld waited %.3f s for step %lld's to finish writing",
                   static_cast<long long>(step), waited, static_cast<long long>(previous));
  }
  auto p = std::make_shared<Pending>();
  p->dir = checkpoint::prepare_dir(root_, step, world_);
  // The staging buffer holds the weights and each optimizer state tensor of the ranges this rank
  // writes, each end to end.
  float* next = static_cast<float*>(staging_.data());
  std::vector<std::pair<float*, Tensor>> copies;  // staging <- what it saves
  const std::int64_t n = part.size;
  request.part.ranges = part.ranges;
  if (stages_) {
    std::int64_t at = 0;
    for (const parallel::Placed& placed : part.placed) {
      const std::int64_t length = placed.logical.end - placed.logical.begin;
      const auto slice = [&](const Tensor& t) { return Tensor(t.as<float>() + placed.local, DType::f32, t.device, {length}); };
      copies.emplace_back(next + at, slice(master));
      for (std::size_t k = 0; k < optimizer.size(); ++k) {
        float* dst = next + std::int64_t(k + 1) * n + at;
        const optim::StateTensor& tensor = optimizer[k];
        if (tensor.layout == optim::StateLayout::like_params) {
          copies.emplace_back(dst, slice(tensor.tensor));
          continue;
        }
        // A tensor holding some runs only: those copied, the rest zero (a copy from no data).
        for (const model::HeldPiece& piece : model::held_pieces(tensor.held, {placed.local, placed.local + length})) {
          const float* from = piece.at < 0 ? nullptr : tensor.tensor.as<float>() + piece.at;
          copies.emplace_back(dst, Tensor(const_cast<float*>(from), DType::f32, tensor.tensor.device, {piece.length}));
          dst += piece.length;
        }
      }
      at += length;
    }
    request.part.weights = next;
    for (std::size_t k = 0; k < optimizer.size(); ++k) {
      request.part.optimizer.push_back({optimizer[k].name, next + std::int64_t(k + 1) * n});
    }
  }
  // From a GPU the copies are made here (at pinned-memory speed); on the CPU by the writer thread.
  if (!on_cpu) {
    const auto copy_start = Clock::now();
    for (const auto& [dst, src] : copies) stage(dst, src);
    p->copy_s += seconds_since(copy_start);
    copies.clear();
  }
  p->copied = !on_cpu;
  p->request = std::move(request);
  p->waited_s = waited;
  p->stall_s = seconds_since(save_start);
  // The writer holds a share of what it writes: a writer abandoned on an error path (settle) never
  // writes into freed memory.
  const int rank = world_.rank(), world_size = world_.world_size();
  p->writer = std::thread([raw = p, rank, world_size, copies = std::move(copies)] {
    const auto copy_start = Clock::now();
    for (const auto& [dst, src] : copies) {
      if (src.data) {
        std::memcpy(dst, src.as<float>(), std::size_t(src.numel()) * sizeof(float));
      } else {
        std::fill(dst, dst + src.numel(), 0.0f);
      }
    }
    if (!copies.empty()) raw->copy_s = seconds_since(copy_start);
    {
      std::lock_guard lock(raw->mutex);
      raw->copied = true;
    }
    raw->copy_done.notify_all();
    // The files are written at a lower priority (this thread and those it starts): where the
    // training threads want every core, they come first, and the writer takes what they leave.
    writer_priority();
    try {
      slow_save_for_test();
      raw->part = checkpoint::write_part(raw->request, raw->dir, rank, world_size);
    } catch (const std::exception& e) {
      raw->part.error = e.what();
    }
    raw->done.store(true);
  });
  pending_ = std::move(p);
  return checkpoint::step_dir(root_, step);  // where commit puts it
}

}  // namespace llmtrain::train
