#!/usr/bin/env bash
# One writer per run folder: a second `train` given the run folder of a run in progress exits 2
# with one line naming the holder's host, pid and start time, and changes nothing of the first
# run (which then finishes, every step logged once); after the holder is killed with kill -9 the
# lock goes with it, and the next run takes the folder over and resumes. On shared file systems:
# a lock of another host whose heartbeat is stale (a dead node's lease that lingers) is taken
# over, a fresh one refused with its age; where the file system keeps no locks (forced with the
# test hook LLMTRAIN_TEST_NO_FILE_LOCKS=1, as ENOLCK) the heartbeat alone decides.
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
grep -E "another run is writing this run folder \(host $(hostname), pid $first, started [0-9T:-]+Z\), locked [0-9]+ s ago, last heartbeat [0-9]+ s ago" "$work/second.log" >/dev/null ||
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

# 3. Another host's lock, still held by the kernel (as a dead node's lease lingers on NFSv4, Lustre
# or GPFS): refused while its heartbeat is fresh, taken over once it is older than the limit. The
# runs' clock is set (the test hook LLMTRAIN_TEST_UNIX_NOW) to the one the holder's note was
# written by, so that the ages they see are the ones written, however long they took to start.
holder=""
now=$(date +%s)
hold_lock() {  # HEARTBEAT_AGE_S: a process of "node-gone" holding an fcntl lock on run.lock
  rm -f "$work/held"
  /usr/bin/python3 - "$run/run.lock" "$1" "$work/held" "$now" <<'PY' &
import fcntl, os, sys, time
path, age, ready, now = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
os.ftruncate(fd, 0)
os.write(fd, f"host node-gone, pid 4242, started 2026-01-01T00:00:00Z\nheartbeat {now - age}, started {now - age - 100}\n".encode())
open(ready, "w").close()
time.sleep(120)
PY
  holder=$!
  for _ in $(seq 1 100); do [[ -e "$work/held" ]] && return 0; sleep 0.1; done
  return 1
}
release_lock() { kill -KILL "$holder" 2>/dev/null; wait "$holder" 2>/dev/null; holder=""; }
trap 'release_lock; cleanup' EXIT
hold_lock 1 || fail "the other host's lock was not taken"
LLMTRAIN_TEST_UNIX_NOW=$now "$llmtrain" train --config "$work/c.json" --run-dir "$run" --set train.max_steps=3110 \
  >"$work/fresh.log" 2>&1
status=$?
((status == 2)) && grep -qF "(host node-gone, pid 4242, started 2026-01-01T00:00:00Z), locked 101 s ago, last heartbeat 1 s ago" "$work/fresh.log" ||
  fail "another host's lock with a fresh heartbeat: exit $status (want 2, naming it and its age): $(cat "$work/fresh.log")"
pass "another host's lock with a fresh heartbeat is refused: $(grep 'llmtrain: error:' "$work/fresh.log")"
release_lock
hold_lock 60 || fail "the other host's lock was not taken"
LLMTRAIN_TEST_UNIX_NOW=$now "$llmtrain" train --config "$work/c.json" --run-dir "$run" --set train.max_steps=3120 \
  >"$work/stale.log" 2>&1 ||
  fail "another host's lock with a stale heartbeat (60 s) was not taken over: $(tail -n 3 "$work/stale.log")"
grep -q "taking over the lock of host node-gone, pid 4242" "$work/stale.log" || fail "the takeover is not reported: $(cat "$work/stale.log")"
release_lock
[[ "$(steps | tr '\n' ' ')" == "$(seq 1 3120 | tr '\n' ' ')" ]] || fail "after taking over the stale lock metrics.jsonl does not hold steps 1-3120 once each"
pass "another host's lock with a stale heartbeat is taken over: $(grep 'taking over' "$work/stale.log")"

# 4. A file system without locks (the test hook answers every lock with ENOLCK): a live holder is
# still refused (its heartbeat is fresh, its pid runs); after it is killed, the next run takes over.
export LLMTRAIN_TEST_NO_FILE_LOCKS=1
"$llmtrain" train --config "$work/c.json" --run-dir "$run" --set train.max_steps=100000 >"$work/nolock.log" 2>&1 &
first=$!
wait_for_step 3130 || fail "the run without file locks did not reach step 3130: $(tail -n 3 "$work/nolock.log")"
"$llmtrain" train --config "$work/c.json" --run-dir "$run" --set train.max_steps=100000 >"$work/nolock2.log" 2>&1
status=$?
((status == 2)) && grep -q "another run is writing this run folder (host $(hostname), pid $first," "$work/nolock2.log" ||
  fail "without file locks a second run was not refused: exit $status: $(cat "$work/nolock2.log")"
pass "without file locks a live holder is still refused: $(grep 'llmtrain: error:' "$work/nolock2.log")"
kill -KILL "$first"
wait "$first" 2>/dev/null
first=""
last=$(steps | tail -n 1)
"$llmtrain" train --config "$work/c.json" --run-dir "$run" --set train.max_steps=$((last + 20)) >"$work/nolock3.log" 2>&1 ||
  fail "without file locks the run after kill -9 did not take over: $(tail -n 3 "$work/nolock3.log")"
grep -q "released" "$run/run.lock" || fail "the lock file is not marked released after the run ended: $(cat "$run/run.lock")"
pass "without file locks a dead holder's lock is taken over, and released at the end"
echo "$passed passed"
