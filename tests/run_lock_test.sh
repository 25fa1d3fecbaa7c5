#!/usr/bin/env bash
# One writer per run folder: a second `train` given the run folder of a run in progress exits 2
# with one line naming the holder's host, pid and start time, and changes nothing of the first
# run (which then finishes, every step logged once); after the holder is killed with kill -9 the
# lock goes with it, and the next run takes the folder over and resumes.
# Usage: run_lock_test.sh LLMTRAIN
set -uo pipefail
llmtrain="$1"
work=$(mktemp -d)
first=""
cleanup() {
  [[ -n "$first" ]] && kill -KILL "$first" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
passed=0
pass() { echo "ok: $*"; passed=$((passed + 1)); }
fail() { echo "FAILED: $*"; echo "$passed passed, 1 failed"; exit 1; }

source "$(dirname "${BASH_SOURCE[0]}")/tiny_run.sh"
tiny_run "$work" "$llmtrain" 1 || fail "tokenize"
run="$work/run"
steps() { grep '"loss":' "$run/metrics.jsonl" | grep -o '"step":[0-9]*' | cut -d: -f2; }
wait_for_step() {  # STEP
  local i
  for i in $(seq 1 600); do
    (($(steps 2>/dev/null | tail -n 1 || echo 0) >= $1)) 2>/dev/null && return 0
    sleep 0.1
  done
  return 1
}
snapshot() { (cd "$run" && find . -path ./metrics.jsonl -prune -o -path ./logs -prune -o -type f -print0 | sort -z | xargs -0 sha256sum); }

# 1. Two runs at once.
"$llmtrain" train --config "$work/c.json" --run-dir "$run" --set train.max_steps=3000 >"$work/first.log" 2>&1 &
first=$!
wait_for_step 20 || fail "the first run did not reach step 20: $(tail -n 3 "$work/first.log")"
kill -STOP "$first"  # held still, so that the comparison below sees only what the second run did
before=$(snapshot)
lines_before=$(wc -l <"$run/metrics.jsonl")
logs_before=$(cat "$run"/logs/*)
"$llmtrain" train --config "$work/c.json" --run-dir "$run" --set train.max_steps=3000 >"$work/second.log" 2>&1
status=$?
errors=$(grep -c "llmtrain: error:" "$work/second.log")
((status == 2 && errors == 1)) || fail "the second run: exit $status and $errors error lines (want 2 and 1): $(cat "$work/second.log")"
grep -E "another run is writing this run folder \(host $(hostname), pid $first, started [0-9T:-]+Z\)" "$work/second.log" >/dev/null ||
  fail "the second run does not name the holder (host $(hostname), pid $first): $(cat "$work/second.log")"
[[ "$(snapshot)" == "$before" && "$(wc -l <"$run/metrics.jsonl")" == "$lines_before" && "$(cat "$run"/logs/*)" == "$logs_before" ]] ||
  fail "the second run changed the first run's files"
pass "a second run on the same folder exits 2: $(grep 'llmtrain: error:' "$work/second.log")"
kill -CONT "$first"
wait "$first" || fail "the first run did not finish: $(tail -n 3 "$work/first.log")"
first=""
[[ "$(steps | tr '\n' ' ')" == "$(seq 1 3000 | tr '\n' ' ')" ]] || fail "the first run's metrics.jsonl does not hold steps 1-3000 once each"
pass "the first run finished untouched, 3000 steps logged once"

# 2. A stale lock: the holder killed with kill -9 mid-run; the next run takes the folder over.
"$llmtrain" train --config "$work/c.json" --run-dir "$run" --set train.max_steps=100000 >"$work/killed.log" 2>&1 &
first=$!
wait_for_step 3020 || fail "the second holder did not reach step 3020: $(tail -n 3 "$work/killed.log")"
kill -KILL "$first"
wait "$first" 2>/dev/null
killed=$first
first=""
grep -q "pid $killed," "$run/run.lock" || fail "the lock file does not name the killed holder: $(cat "$run/run.lock")"
"$llmtrain" train --config "$work/c.json" --run-dir "$run" --set train.max_steps=3100 >"$work/after.log" 2>&1 ||
  fail "the run after kill -9 did not take over: $(tail -n 3 "$work/after.log")"
grep -q "pid $killed," "$run/run.lock" && fail "the lock file still names the killed holder after the takeover"
[[ "$(steps | tr '\n' ' ')" == "$(seq 1 3100 | tr '\n' ' ')" ]] || fail "after the takeover metrics.jsonl does not hold steps 1-3100 once each"
pass "a stale lock after kill -9 is taken over: the next run resumed and finished ($(cat "$run/run.lock"))"
echo "$passed passed"
