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
exec mpirun "${args[@]}" "$llmtrain" "$@"
