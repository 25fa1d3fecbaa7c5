#!/usr/bin/env bash
# Launches llmtrain with Open MPI's mpirun: one process per GPU (or per CPU core group), on one
# node or on the nodes of a hostfile.
#
#   scripts/launch/mpirun.sh -n 8 -- train --config configs/gpt2-124m.json
#   scripts/launch/mpirun.sh -n 16 -H hosts.txt -- train --config configs/gpt2-124m.json --run-dir /shared/runs/a
#   scripts/launch/mpirun.sh -n 16 -H hosts.txt --max-restarts 3 --min-nodes 1 -- train --config ...
#
# hosts.txt has one line per node, "node01 slots=8". The run folder and data must be on a file
# system every node sees. NCCL_* variables set here are passed to every rank (NCCL_DEBUG=INFO to
# see the topology NCCL chose, NCCL_SOCKET_IFNAME=eth0 to pick the network interface).
#
# Stop signals: SIGTERM or SIGINT (Ctrl-C) to this script become SIGUSR1 to mpirun, which Open
# MPI forwards to every rank: llmtrain finishes its update, writes a checkpoint and exits 75, and
# so does this script; the same command resumes. (mpirun itself turns a SIGTERM or SIGINT into a
# job kill, and forwards only SIGUSR1 and SIGUSR2.) A second TERM or INT kills the job at once.
#
# Lost nodes: when ranks stop answering (a node died or the network cut it off), llmtrain's
# watchdog stops the surviving ranks within dist.timeout_s, each naming the lost ranks and host.
# mpirun may then wait for a daemon that is gone: this script gives it --grace S seconds (default
# 20) after the first such line, then ends it, and exits 76. Open MPI's own report of a lost
# daemon, or of a connection to another node that closed (Open MPI then stops the ranks itself,
# before the watchdog can, and names the other end's host), ends the same way. With a hostfile,
# mpirun runs with Open MPI's orte_enable_recovery, so that a lost daemon leaves the surviving
# ranks to llmtrain's watchdog instead of killing them.
#
# Elastic relaunch (--max-restarts N, default 0; --min-nodes K, default 1): after a job that ended
# with 76, the hosts of the hostfile that do not answer (ssh, 10 s) are dropped, and the job is
# started again on the others (at least K of them) with as many ranks as their slots hold, rounded
# down to a multiple of the config's dist.tensor_parallel x dist.pipeline_parallel: a smaller
# data-parallel size. The run resumes from its last committed checkpoint (llmtrain's checkpoints
# do not depend on the layout). At most N times; otherwise the exit status is the job's.
set -euo pipefail
usage="usage: $0 -n RANKS [-H HOSTFILE] [--max-restarts N] [--min-nodes K] [--grace S] -- LLMTRAIN-ARGS..."
ranks=1
hostfile=""
max_restarts=0
min_nodes=1
grace="${LLMTRAIN_STOP_GRACE_S:-20}"
while [[ $# -gt 0 && "$1" != "--" ]]; do
  [[ $# -ge 2 ]] || { echo "$usage" >&2; exit 2; }
  case "$1" in
    -n) ranks="$2"; shift 2 ;;
    -H) hostfile="$2"; shift 2 ;;
    --max-restarts) max_restarts="$2"; shift 2 ;;
    --min-nodes) min_nodes="$2"; shift 2 ;;
    --grace) grace="$2"; shift 2 ;;
    *) echo "$usage" >&2; exit 2 ;;
  esac
done
[[ "${1:-}" == "--" ]] && shift
for number in "$ranks" "$max_restarts" "$min_nodes" "$grace"; do
  [[ "$number" =~ ^[0-9]+$ ]] || { echo "$usage" >&2; exit 2; }
done
llmtrain="${LLMTRAIN:-$(command -v llmtrain || echo build/src/llmtrain)}"
readonly lost_status=76  # llmtrain: ranks stopped answering (src/dist/mpi_communicator.cpp)
work=$(mktemp -d "${TMPDIR:-/tmp}/llmtrain-mpirun.XXXXXX")
trap 'rm -rf "$work"' EXIT

# The mpirun arguments for RANKS ranks on HOSTFILE (may be empty).
mpirun_args() {
  args=(-np "$1" --bind-to none)
  # Several nodes: a lost daemon leaves the surviving ranks to llmtrain's watchdog (Open MPI 4).
  [[ -n "$2" ]] && args+=(--hostfile "$2") && export OMPI_MCA_orte_enable_recovery="${OMPI_MCA_orte_enable_recovery:-1}"
  [[ "$(id -u)" -eq 0 ]] && args+=(--allow-run-as-root)
  # Pass the environment that matters to every rank.
  local name
  for name in $(compgen -e | grep -E '^(NCCL_|CUDA_|OMP_NUM_THREADS$|OMP_WAIT_POLICY$|GOMP_SPINCOUNT$|OPENBLAS_NUM_THREADS$|LD_LIBRARY_PATH$)' || true); do
    args+=(-x "$name")
  done
}

# mpirun runs in the background, in a process group of its own (set -m), so that a terminal's
# Ctrl-C reaches this script only, and the trap below decides what the ranks get.
stops=0
mpirun_pid=""
stop() {
  stops=$((stops + 1))
  [[ -n "$mpirun_pid" ]] || return 0  # not started yet: handled just after the start
  if ((stops == 1)); then
    echo "mpirun.sh: SIG$1: asking every rank to checkpoint and stop (SIGUSR1 through mpirun; again to kill)" >&2
    kill -USR1 "$mpirun_pid" 2>/dev/null || true
  else
    echo "mpirun.sh: SIG$1 again: killing the job" >&2
    kill -TERM "$mpirun_pid" 2>/dev/null || true
  fi
}
trap 'stop TERM' TERM
trap 'stop INT' INT

# Runs one job; sets `status`. Its stderr passes through a filter that notes (in $work/lost) the
# first line saying that ranks or a daemon were lost.
run_job() {
  local lost="$work/lost"
  rm -f "$lost" "$work/peers"
  mpirun_args "$@"
  set -m
  mpirun "${args[@]}" "$llmtrain" "${llmtrain_args[@]}" 2> >(
    trap '' INT TERM  # the stop signals are the trap's below; this filter lives until mpirun's stderr closes
    while IFS= read -r line; do
      printf '%s\n' "$line" >&2
      if [[ ! -e "$lost" && ( "$line" == *"did not finish within dist.timeout_s"*"stopping every rank"* ||
            "$line" == *"lost communication with a remote daemon"* || "$line" == *"unable to reliably start one or more daemons"* ||
            "$line" == *"peer process has unexpectedly disconnected"* ) ]]; then
        date +%s >"$lost"
      fi
      # Open MPI's report of a closed connection names the other end: "  Peer host:  node2".
      [[ "$line" =~ ^[[:space:]]*Peer\ host:[[:space:]]*([^[:space:]]+) ]] && echo "${BASH_REMATCH[1]}" >>"$work/peers"
    done) &
  mpirun_pid=$!
  set +m
  ((stops == 0)) || { stops=0; stop TERM; }
  # Waits in steps of a second, so that a job stuck after its ranks stopped is ended `grace` s on.
  local killed_at=0
  while kill -0 "$mpirun_pid" 2>/dev/null; do
    if [[ -s "$lost" ]] && (($(date +%s) - $(<"$lost") > grace)); then
      if ((killed_at == 0)); then
        echo "mpirun.sh: ranks were lost and mpirun is still running ${grace} s later: ending it" >&2
        kill -TERM "$mpirun_pid" 2>/dev/null || true
        killed_at=$(date +%s)
      elif (($(date +%s) - killed_at > 5)); then
        kill -KILL "$mpirun_pid" 2>/dev/null || true
      fi
    fi
    sleep 1 & wait $! 2>/dev/null || true  # a trapped signal interrupts the wait, not the loop
  done
  status=0
  wait "$mpirun_pid" 2>/dev/null || status=$?  # (no shell notice of a job it killed)
  sleep 0.2  # the filter prints the last lines
  if [[ -s "$lost" ]] && ((status != 75)); then
    status=$lost_status
    local peers=""
    [[ -s "$work/peers" ]] && peers=" (connections to $(sort -u "$work/peers" | paste -sd' ') closed)"
    echo "mpirun.sh: the job lost ranks or a node$peers; exit $lost_status" >&2
  fi
  mpirun_pid=""
}

# The hosts of HOSTFILE that answer (this node, or ssh within 10 s), as hostfile lines.
answering_hosts() {
  local line host me
  me=" $(hostname) $(hostname -s 2>/dev/null) $(hostname -I 2>/dev/null) localhost 127.0.0.1 "
  while read -r line; do
    host="${line%%[[:space:]]*}"
    [[ -z "$host" || "$host" == \#* ]] && continue
    if [[ "$me" == *" $host "* ]] ||
       timeout 15 ssh -o BatchMode=yes -o ConnectTimeout=10 "$host" true </dev/null >/dev/null 2>&1; then
      echo "$line"
    else
      echo "mpirun.sh: host $host does not answer: dropped" >&2
    fi
  done <"$1"
}

# dist.tensor_parallel x dist.pipeline_parallel of the run's config (--config and --set of the
# llmtrain arguments), from `llmtrain check-config`.
model_parallel() {
  local check=(check-config) i config
  for ((i = 0; i < ${#llmtrain_args[@]}; ++i)); do
    case "${llmtrain_args[i]}" in
      --config|--set) check+=("${llmtrain_args[i]}" "${llmtrain_args[i + 1]:-}"); i=$((i + 1)) ;;
    esac
  done
  config=$("$llmtrain" "${check[@]}" 2>/dev/null) || { echo 0; return; }
  local tp pp
  tp=$(grep -oE '"tensor_parallel": *[0-9]+' <<<"$config" | grep -oE '[0-9]+$' || echo 1)
  pp=$(grep -oE '"pipeline_parallel": *[0-9]+' <<<"$config" | grep -oE '[0-9]+$' || echo 1)
  echo $((tp * pp))
}

llmtrain_args=("$@")
restarts=0
hosts="$hostfile"
while true; do
  run_job "$ranks" "$hosts"
  ((status == lost_status && restarts < max_restarts)) || exit "$status"
  [[ -n "$hosts" ]] || { echo "mpirun.sh: no hostfile: nothing to relaunch on" >&2; exit "$status"; }
  restarts=$((restarts + 1))
  answering_hosts "$hosts" >"$work/hosts.$restarts"
  nodes=$(grep -c . "$work/hosts.$restarts" || true)
  if ((nodes < min_nodes)); then
    echo "mpirun.sh: $nodes host(s) answer, fewer than --min-nodes $min_nodes: not relaunching" >&2
    exit "$status"
  fi
  slots=0
  while read -r line; do
    n=$(grep -oE 'slots=[0-9]+' <<<"$line" | cut -d= -f2 || true)
    slots=$((slots + ${n:-$((ranks / $(grep -c . "$hosts")))}))
  done <"$work/hosts.$restarts"
  group=$(model_parallel)
  if ((group < 1)); then
    echo "mpirun.sh: cannot read dist.tensor_parallel and dist.pipeline_parallel from the config: not relaunching" >&2
    exit "$status"
  fi
  new_ranks=$(( (slots < ranks ? slots : ranks) / group * group ))
  if ((new_ranks < group)); then
    echo "mpirun.sh: the $slots slot(s) left cannot hold tensor_parallel x pipeline_parallel = $group ranks: not relaunching" >&2
    exit "$status"
  fi
  echo "mpirun.sh: relaunch $restarts of $max_restarts on $nodes host(s) ($(cut -d' ' -f1 "$work/hosts.$restarts" | paste -sd' ')): $new_ranks ranks, data-parallel size $((new_ranks / group))" >&2
  ranks=$new_ranks
  hosts="$work/hosts.$restarts"
done
