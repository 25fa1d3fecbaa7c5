#!/usr/bin/env bash
# SIGTERM to the launcher: scripts/launch/mpirun.sh (and so the Kubernetes launcher, which runs
# it) turns it into SIGUSR1 for every rank; the ranks checkpoint, and the launcher exits 75. The
# same command then resumes from that checkpoint: over two interrupted runs metrics.jsonl holds
# every step exactly once, in order. SIGINT (Ctrl-C) ends the same way.
# Usage: launch_signal_test.sh LLMTRAIN SOURCE_DIR
set -uo pipefail
llmtrain="$1"
source_dir="$2"
work=$(mktemp -d)
launcher_pid=""
cleanup() {
  [[ -n "$launcher_pid" ]] && kill -KILL "$launcher_pid" 2>/dev/null
  pkill -KILL -f "run-dir $work/" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 LLMTRAIN="$llmtrain"
export OMPI_MCA_rmaps_base_oversubscribe=1  # 2 ranks even on a 1-core machine
passed=0
pass() { echo "ok: $*"; passed=$((passed + 1)); }
fail() { echo "FAILED: $*"; echo "$passed passed, 1 failed"; exit 1; }

source "$(dirname "${BASH_SOURCE[0]}")/tiny_run.sh"
tiny_run "$work" "$llmtrain" 1 || fail "tokenize"
run="$work/run"
cmd=(bash "$source_dir/scripts/launch/mpirun.sh" -n 2 -- train --config "$work/c.json" --run-dir "$run" --device cpu)  # 2 ranks cannot share a GPU
# Training steps only (checkpoint records carry a step too).
steps() { grep '"loss":' "$run/metrics.jsonl" | grep -o '"step":[0-9]*' | cut -d: -f2; }

# interrupt SIGNAL ROUND: runs the command until it has logged steps past the ones already there,
# sends SIGNAL to the launcher, and checks exit 75 and the checkpoint it names.
interrupt() {
  local signal="$1" round="$2" before
  before=$( [[ -f "$run/metrics.jsonl" ]] && steps | tail -n 1 || echo 0)
  # Job control on: a background command of a script would otherwise start with SIGINT ignored.
  set -m
  "${cmd[@]}" > "$work/log$round" 2>&1 &
  launcher_pid=$!
  set +m
  local now=0
  for _ in $(seq 1 300); do
    now=$( [[ -f "$run/metrics.jsonl" ]] && steps | tail -n 1 || echo 0)
    (( now > before + 20 )) && break
    sleep 0.1
  done
  (( now > before + 20 )) || fail "round $round: no training steps logged: $(tail -n 5 "$work/log$round")"
  kill "-$signal" "$launcher_pid"
  local start=$SECONDS
  while kill -0 "$launcher_pid" 2>/dev/null && (( SECONDS - start < 60 )); do sleep 0.2; done
  kill -0 "$launcher_pid" 2>/dev/null && fail "round $round: the launcher still runs 60 s after SIG$signal"
  wait "$launcher_pid"; local status=$?
  launcher_pid=""
  echo "round $round: SIG$signal to scripts/launch/mpirun.sh at step $now: exit status $status"
  (( status == 75 )) || fail "round $round: exit status $status, expected 75: $(tail -n 5 "$work/log$round")"
  local latest; latest=$(cat "$run/checkpoints/latest" 2>/dev/null)
  [[ -n "$latest" && -d "$run/checkpoints/$latest" ]] || fail "round $round: no checkpoint after SIG$signal"
  local last; last=$(steps | tail -n 1)
  [[ "$latest" == "$(printf 'step_%08d' "$last")" ]] || fail "round $round: checkpoint $latest, last logged step $last"
  grep -q "stopped by a signal" "$work/log$round" || fail "round $round: the log does not say 'stopped by a signal'"
  pass "round $round: SIG$signal gave exit 75 and checkpoint $latest (last step logged $last)"
}

interrupt TERM 1
first_stop=$(steps | tail -n 1)
interrupt INT 2
grep -q "resuming from .*$(printf 'step_%08d' "$first_stop") (step $first_stop)" "$work/log2" \
  || fail "round 2 did not say it resumed from step $first_stop: $(head -n 5 "$work/log2")"
# Every step once, in order, across both runs: nothing lost, nothing repeated.
total=$(steps | tail -n 1)
[[ "$(steps | tr '\n' ' ')" == "$(seq 1 "$total" | tr '\n' ' ')" ]] \
  || fail "metrics.jsonl steps are not 1..$total exactly once: $(steps | uniq -d | head -n 3 | tr '\n' ' ')"
pass "the same command resumed after step $first_stop; steps 1..$total each logged once"
echo "$passed passed, 0 failed"
