#!/usr/bin/env bash
# scripts/launch/slurm.sbatch under a real single-node Slurm (Debian's slurm-wlm and munge): the
# test starts munged, slurmctld and slurmd with a config in a temporary folder, submits the
# sbatch command of docs/clusters.md (2 CPU ranks, extra arguments passed to `llmtrain train`;
# the test first checks that the page still shows it), and then:
#  1. USR1 to the batch shell (what --signal=B:USR1@120 sends before the time limit): the ranks
#     checkpoint, the script exits 75 and requeues the job; the job starts again and resumes.
#  2. TERM to the tasks (`scancel --signal=TERM`, a preemption): the same.
#  3. metrics.jsonl holds every step exactly once over the three runs: nothing lost or repeated.
#  4. TERM to the batch shell and srun as well (`scancel --signal=TERM --full`): srun turns a TERM
#     of its own into SIGKILL for the tasks, so the checkpoint of this stop may not be written;
#     the script still requeues, and the run resumes from the newest checkpoint it has.
#  5. A rank lost (SIGSTOP to task 1): rank 0 stops after dist.timeout_s with exit 76, naming it;
#     the script requeues the job, and the run resumes from the newest checkpoint.
# The daemons run as root (SlurmdUser=root, no cgroups); a requeued job waits AuthInfo's
# cred_expire (120 s by default, 5 s here) before it starts again.
# SKIPPED (exit 77) where the Slurm or munge daemons are not installed, or without root.
# Usage: slurm_test.sh LLMTRAIN SOURCE_DIR
set -uo pipefail
llmtrain=$(realpath "$1")
source_dir=$(realpath "$2")
# The command documented in docs/clusters.md ("Where and how", Slurm with CPU ranks) is the one
# submitted below: if the page changes it, this test must change with it.
documented='sbatch --nodes=1 --ntasks-per-node=2 scripts/launch/slurm.sbatch'
grep -qF "\`$documented C " "$source_dir/docs/clusters.md" ||
  { echo "FAILED: docs/clusters.md no longer shows '$documented C RUN_DIR ...', the command this test submits"; exit 1; }
skip() { echo "SKIPPED: $* (scripts/setup.sh installs slurm-wlm and munge)"; exit 77; }
for tool in munged slurmctld slurmd sbatch squeue scontrol scancel; do
  command -v "$tool" >/dev/null || skip "no $tool on PATH"
done
[[ "$(id -u)" -eq 0 ]] || skip "the test's Slurm daemons run as root"

work=$(mktemp -d)
job=""
# Every process of this test's Slurm, found by the SLURM_CONF in its environment: the daemons and
# the job's slurmstepd, and the batch script, srun and the tasks (which have a SLURM_JOB_ID too).
ours() {
  local file dir
  for file in $(grep -lzx "SLURM_CONF=$work/slurm.conf" /proc/[0-9]*/environ 2>/dev/null); do
    dir=${file%/environ}
    if [[ "$(cat "$dir/comm" 2>/dev/null)" =~ ^slurm(d|ctld|stepd)$ ]] || grep -qz "^SLURM_JOB_ID=" "$file" 2>/dev/null; then
      echo "${dir#/proc/}"
    fi
  done
}
stop_daemons() {
  local name pid
  if [[ -n "$job" ]]; then
    scancel "$job" 2>/dev/null
    for _ in $(seq 1 50); do [[ -z "$(squeue -h -j "$job" -t R,CG 2>/dev/null)" ]] && break; sleep 0.2; done
  fi
  for name in slurmd slurmctld; do
    pid=$(cat "$work/$name.pid" 2>/dev/null) && kill -TERM "$pid" 2>/dev/null
  done
  for _ in $(seq 1 30); do [[ -z "$(ours)" ]] && break; sleep 0.2; done
  for pid in $(ours); do kill -KILL "$pid" 2>/dev/null; done
  pid=$(cat "$work/munged.pid" 2>/dev/null) && kill -TERM "$pid" 2>/dev/null
  for _ in $(seq 1 20); do [[ -S "$work/munge.sock" ]] || break; sleep 0.1; done
}
cleanup() { stop_daemons; rm -rf "$work" 2>/dev/null || { sleep 1; rm -rf "$work"; }; }
trap cleanup EXIT
trap 'exit 1' INT TERM HUP
passed=0
pass() { echo "ok: $*"; passed=$((passed + 1)); }
fail() {
  echo "FAILED: $*"
  for f in "$work"/job-*.out "$work"/log/slurmctld.log "$work"/log/slurmd.log; do
    [[ -f "$f" ]] && { echo "--- $(basename "$f") (last lines)"; grep -v ' | loss ' "$f" | tail -n 15; }
  done
  echo "$passed passed, 1 failed"
  exit 1
}

# The daemons, every file of theirs in $work; ports picked at random to stay clear of a real Slurm.
mkdir -p "$work"/{state,spool,log,tmp}
host=$(hostname -s)
head -c 1024 /dev/urandom > "$work/munge.key" && chmod 400 "$work/munge.key"
munged --force --key-file="$work/munge.key" --socket="$work/munge.sock" --pid-file="$work/munged.pid" \
  --log-file="$work/log/munged.log" --seed-file="$work/munged.seed" || fail "munged did not start"
port=$((20000 + RANDOM % 20000))
cpus=$(getconf _NPROCESSORS_ONLN)  # not nproc, which follows OMP_NUM_THREADS
(( cpus >= 2 )) || cpus=2
cat > "$work/slurm.conf" <<CONF
ClusterName=llmtraintest
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$port
SlurmdPort=$((port + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: how long a requeued job waits before it starts again (default 120 s).
AuthInfo=socket=$work/munge.sock,cred_expire=5
SchedulerParameters=sched_interval=1
StateSaveLocation=$work/state
SlurmdSpoolDir=$work/spool
TmpFS=$work/tmp
SlurmctldPidFile=$work/slurmctld.pid
SlurmdPidFile=$work/slurmd.pid
SlurmctldLogFile=$work/log/slurmctld.log
SlurmdLogFile=$work/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=pmix
ReturnToService=2
KillWait=10
MinJobAge=600
# At least 2 CPUs, whatever the hardware has (config_overrides): the job runs 2 ranks.
SlurmdParameters=config_overrides
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=test Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
export SLURM_CONF="$work/slurm.conf"
slurmctld -i || fail "slurmctld did not start"
slurmd || fail "slurmd did not start"
for _ in $(seq 1 100); do [[ "$(sinfo -h -o %T 2>/dev/null)" == idle ]] && break; sleep 0.2; done
[[ "$(sinfo -h -o %T 2>/dev/null)" == idle ]] || fail "the node did not come up: $(sinfo 2>&1)"
srun --mpi=list 2>&1 | grep -qw pmix || skip "Slurm has no pmix plugin (srun --mpi=list)"
echo "slurm $(sinfo --version | awk '{print $2}'): node $host with $cpus CPUs, up"

# A tiny model that trains for ever; log_every=1 comes from the command line, through slurm.sbatch
# (--device cpu too: 2 ranks cannot share one GPU, which --device auto would pick where one is visible).
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 LLMTRAIN="$llmtrain"
source "$(dirname "${BASH_SOURCE[0]}")/tiny_run.sh"
tiny_run "$work" "$llmtrain" 100000 || fail "tokenize"
run="$work/run"
cd "$work"
# The documented command (above), CPU ranks.
# dist.timeout_s 5: a hung rank (case 5) stops the other within seconds.
job=$(sbatch --parsable --nodes=1 --ntasks-per-node=2 "$source_dir/scripts/launch/slurm.sbatch" \
        "$work/c.json" "$run" --set train.log_every=1 --set dist.timeout_s=5 --device cpu) || fail "sbatch refused the job"
out="$work/llmtrain-$job.out"
ln -s "$out" "$work/job-$job.out"
# Training steps only (checkpoint records carry a step too).
steps() { [[ -f "$run/metrics.jsonl" ]] && grep '"loss":' "$run/metrics.jsonl" | grep -o '"step":[0-9]*' | cut -d: -f2; }
last_step() { steps | tail -n 1; }
field() { scontrol show job "$job" | grep -oE "(^| )$1=[^ ]*" | head -n 1 | cut -d= -f2; }

# logged PATTERN: waits (up to 20 s) until the job's output holds a line matching PATTERN; srun
# forwards the ranks' output later than metrics.jsonl is written, so a single look can miss it.
logged() {
  local start=$SECONDS
  while (( SECONDS - start < 20 )); do
    grep -q "$1" "$out" && return 0
    sleep 0.2
  done
  return 1
}

# running_past STEP: waits until the job runs (again) and has logged 20 steps past STEP.
running_past() {
  local start=$SECONDS
  while (( SECONDS - start < 60 )); do
    [[ "$(field JobState)" == RUNNING ]] && (( $(last_step || echo 0) > $1 + 20 )) && return 0
    [[ "$(field JobState)" =~ ^(FAILED|COMPLETED|CANCELLED|TIMEOUT)$ ]] && break
    sleep 0.2
  done
  fail "the job did not run past step $1 within 60 s (state $(field JobState), reason $(field Reason))"
}
# stopped_and_requeued RESTARTS WHAT: waits for the job to be requeued for the RESTARTS'th time.
stopped_and_requeued() {
  local start=$SECONDS
  while (( SECONDS - start < 60 )); do
    (( $(field Restarts) >= $1 )) && return 0
    [[ "$(field JobState)" =~ ^(FAILED|COMPLETED|CANCELLED|TIMEOUT)$ ]] && break
    sleep 0.2
  done
  fail "$2: the job was not requeued (state $(field JobState), exit code $(field ExitCode))"
}

running_past 0
# The arguments after the run folder reached llmtrain train: --set train.log_every=1 logs every step.
[[ "$(steps | head -n 20 | tr '\n' ' ')" == "$(seq 1 20 | tr '\n' ' ')" ]] || fail "train.log_every=1 from sbatch's command line did not reach llmtrain"
# 1. USR1 to the batch shell, as --signal=B:USR1@120 sends it.
at=$(last_step)
scancel --signal=USR1 --batch "$job"
stopped_and_requeued 1 "USR1 to the batch shell"
grep -q "srun: error: .*tasks 0-1: Exited with exit code 75" "$out" || fail "USR1: the ranks did not exit 75"
grep -q "exit 75): requeueing job $job" "$out" || fail "USR1: the script did not requeue after exit 75"
first=$(last_step)
pass "USR1 to the batch shell at step $at: 2 ranks checkpointed step_$(printf %08d "$first") and exited 75; job $job requeued"
t0=$SECONDS
running_past "$first"
logged "resuming from .*step_$(printf %08d "$first") (step $first)" || fail "run 2 did not resume from step $first"
pass "run 2 started $((SECONDS - t0)) s after the requeue (with the logging of 20 steps) and resumed from step $first"

# 2. TERM to the tasks, as a preemption sends it.
scancel --signal=TERM "$job"
stopped_and_requeued 2 "TERM to the tasks"
(( $(grep -c "tasks 0-1: Exited with exit code 75" "$out") == 2 )) || fail "TERM: the ranks did not exit 75"
second=$(last_step)
pass "TERM to the tasks: exit 75 at step $second, requeued"
running_past "$second"
logged "resuming from .*step_$(printf %08d "$second") (step $second)" || fail "run 3 did not resume from step $second"

# 3. Every step once, in order, over the three runs.
[[ "$(steps | head -n "$second" | tr '\n' ' ')" == "$(seq 1 "$second" | tr '\n' ' ')" ]] \
  || fail "metrics.jsonl steps 1..$second are not each there once: repeated $(steps | sort -n | uniq -d | head -n 3 | tr '\n' ' ')"
(( $(steps | sed -n "$((second + 1))p") == second + 1 )) || fail "run 3 did not continue at step $((second + 1))"
pass "metrics.jsonl: steps 1..$second each logged once, run 3 continued at step $((second + 1))"

# 4. TERM to everything: srun kills the tasks (whether their checkpoint was finished first is a
#    race); the script requeues all the same, and the run resumes from the newest checkpoint.
scancel --signal=TERM --full "$job"
stopped_and_requeued 3 "TERM --full"
(( $(grep -c "requeueing job $job" "$out") == 3 )) || fail "TERM --full: the script did not requeue"
# The newest checkpoint is known only once run 3's ranks are gone: the requeue can come while
# they still finish a checkpoint and name it in `latest`. Run 4 starts after they have ended and
# writes no checkpoint of its own (no periodic ones), so `latest` is read once it has started.
for _ in $(seq 1 300); do (( $(grep -c "resuming from" "$out") >= 3 )) && break; sleep 0.2; done  # run 4's line
newest=$(cat "$run/checkpoints/latest")
newest_step=$((10#${newest#step_}))
(( newest_step >= second )) || fail "TERM --full: latest checkpoint $newest is older than step $second"
grep "resuming from" "$out" | tail -n 1 | grep -q "$newest (step $newest_step)" || fail "run 4 did not resume from $newest"
running_past "$newest_step"
# One reading of the file, which run 4 is still writing (its last line may be half there: dropped).
seen=$(steps | head -n -1)
total=$(tail -n 1 <<<"$seen")
[[ "$(tr '\n' ' ' <<<"$seen")" == "$(seq 1 "$total" | tr '\n' ' ')" ]] \
  || fail "metrics.jsonl steps 1..$total are not each there once: repeated $(sort -n <<<"$seen" | uniq -d | head -n 3 | tr '\n' ' ')"
pass "TERM to the batch shell and srun (--full): $(grep -o 'status [0-9]* after a stop\|exit 75' "$out" | tail -n 1), requeued, resumed from $newest; steps 1..$total each logged once"

# 5. A rank lost (stopped, as a node cut off leaves it): the other stops after dist.timeout_s with
#    exit 76 naming it, the script requeues the job, and the run resumes from the newest checkpoint.
task_pid() {  # the pid of the llmtrain task whose SLURM_PROCID is $1
  local pid
  for pid in $(pgrep -f "llmtrain train --config $work/c.json --run-dir $run"); do
    tr '\0' '\n' < "/proc/$pid/environ" 2>/dev/null | grep -qx "SLURM_PROCID=$1" && { echo "$pid"; return; }
  done
}
hung=$(task_pid 1)
[[ -n "$hung" ]] || fail "a lost rank: task 1 of run 4 not found"
kill -STOP "$hung"
stopped_and_requeued 4 "a lost rank"
kill -KILL "$hung" 2>/dev/null
logged "rank 0: .* did not finish within dist.timeout_s = 5 s: rank(s) 1 never arrived" \
  || fail "a lost rank: rank 0 did not name rank 1: $(grep -m 3 'llmtrain: error' "$out")"
grep -q "exit 76): requeueing job $job" "$out" || fail "a lost rank: the script did not requeue after exit 76"
for _ in $(seq 1 300); do (( $(grep -c "resuming from" "$out") >= 4 )) && break; sleep 0.2; done  # run 5's line
grep "resuming from" "$out" | tail -n 1 | grep -q "$newest (step $newest_step)" || fail "run 5 did not resume from $newest"
pass "a lost rank: rank 0 stopped with exit 76 naming rank 1, job $job requeued, run 5 resumed from $newest"
scancel "$job"
echo "$passed passed, 0 failed"
