// Long file work between collectives (a first save of a large checkpoint, a resume, an import of
// init_from) without the collective that follows it being cut by dist.timeout_s, which is for a
// rank that stopped answering. A rank doing file work keeps telling the others it is alive
// (Communicator::keep_alive, from the thread that makes its collectives), and the collective after
// the file work is made under a Patience scope: it waits past dist.timeout_s, up to a limit, while
// every rank is heard alive. A rank that is dead, hung or cut off is silent, and still stops the
// job about dist.timeout_s after it went silent.
//
// A call site:
//   const double limit = dist::file_work_limit_s(timeout_s, bytes);   // bytes: the most a rank moves
//   dist::run_keeping_alive(world, [&] { part = write_part(...); });    // or keep_alive() per chunk
//   { dist::Patience patience(world, limit); commit(..., world); }      // the collectives after it
#pragma once

#include <cstdint>
#include <functional>

#include "dist/communicator.h"

namespace llmtrain::dist {

/// The slowest rate file work is assumed to keep (bytes a second): a slow network file system
/// shared by many ranks.
inline constexpr double file_work_floor_bytes_per_s = 25e6;

/// How long the collective after file work may wait for a rank that is alive: dist.timeout_s plus
/// `bytes` (the most any rank reads or writes) at file_work_floor_bytes_per_s, and at least 10
/// dist.timeout_s. The bound for a rank that answers but never finishes (a stalled file system).
double file_work_limit_s(double timeout_s, double bytes);

/// Scope: the collectives on `comm` made inside it are patient up to `limit_s`
/// (Communicator::set_patience); the previous patience comes back at its end.
class Patience {
 public:
  Patience(Communicator& comm, double limit_s);
  ~Patience();
  Patience(const Patience&) = delete;
  Patience& operator=(const Patience&) = delete;

 private:
  Communicator& comm_;
  double previous_;
};

/// Calls comm.keep_alive() every 50 ms until `done()` returns true (a background writer finished).
void wait_keeping_alive(Communicator& comm, const std::function<bool()>& done);

/// Runs `work` on a thread of its own while this thread keeps telling the others that this rank is
/// alive; returns when it has finished, rethrowing what it threw. `work` makes no collectives
/// (only this thread may) and, on a GPU, sets its device first if it touches one.
void run_keeping_alive(Communicator& comm, const std::function<void()>& work);

/// Test hook: the seconds of file work to add, from the environment variable `name` (e.g.
/// LLMTRAIN_TEST_SLOW_SAVE_S); 0 when unset or not a number.
double test_delay_s(const char* name);

}  // namespace llmtrain::dist
