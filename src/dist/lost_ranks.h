// Naming the ranks of an MPI job that were lost (dead, hung or cut off), for the one line each
// surviving rank prints before the job stops with exit status 76. Rank 0 of a group knows from
// the heartbeats (dist/mpi_communicator.cpp) which of its ranks went silent; the rank that finds
// names tells every rank (a verdict). When no rank has names (rank 0 is the one lost), the
// survivors call a roll: each tells every job rank it is alive, and the lowest rank heard alive
// names the ranks that never answered, and tells the others. Process-wide state: every MPI
// communicator of the process (world and its groups) shares it, since any of them may take
// a message meant for another.
#pragma once

#include <mpi.h>

#include <functional>
#include <string>
#include <vector>

namespace llmtrain::dist::lost_ranks {

/// The exit status of a job stopped because ranks stopped answering (ExitCode::ranks_lost):
/// relaunching on the hosts that answer resumes it.
int exit_status();

/// Each job rank's host (MPI_Get_processor_name), gathered once on `world` (MPI_COMM_WORLD).
void gather_hosts(MPI_Comm world);

/// Takes the verdicts that have arrived from other ranks; whether there were any.
bool take_verdicts();
/// The job rank whose verdict came first ("" when none came).
const std::string& verdict_from();

/// Answers the roll calls that have arrived (a rank that stopped asks who is alive); called
/// while waiting in any collective, so that live ranks answer at once.
void answer_roll_calls();

/// Of `candidates` (job ranks silent on one group), those that do not answer a roll call within
/// `wait_s`: a rank silent on one group may be alive, waiting in another group's collective
/// (heartbeats go to each group's rank 0 alone), and answers. Returns as soon as all have answered.
std::vector<int> unanswered(const std::vector<int>& candidates, double wait_s);

/// For a rank that stops: `found` (job ranks it found lost itself, perhaps none) is told to every
/// rank; then it waits for the others' verdicts for a moment (up to `wait_for_names_s` when it
/// found none), calling the roll meanwhile when `roll_call`. Returns what its line says of the
/// ranks: "rank(s) 2, 3 never arrived or stopped responding (dead, hung or cut off; host
/// node2)", or, when no rank named any, "rank K names the missing rank(s)" (K: the lowest rank
/// heard alive, which named them), or `fallback`. `place(job)` says where a job rank sits in
/// the mesh (" (tensor rank 1)"), or "".
std::string settle(const std::vector<int>& found, const std::string& fallback, bool roll_call,
                   double wait_for_names_s, const std::function<std::string(int)>& place);

}  // namespace llmtrain::dist::lost_ranks
