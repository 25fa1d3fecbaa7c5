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
# Relaunch (--max-restarts N, default 0; --min-nodes K, default 1): a job that failed (a rank
# killed by a signal, mpirun's 128+N, as by the OOM killer or a segfault; a rank that exited 1;
# ranks lost, 76) is started again, at most N times, unless it was bad input (exit 2: the same
# input would fail again) or a stop (75, passed on as it is, as is any status after a stop signal
# to this script). Each relaunch first says why: the exit status (the signal's name for 128+N) and
# the last line the failing rank logged (RUN_DIR/logs/rank-NNNNN.log). With a hostfile, the hosts
# that do not answer (ssh, 10 s) are dropped, and the job runs on the others (at least K of them);
# without one, on this node again. The relaunch takes as many ranks as the slots left hold (never
# more than before), as whole model replicas of dist.tensor_parallel x dist.context_parallel x
# dist.pipeline_parallel ranks, and keeps train.global_batch_size exact: the data-parallel size
# is the largest that fits and divides global_batch_size / micro_batch_size (gradient
# accumulation makes up the rest) and that llmtrain's own rules accept at that world size
# (`llmtrain plan --world-size`: at least one micro-batch per pipeline stage, say, or a
# data-parallel size that dist.expert_parallel divides). The run
# resumes from its last committed checkpoint (llmtrain's checkpoints do not depend on the
# layout). When no layout fits, one line says why and nothing is relaunched.
#
# Exit status: the last job's (0 done, 2 bad input, 75 stopped after a checkpoint, 76 ranks or a
# node lost, 128+N a rank killed by signal N, 1 another failure), also when it is not relaunched
# (restarts used up, too few hosts, no layout that fits); 2 for a bad option of this script.
set -euo pipefail
usage="usage: $0 -n RANKS [-H HOSTFILE] [--max-restarts N] [--min-nodes K] [--grace S] -- LLMTRAIN-ARGS..."
ranks=1
hostfile=""
max_restarts=0
min_nodes=1
grace="${LLMTRAIN_STOP_GRACE_S:-20}"
while [[ $# -gt 0 && "$1" != "--" ]]; do
  # --help: the comment above, which is this script's manual.
  [[ "$1" == -h || "$1" == --help ]] && { echo "$usage"; sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0; }
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
readonly input_status=2 stop_status=75  # bad input, and a stop after a checkpoint: never relaunched
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
# first line saying that ranks or a daemon were lost, and (in $work/failed) the first rank that
# mpirun says failed.
run_job() {
  local lost="$work/lost"
  rm -f "$lost" "$work/peers" "$work/failed"
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
      # The rank to blame: the first that llmtrain's watchdog names as lost ("rank(s) 2 (tensor rank
      # 0), 3 never arrived or stopped responding"), or the one mpirun names: "process rank 1 with
      # PID 123 on node n2 exited on signal 9 (Killed)", or "Process name: [[4711,1],1]" (job, rank).
      if [[ ! -e "$work/failed" ]]; then
        if [[ "$line" =~ rank\(s\)\ ([0-9]+)[^:]*never\ arrived ]]; then
          echo "${BASH_REMATCH[1]}" >"$work/failed"
        elif [[ "$line" =~ process\ rank\ ([0-9]+)\ with\ PID\ [0-9]+\ on\ node\ ([^[:space:]]+) ]]; then
          echo "${BASH_REMATCH[1]} ${BASH_REMATCH[2]}" >"$work/failed"
        elif [[ "$line" =~ ^[[:space:]]*Process\ name:[[:space:]]*\[\[[0-9]+,[0-9]+\],([0-9]+)\] ]]; then
          echo "${BASH_REMATCH[1]}" >"$work/failed"
        fi
      fi
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

# The run's config as llmtrain resolves it (--config and --set of the llmtrain arguments, by
# `llmtrain check-config`), in $work/config.json; false when it cannot be read.
resolve_config() {
  local check=(check-config) i
  for ((i = 0; i < ${#llmtrain_args[@]}; ++i)); do
    case "${llmtrain_args[i]}" in
      --config|--set) check+=("${llmtrain_args[i]}" "${llmtrain_args[i + 1]:-}"); i=$((i + 1)) ;;
      --config=*|--set=*) check+=("${llmtrain_args[i]}") ;;
    esac
  done
  "$llmtrain" "${check[@]}" >"$work/config.json" 2>"$work/config.err"
}

# The integer value of KEY (a name unique in the resolved config) in $work/config.json, or DEFAULT.
config_value() {
  local value
  value=$(grep -oE "\"$1\": *[0-9]+" "$work/config.json" | head -n 1 | grep -oE '[0-9]+$' || true)
  echo "${value:-$2}"
}

# The run folder of the llmtrain arguments (train's default: runs/<config file's name>).
run_dir() {
  local i dir="" config=""
  for ((i = 0; i < ${#llmtrain_args[@]}; ++i)); do
    case "${llmtrain_args[i]}" in
      --run-dir) dir="${llmtrain_args[i + 1]:-}" ;;
      --run-dir=*) dir="${llmtrain_args[i]#--run-dir=}" ;;
      --config) config="${llmtrain_args[i + 1]:-}" ;;
      --config=*) config="${llmtrain_args[i]#--config=}" ;;
    esac
  done
  [[ -n "$dir" ]] && echo "$dir" || { config="${config##*/}"; echo "runs/${config%.*}"; }
}

# Why the last job failed, in one line: its status (a signal's name for 128+N), the rank blamed
# (by llmtrain's watchdog or by mpirun), and the last line that rank logged.
failure() {
  local why="exit status $status" rank="" node="" log
  ((status > 128 && status <= 128 + 64)) && why+=" (SIG$(kill -l $((status - 128)) 2>/dev/null || echo "$((status - 128))"))"
  ((status == lost_status)) && why+=" (ranks or a node lost)"
  [[ -s "$work/failed" ]] && read -r rank node <"$work/failed"
  if [[ -z "$rank" ]]; then
    echo "$why; no rank named as the failing one"
    return
  fi
  log="$(run_dir)/logs/rank-$(printf '%05d' "$rank").log"
  why+="; rank $rank${node:+ (on $node)}"
  if [[ -s "$log" ]]; then
    echo "$why last logged: $(tail -n 1 "$log")"
  else
    echo "$why logged nothing ($log)"
  fi
}

# The ranks of a relaunch on SLOTS slots (and never more than the job had): whole model replicas
# of tensor x context x pipeline ranks, the data-parallel size D the largest that divides
# global_batch_size / micro_batch_size (so that the global batch stays exact, accumulation
# making up the rest) and at which llmtrain's own rules accept the world size (`plan
# --world-size`, which checks what the trainer checks at start). Prints the ranks, or fails with
# one line saying why.
relaunch_ranks() {
  local slots="$1"
  if ! resolve_config; then
    echo "mpirun.sh: error: not relaunching: cannot read the config to lay out the ranks: $(tail -n 1 "$work/config.err")" >&2
    return 1
  fi
  local tp cp pp group global micro per_batch
  tp=$(config_value tensor_parallel 1)
  cp=$(config_value context_parallel 1)
  pp=$(config_value pipeline_parallel 1)
  group=$((tp * cp * pp))
  global=$(config_value global_batch_size 0)
  micro=$(config_value micro_batch_size 0)
  if ((group < 1 || global < 1 || micro < 1 || global % micro != 0)); then
    echo "mpirun.sh: error: not relaunching: the config's dist.tensor_parallel, context_parallel, pipeline_parallel ($tp, $cp, $pp) or train.global_batch_size, micro_batch_size ($global, $micro) lay out no ranks" >&2
    return 1
  fi
  per_batch=$((global / micro))  # micro-batches per update over all data-parallel ranks
  local most=$(( (slots < ranks ? slots : ranks) / group ))
  local replica="dist.tensor_parallel x dist.context_parallel x dist.pipeline_parallel = $tp x $cp x $pp = $group ranks"
  if ((most < 1)); then
    echo "mpirun.sh: error: not relaunching: the $slots slot(s) left cannot hold one model replica ($replica)" >&2
    return 1
  fi
  local data refused="" plan=(plan --world-size) i
  for ((i = 0; i < ${#llmtrain_args[@]}; ++i)); do
    case "${llmtrain_args[i]}" in
      --config|--set) plan+=("${llmtrain_args[i]}" "${llmtrain_args[i + 1]:-}"); i=$((i + 1)) ;;
      --config=*|--set=*) plan+=("${llmtrain_args[i]}") ;;
    esac
  done
  for ((data = most; data >= 1; --data)); do
    ((per_batch % data == 0)) || continue
    if "$llmtrain" "${plan[0]}" "${plan[1]}" $((data * group)) "${plan[@]:2}" >/dev/null 2>"$work/plan.err"; then
      echo $((data * group))
      return 0
    fi
    [[ -n "$refused" ]] || refused="at data-parallel size $data: $(tail -n 1 "$work/plan.err")"
  done
  echo "mpirun.sh: error: not relaunching: no data-parallel size from $most down to 1 that divides train.global_batch_size / train.micro_batch_size = $global / $micro = $per_batch is accepted ($replica each; llmtrain refused $refused)" >&2
  return 1
}

llmtrain_args=("$@")
restarts=0
hosts="$hostfile"
while true; do
  run_job "$ranks" "$hosts"
  ((status == 0 || status == stop_status)) && exit "$status"
  echo "mpirun.sh: the job failed: $(failure)" >&2
  if ((stops > 0)); then
    echo "mpirun.sh: not relaunching: the job was stopped by a signal to this script" >&2
    exit "$status"
  fi
  if ((status == input_status)); then
    echo "mpirun.sh: not relaunching: bad input (exit $input_status) would fail again" >&2
    exit "$status"
  fi
  if ((restarts >= max_restarts)); then
    echo "mpirun.sh: not relaunching: $restarts of --max-restarts $max_restarts relaunch(es) done" >&2
    exit "$status"
  fi
  restarts=$((restarts + 1))
  if [[ -n "$hosts" ]]; then
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
    where="$nodes host(s) ($(cut -d' ' -f1 "$work/hosts.$restarts" | paste -sd' '))"
    hosts="$work/hosts.$restarts"
  else
    slots=$ranks
    where="this node"
  fi
  new_ranks=$(relaunch_ranks "$slots") || exit "$status"
  group=$(( $(config_value tensor_parallel 1) * $(config_value context_parallel 1) * $(config_value pipeline_parallel 1) ))
  echo "mpirun.sh: relaunch $restarts of $max_restarts on $where: $new_ranks ranks, data-parallel size $((new_ranks / group)) (tensor x context x pipeline = $group), train.global_batch_size $(config_value global_batch_size 0) kept" >&2
  ranks=$new_ranks
done
