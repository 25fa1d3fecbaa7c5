#!/usr/bin/env bash
# An error that one rank meets alone is reported by that rank and stops the job at once, with its
# exit status; an error every rank meets is reported once. Rank 1 (then rank 0) is given a
# data.train that matches no file, a node without the data mounted: it fails at start-up while the
# other rank waits in a collective for it. Under dist.timeout_s = 60 the job must end with status 2
# and one line from that rank naming data.train, and no watchdog line (which would blame the
# waiting rank's collective and exit 76, the status a launcher relaunches on): that the rank's own
# error ended the job, before the watchdog could, shows in what was printed, so how long it took
# is printed but not checked (a loaded machine stretches it). With every rank given the missing
# data: status 2 and one line, as from one process.
# Usage: dist_lone_error_test.sh LLMTRAIN MPIEXEC
source "$(dirname "$0")/dist_test_setup.sh" "$@"
cat > "$work/config.json" <<JSON
{"model": {"vocab_size": 256, "context_length": 16, "n_layer": 1, "n_head": 2, "d_model": 16},
 "data": {"train": "$work/data/train_*.bin"},
 "train": {"micro_batch_size": 2, "global_batch_size": 4, "max_steps": 4, "log_every": 1},
 "optim": {"warmup_steps": 0},
 "dist": {"timeout_s": 60}}
JSON
missing="data.train=$work/nowhere/train_*.bin"

# $1 $2: rank 0's and rank 1's extra arguments ("" for none); $3: the case's name.
launch() {
  local run="$work/run-$3"
  # shellcheck disable=SC2086
  timeout 120 "$mpiexec" --allow-run-as-root --oversubscribe \
    -np 1 "$llmtrain" train --config "$work/config.json" --run-dir "$run" $1 : \
    -np 1 "$llmtrain" train --config "$work/config.json" --run-dir "$run" $2 >"$run.log" 2>&1
}

for lone in 1 0; do
  args=("" "")
  args[lone]="--set $missing"
  start=$SECONDS
  launch "${args[0]}" "${args[1]}" "rank$lone"; status=$?
  took=$((SECONDS - start))
  log="$work/run-rank$lone.log"
  errors=$(grep -c "llmtrain: error:" "$log")
  (( status == 2 )) || fail "rank $lone alone: exit status $status after ${took} s, expected 2: $(cat "$log")"
  ! grep -q "did not finish within dist.timeout_s" "$log" ||
    fail "rank $lone alone: the watchdog stopped the job after ${took} s: $(grep "did not finish within" "$log")"
  (( errors == 1 )) || fail "rank $lone alone: $errors error lines: $(grep "llmtrain: error:" "$log")"
  grep -q "llmtrain: error: rank $lone: data.train: no file matches .* (this rank alone; stopping the job)" "$log" ||
    fail "rank $lone alone: its error line is missing: $(cat "$log")"
  echo "rank $lone alone without data.train: exit 2 after ${took} s: $(grep "llmtrain: error:" "$log")"
done

launch "--set $missing" "--set $missing" "both"; status=$?
log="$work/run-both.log"
errors=$(grep -c "llmtrain: error:" "$log")
(( status == 2 && errors == 1 )) || fail "every rank without data.train: exit $status, $errors error lines: $(cat "$log")"
! grep -q "alone" "$log" || fail "every rank without data.train: reported as one rank's: $(grep "llmtrain: error:" "$log")"
echo "every rank without data.train: exit 2: $(grep "llmtrain: error:" "$log")"
echo "ok"
