#!/usr/bin/env bash
# Long file work is not cut by dist.timeout_s, and a rank that hangs during it still stops the job.
# Rank 1's saves take 8 s longer (LLMTRAIN_TEST_SLOW_SAVE_S) under dist.timeout_s = 3: rank 0
# waits in the checkpoint's commit meanwhile, with patience (dist/file_work.h) while rank 1 says it
# is alive. Synchronous and background saves must both complete, and the runs end with status 0.
# Then rank 1, and in another run rank 0, is stopped (SIGSTOP) in the middle of a 60 s file work:
# the watchdog must end the job (naming rank 1 when rank 1 hangs) after dist.timeout_s, as
# dist_hang_test.sh requires outside file work, before the patience file work gets (its limit,
# dist::file_work_limit_s, is 30 s here) would have run out: an order of the two limits, which a
# loaded machine cannot swap as it could stretch a bound of a few seconds.
# Usage: dist_file_work_test.sh LLMTRAIN MPIEXEC
source "$(dirname "$0")/dist_test_setup.sh" "$@"
config() {  # $1: file, $2: checkpoint.async, $3: max_steps
  cat > "$1" <<JSON
{"model": {"vocab_size": 256, "context_length": 16, "n_layer": 1, "n_head": 2, "d_model": 16},
 "data": {"train": "$work/data/train_*.bin"},
 "train": {"micro_batch_size": 2, "global_batch_size": 4, "max_steps": $3, "log_every": 1},
 "optim": {"warmup_steps": 0},
 "dist": {"timeout_s": 3},
 "checkpoint": {"every": 2, "async": $2}}
JSON
}

# Two ranks, each with its saves slowed by some seconds (0: not at all).
launch() {  # $1: config, $2: rank 1's slow seconds, $3: run folder, $4: rank 0's slow seconds
  "$mpiexec" --allow-run-as-root --oversubscribe \
    -np 1 env LLMTRAIN_TEST_SLOW_SAVE_S="${4:-0}" "$llmtrain" train --config "$1" --run-dir "$3" : \
    -np 1 env LLMTRAIN_TEST_SLOW_SAVE_S="$2" "$llmtrain" train --config "$1" --run-dir "$3"
}

for async in false true; do
  config "$work/c-$async.json" "$async" 4
  run="$work/run-$async"
  start=$SECONDS
  launch "$work/c-$async.json" 8 "$run" >"$run.log" 2>&1 &
  job=$!
  while kill -0 "$job" 2>/dev/null && (( SECONDS - start < 120 )); do sleep 0.5; done
  if kill -0 "$job" 2>/dev/null; then kill -KILL "$job"; fail "checkpoint.async $async: still running after 120 s"; fi
  wait "$job"; status=$?
  took=$((SECONDS - start))
  (( status == 0 )) || fail "checkpoint.async $async: exit status $status after ${took} s: $(tail -n 5 "$run.log")"
  ! grep -q "did not finish within" "$run.log" || fail "checkpoint.async $async: a timeout: $(grep "did not finish" "$run.log")"
  complete=$(ls "$run"/checkpoints/step_*/COMPLETE 2>/dev/null | wc -l)
  (( complete >= 2 )) || fail "checkpoint.async $async: $complete complete checkpoint(s), expected 2 (steps 2 and 4)"
  # Rank 1 slept 8 s per save, more than dist.timeout_s = 3: the run took at least 2 x 8 s.
  (( took >= 16 )) || fail "checkpoint.async $async: took ${took} s, less than rank 1's 2 x 8 s of file work"
  echo "checkpoint.async $async: 2 saves of 8 s on rank 1 under dist.timeout_s = 3: exit 0 after ${took} s, $complete complete checkpoints"
done

# A rank that hangs in its file work: the job stops before the patience limit. Rank 1 hung:
# rank 0 no longer hears it, stops granting patience and names it. Rank 0 hung: rank 1 no longer
# gets its grants and stops.
hang() {  # $1: the rank that is slow and then stopped
  local rank="$1" run="$work/run-hang$1" slow0=0 slow1=0
  config "$work/c-hang$rank.json" false 4
  if (( rank == 0 )); then slow0=60; else slow1=60; fi
  launch "$work/c-hang$rank.json" "$slow1" "$run" "$slow0" >"$run.log" 2>&1 &
  local job=$!
  for _ in $(seq 1 300); do compgen -G "$run/checkpoints/step_*" >/dev/null && break; sleep 0.1; done
  compgen -G "$run/checkpoints/step_*" >/dev/null || fail "hang $rank: no save started: $(cat "$run.log")"
  sleep 2  # the slow rank is in its 60 s file work, the other in the patient commit
  local pid=""
  for p in $(pgrep -f "llmtrain train --config $work/c-hang$rank.json"); do
    if tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$rank"; then pid=$p; fi
  done
  [[ -n "$pid" ]] || fail "hang $rank: rank $rank not found"
  local start=$SECONDS
  kill -STOP "$pid"
  while kill -0 "$job" 2>/dev/null && (( SECONDS - start < 60 )); do sleep 0.5; done
  if kill -0 "$job" 2>/dev/null; then kill -KILL "$job"; kill -KILL "$pid"; fail "hang $rank: the job still runs after 60 s"; fi
  wait "$job"; local status=$?
  kill -KILL "$pid" 2>/dev/null
  local took=$((SECONDS - start))
  (( status != 0 )) || fail "hang $rank: exit status 0"
  (( took < 30 )) || fail "hang $rank: took ${took} s: the patience limit (30 s), not dist.timeout_s = 3, ended the wait"
  grep -q "did not finish within dist.timeout_s = 3 s" "$run.log" || fail "hang $rank: no watchdog line: $(cat "$run.log")"
  echo "rank $rank hung in file work: job ended ${took} s after SIGSTOP, status $status: $(grep -m1 'did not finish' "$run.log" | cut -c1-170)"
}
hang 1
grep -q "rank(s) 1 never arrived or stopped responding" "$work/run-hang1.log" || fail "hang 1: rank 1 not named"
hang 0
echo "4 passed, 0 failed"
