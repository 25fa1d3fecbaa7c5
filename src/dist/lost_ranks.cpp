#include "dist/lost_ranks.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <set>
#include <thread>

#include "core/error.h"

namespace llmtrain::dist::lost_ranks {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int verdict_tag = 7303;  // on MPI_COMM_WORLD: job ranks found lost
constexpr int roll_tag = 7306;     // on MPI_COMM_WORLD: "I am alive" (a roll call, or its answer)
// How long a rank that stops waits for the others' verdicts once it has names, to name every lost rank.
constexpr double verdict_wait_s = 1.0;

std::vector<std::string> job_hosts;  // each job rank's host
std::set<int> lost;                  // job ranks found lost, here or in a verdict
std::string first_verdict_from;
std::set<int> heard_alive;  // job ranks whose roll message came
std::set<int> told_alive;   // job ranks this one sent its roll message to
// Sends that may never complete (to lost ranks): the process ends with them pending.
std::deque<MPI_Request> sends;
std::vector<int> verdict_payload;  // outlives the pending sends
int roll_payload = 0;

int job_rank() {
  int me = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  return me;
}

int job_size() {
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

void send_roll(int to) {
  if (!told_alive.insert(to).second) return;
  sends.push_back(MPI_REQUEST_NULL);
  MPI_Isend(&roll_payload, 0, MPI_INT, to, roll_tag, MPI_COMM_WORLD, &sends.back());
}

// Tells every other job rank, not yet known lost, which ranks were found lost.
void send_verdict(const std::vector<int>& ranks) {
  verdict_payload = ranks;
  const int me = job_rank(), size = job_size();
  for (int r = 0; r < size; ++r) {
    if (r == me || lost.count(r)) continue;
    sends.push_back(MPI_REQUEST_NULL);
    MPI_Isend(verdict_payload.data(), int(verdict_payload.size()), MPI_INT, r, verdict_tag, MPI_COMM_WORLD, &sends.back());
  }
}

// "rank(s) 2 (tensor rank 0), 3 (tensor rank 1) never arrived or stopped responding (dead, hung
// or cut off; host node2)": the ranks found lost.
std::string phrase(const std::function<std::string(int)>& place) {
  std::string ranks, hosts;
  std::set<std::string> seen;
  for (int job : lost) {
    ranks += (ranks.empty() ? "" : ", ") + std::to_string(job) + place(job);
    const std::string host = std::size_t(job) < job_hosts.size() ? job_hosts[std::size_t(job)] : "";
    if (!host.empty() && seen.insert(host).second) hosts += (hosts.empty() ? "" : ", ") + host;
  }
  return "rank(s) " + ranks + " never arrived or stopped responding (dead, hung or cut off; host" +
         (seen.size() > 1 ? "s " : " ") + hosts + ")";
}

void progress_sends() {
  for (MPI_Request& r : sends) {
    int done = 0;
    if (r != MPI_REQUEST_NULL) MPI_Test(&r, &done, MPI_STATUS_IGNORE);
  }
}

}  // namespace

int exit_status() { return static_cast<int>(ExitCode::ranks_lost); }

void gather_hosts(MPI_Comm world) {
  int size = 1;
  MPI_Comm_size(world, &size);
  char name[MPI_MAX_PROCESSOR_NAME] = {};
  int length = 0;
  MPI_Get_processor_name(name, &length);
  std::vector<char> all(std::size_t(size) * MPI_MAX_PROCESSOR_NAME);
  const int status = MPI_Allgather(name, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, all.data(), MPI_MAX_PROCESSOR_NAME, MPI_CHAR, world);
  if (status != MPI_SUCCESS) throw RuntimeError("MPI error in MPI_Allgather (the job's host names)");
  job_hosts.clear();
  for (int r = 0; r < size; ++r) job_hosts.emplace_back(&all[std::size_t(r) * MPI_MAX_PROCESSOR_NAME]);
}

bool take_verdicts() {
  bool any = false;
  for (int flag = 1; flag;) {
    MPI_Status status;
    MPI_Iprobe(MPI_ANY_SOURCE, verdict_tag, MPI_COMM_WORLD, &flag, &status);
    if (!flag) break;
    int count = 0;
    MPI_Get_count(&status, MPI_INT, &count);
    std::vector<int> ranks(std::size_t(std::max(count, 0)));
    MPI_Recv(ranks.data(), count, MPI_INT, status.MPI_SOURCE, verdict_tag, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    for (int job : ranks) lost.insert(job);
    if (first_verdict_from.empty()) first_verdict_from = std::to_string(status.MPI_SOURCE);
    any = true;
  }
  return any;
}

const std::string& verdict_from() { return first_verdict_from; }

void answer_roll_calls() {
  for (int flag = 1; flag;) {
    MPI_Status status;
    MPI_Iprobe(MPI_ANY_SOURCE, roll_tag, MPI_COMM_WORLD, &flag, &status);
    if (!flag) break;
    MPI_Recv(nullptr, 0, MPI_INT, status.MPI_SOURCE, roll_tag, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    heard_alive.insert(status.MPI_SOURCE);
    send_roll(status.MPI_SOURCE);  // the answer (once: a roll message is both call and answer)
  }
}

std::vector<int> unanswered(const std::vector<int>& candidates, double wait_s) {
  for (int job : candidates) send_roll(job);
  std::vector<int> silent = candidates;
  const auto start = Clock::now();
  for (;;) {
    answer_roll_calls();
    progress_sends();
    silent.erase(std::remove_if(silent.begin(), silent.end(), [](int job) { return heard_alive.count(job) > 0; }),
                 silent.end());
    if (silent.empty() || std::chrono::duration<double>(Clock::now() - start).count() >= wait_s) return silent;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

std::string settle(const std::vector<int>& found, const std::string& fallback, bool roll_call,
                   double wait_for_names_s, const std::function<std::string(int)>& place) {
  for (int job : found) lost.insert(job);
  if (!found.empty()) send_verdict(found);
  const int me = job_rank(), size = job_size();
  if (roll_call) {
    for (int r = 0; r < size; ++r) {
      if (r != me && !lost.count(r)) send_roll(r);
    }
  }
  if (!found.empty() || roll_call || fallback.empty()) {  // (empty: stopped by a verdict; take the others')
    // A rank that found no one itself waits for a verdict up to `wait_for_names_s` (the rank that
    // has the names may have entered the collective later), then a second for the others'.
    const double wait_s = lost.empty() ? std::max(verdict_wait_s, wait_for_names_s) : verdict_wait_s;
    const auto start = Clock::now();
    for (double waited = 0; waited < wait_s; waited = std::chrono::duration<double>(Clock::now() - start).count()) {
      if (!lost.empty() && waited >= verdict_wait_s) break;
      take_verdicts();
      answer_roll_calls();
      progress_sends();
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  if (!lost.empty()) return phrase(place);
  if (!first_verdict_from.empty()) return "rank " + first_verdict_from + " found ranks lost";
  if (!roll_call) return fallback;
  // No rank named any: the ranks that never answered the roll are the lost ones, named by the
  // lowest rank heard alive (the others say who that is).
  int lowest = me;
  std::vector<int> silent;
  for (int r = 0; r < size; ++r) {
    if (r == me || heard_alive.count(r)) {
      lowest = std::min(lowest, r);
    } else {
      silent.push_back(r);
    }
  }
  if (silent.empty()) return fallback;
  if (lowest != me) return "rank " + std::to_string(lowest) + " names the missing rank(s)";
  for (int job : silent) lost.insert(job);
  send_verdict(silent);
  progress_sends();
  return phrase(place);
}

}  // namespace llmtrain::dist::lost_ranks
