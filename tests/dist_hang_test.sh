#!/usr/bin/env bash
# A rank that hangs (SIGSTOP) or dies (SIGKILL) mid-run: the job must stop, naming the missing rank,
# and never hang (it must end before a guard of 60 s). A hung rank is llmtrain's watchdog's to find:
# exit 76 and its line naming dist.timeout_s; a dead one the launcher's. How long the job took is
# printed, not checked: a loaded machine stretches it (9 to 11 s on 2 idle cores, of which 5 s are
# dist.timeout_s), and an order of events is what load cannot change.
# Usage: dist_hang_test.sh LLMTRAIN MPIEXEC
source "$(dirname "$0")/dist_test_setup.sh" "$@"
cat > "$work/c.json" <<JSON
{"model": {"vocab_size": 256, "context_length": 16, "n_layer": 1, "n_head": 2, "d_model": 16},
 "data": {"train": "$work/data/train_*.bin"},
 "train": {"micro_batch_size": 2, "global_batch_size": 4, "max_steps": 100000000, "log_every": 100000},
 "optim": {"warmup_steps": 0},
 "dist": {"timeout_s": 5},
 "checkpoint": {"every": 0}}
JSON

# The pid of rank R of the run in folder $1.
rank_pid() {
  for pid in $(pgrep -f "llmtrain train --config $work/c.json --run-dir $1"); do
    if tr '\0' '\n' < "/proc/$pid/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$2"; then echo "$pid"; return; fi
  done
}

# Starts a run of NP ranks (2), waits until it trains, sends SIGNAL to rank RANK (1), and checks
# how the job ends.
check() {
  local signal="$1" expect="$2" rank="${3:-1}" np="${4:-2}" run="$work/run-$1-${3:-1}"
  "$mpiexec" --allow-run-as-root --oversubscribe -np "$np" "$llmtrain" train --config "$work/c.json" --run-dir "$run" \
    --set train.global_batch_size=$((2 * np)) > "$run.log" 2>&1 &
  local job=$!
  for _ in $(seq 1 200); do [[ -s "$run/metrics.jsonl" ]] && break; sleep 0.1; done
  [[ -s "$run/metrics.jsonl" ]] || fail "$signal: the run did not start: $(cat "$run.log")"
  local pid; pid=$(rank_pid "$run" "$rank")
  [[ -n "$pid" ]] || fail "$signal: rank $rank not found"
  local start=$SECONDS
  kill "-$signal" "$pid"
  local waited=0
  while kill -0 "$job" 2>/dev/null && (( waited < 60 )); do sleep 0.5; waited=$((SECONDS - start)); done
  if kill -0 "$job" 2>/dev/null; then kill -KILL "$job"; fail "$signal: the job still runs after 60 s (hang)"; fi
  wait "$job"; local status=$?
  kill -KILL "$pid" 2>/dev/null
  local took=$((SECONDS - start))
  echo "$signal: job ended after ${took} s with exit status $status"
  (( status != 0 )) || fail "$signal: exit status 0"
  if [[ "$signal" == STOP ]]; then
    (( status == 76 )) || fail "$signal: exit status $status, not the watchdog's 76: $(cat "$run.log")"
    grep -q "did not finish within dist.timeout_s = 5 s" "$run.log" || fail "$signal: no watchdog line: $(cat "$run.log")"
  fi
  grep -q -- "$expect" "$run.log" || fail "$signal: the log does not say '$expect': $(cat "$run.log")"
  grep -- "$expect" "$run.log" | head -n 1
}

check STOP "rank(s) 1 never arrived"   # hung: llmtrain's watchdog names it
check KILL "rank 1"                    # dead: the launcher notices and names it
# Rank 0 itself lost (its node cut off: silent, not reported dead): the survivors call the roll,
# and the lowest one heard alive (rank 1) names rank 0.
check STOP "rank 1: .* did not finish within dist.timeout_s = 5 s: rank(s) 0 never arrived or stopped responding" 0 3
grep -q "rank 0 names the missing" "$work/run-STOP-0.log" && fail "a survivor still defers to the lost rank 0: $(cat "$work/run-STOP-0.log")"
echo "3 passed, 0 failed"
