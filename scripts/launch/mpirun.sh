#!/usr/bin/env bash
# Launches llmtrain with Open MPI's mpirun: one process per GPU (or per CPU core group), on one
# node or on the nodes of a hostfile.
#
#   scripts/launch/mpirun.sh -n 8 -- train --config configs/gpt2-124m.json
#   scripts/launch/mpirun.sh -n 16 -H hosts.txt -- train --config configs/gpt2-124m.json --run-dir /shared/runs/a
#
# hosts.txt has one line per node, "node01 slots=8". The run folder and data must be on a file
# system every node sees. NCCL_* variables set here are passed to every rank (NCCL_DEBUG=INFO to
# see the topology NCCL chose, NCCL_SOCKET_IFNAME=eth0 to pick the network interface).
#
# Stop signals: SIGTERM or SIGINT (Ctrl-C) to this script become SIGUSR1 to mpirun, which Open
# MPI forwards to every rank: llmtrain finishes its update, writes a checkpoint and exits 75, and
# so does this script; the same command resumes. (mpirun itself turns a SIGTERM or SIGINT into a
# job kill, and forwards only SIGUSR1 and SIGUSR2.) A second TERM or INT kills the job at once.
set -euo pipefail
ranks=1
hostfile=""
while [[ $# -gt 0 && "$1" != "--" ]]; do
  case "$1" in
    -n) ranks="$2"; shift 2 ;;
    -H) hostfile="$2"; shift 2 ;;
    *) echo "usage: $0 -n RANKS [-H HOSTFILE] -- LLMTRAIN-ARGS..." >&2; exit 2 ;;
  esac
done
[[ "${1:-}" == "--" ]] && shift
llmtrain="${LLMTRAIN:-$(command -v llmtrain || echo build/src/llmtrain)}"

args=(-np "$ranks" --bind-to none)
[[ -n "$hostfile" ]] && args+=(--hostfile "$hostfile")
[[ "$(id -u)" -eq 0 ]] && args+=(--allow-run-as-root)
# Pass the environment that matters to every rank.
for name in $(compgen -e | grep -E '^(NCCL_|CUDA_|OMP_NUM_THREADS$|OMP_WAIT_POLICY$|GOMP_SPINCOUNT$|OPENBLAS_NUM_THREADS$|LD_LIBRARY_PATH$)' || true); do
  args+=(-x "$name")
done

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
set -m
mpirun "${args[@]}" "$llmtrain" "$@" &
mpirun_pid=$!
set +m
((stops == 0)) || { stops=0; stop TERM; }
# wait returns early (above 128) when a trapped signal arrives: wait again until mpirun has ended.
status=0
while true; do
  wait "$mpirun_pid" && status=0 || status=$?
  kill -0 "$mpirun_pid" 2>/dev/null || break
done
exit "$status"
