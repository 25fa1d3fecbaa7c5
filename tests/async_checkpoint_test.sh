#!/usr/bin/env bash
# Checkpoints written in the background (checkpoint.async, the default):
#  1. World sizes 2 and 4 with ZeRO 1 under mpirun: every rank writes its own optimizer file and
#     says so in its log; the files equal those of synchronous saves byte for byte; the world-size-4
#     checkpoint resumes at world size 2 with the same losses.
#  2. kill -9 while a background write is under way (its temporary file exists): the previous
#     checkpoint is still `latest` and verifies; the resumed run ends bit-identical.
#  3. SIGTERM while a background write is under way: that save and one at the stop are finished,
#     exit 75; the resubmitted run ends bit-identical.
# Usage: async_checkpoint_test.sh LLMTRAIN MPIEXEC
source "$(dirname "$0")/checkpoint_test_setup.sh"
config() {  # config FILE MAX_STEPS EVERY ZERO D_MODEL N_LAYER
  cat > "$1" <<JSON
{"model": {"vocab_size": 256, "context_length": 32, "n_layer": $6, "n_head": 2, "d_model": $5},
 "data": {"train": "$work/data/train_*.bin"},
 "train": {"micro_batch_size": 1, "global_batch_size": 4, "max_steps": $2, "log_every": 100000, "eval_every": 0},
 "optim": {"warmup_steps": 2},
 "dist": {"zero_stage": $4},
 "checkpoint": {"every": $3, "keep_last": 5}}
JSON
}
same_files() {  # same_files STEP_DIR_A STEP_DIR_B: the same safetensors files, byte for byte
  local a="$1" b="$2" f n=0
  for f in "$a"/*.safetensors; do cmp -s "$f" "$b/$(basename "$f")" || return 1; n=$((n + 1)); done
  (( n == $(ls "$b"/*.safetensors | wc -l) ))
}
same_final() {  # same_final RUN_A RUN_B: the latest checkpoints are the same step with the same files
  local a="$1/checkpoints/$(cat "$1/checkpoints/latest")" b="$2/checkpoints/$(cat "$2/checkpoints/latest")"
  [[ "$(basename "$a")" == "$(basename "$b")" ]] && same_files "$a" "$b"
}
losses() { grep -o '"loss":[^,}]*' "$1/metrics.jsonl"; }

# 1. Every rank writes its own files, in the background.
config "$work/w.json" 6 2 1 32 2
for ranks in 2 4; do
  mpi "$ranks" "$llmtrain" train --config "$work/w.json" --run-dir "$work/w$ranks" >"$work/w$ranks.log" 2>&1 ||
    fail "world size $ranks: $(tail -n 3 "$work/w$ranks.log")"
  mpi "$ranks" "$llmtrain" train --config "$work/w.json" --run-dir "$work/s$ranks" --set checkpoint.async=false \
    >"$work/s$ranks.log" 2>&1 || fail "world size $ranks, synchronous: $(tail -n 3 "$work/s$ranks.log")"
  for step in 2 4 6; do
    dir="$work/w$ranks/checkpoints/step_0000000$step"
    [[ -f "$dir/COMPLETE" ]] || fail "world size $ranks: step $step is not complete"
    for ((r = 0; r < ranks; r++)); do
      [[ -f "$dir/optim-0000$r.safetensors" ]] || fail "world size $ranks: no optim-0000$r.safetensors at step $step"
    done
    same_files "$dir" "$work/s$ranks/checkpoints/step_0000000$step" ||
      fail "world size $ranks: step $step's background save differs from the synchronous one"
  done
  for ((r = 0; r < ranks; r++)); do
    log="$work/w$ranks/logs/rank-0000$r.log"
    grep -q "saving in the background" "$log" && [[ $(grep -c "MB written in .* in the background; training stalled" "$log") == 3 ]] ||
      fail "world size $ranks: rank $r's log does not show 3 background saves: $(cat "$log")"
  done
  [[ $(grep -c '"checkpoint_background":true' "$work/w$ranks/metrics.jsonl") == 3 ]] ||
    fail "world size $ranks: metrics.jsonl lacks the 3 saves"
  [[ "$(losses "$work/w$ranks")" == "$(losses "$work/s$ranks")" ]] || fail "world size $ranks: losses differ, async vs sync"
  pass "world size $ranks, ZeRO 1: every rank wrote its optimizer file in the background, byte-identical to synchronous saves"
done
mpi 2 "$llmtrain" train --config "$work/w.json" --run-dir "$work/w4at2" --resume "$work/w4/checkpoints/step_00000002" \
  >"$work/w4at2.log" 2>&1 || fail "resume at world size 2: $(tail -n 3 "$work/w4at2.log")"
/usr/bin/python3 - "$work/w4/metrics.jsonl" "$work/w4at2/metrics.jsonl" <<'PY' || fail "world size 4 -> 2: losses differ"
import json, sys
ref = {l["step"]: l["loss"] for l in map(json.loads, open(sys.argv[1])) if "loss" in l}
got = {l["step"]: l["loss"] for l in map(json.loads, open(sys.argv[2])) if "loss" in l}
assert sorted(got) == [3, 4, 5, 6], sorted(got)
worst = max(abs(got[s] - ref[s]) / abs(ref[s]) for s in got)
print(f"  steps 3-6, largest relative difference {worst:.1e}")
assert worst <= 1e-5
PY
pass "the world-size-4 background checkpoint resumes at world size 2 with the same losses (1e-5)"

# A model whose checkpoint (about 40 MB) takes long enough to write that a signal can land
# during it: the moment is when a temporary file appears in a step folder.
config "$work/big.json" 15 3 0 256 4
"$llmtrain" train --config "$work/big.json" --run-dir "$work/bigref" >"$work/bigref.log" 2>&1 || fail "reference run: $(tail -n 3 "$work/bigref.log")"
during_write() {  # during_write RUN: waits until a background write is under way (at most 60 s)
  for _ in $(seq 1 6000); do
    compgen -G "$1/checkpoints/step_*/*.tmp*" >/dev/null && return 0
    sleep 0.01
  done
  return 1
}

# 2. kill -9 during background writes, three times, then resume to the end.
for round in 1 2 3; do
  "$llmtrain" train --config "$work/big.json" --run-dir "$work/killed" >>"$work/killed.log" 2>&1 &
  job=$!
  # Past the first checkpoint (so there is one to keep), then into a write.
  for _ in $(seq 1 6000); do [[ -f "$work/killed/checkpoints/latest" ]] && break; sleep 0.01; done
  during_write "$work/killed" || fail "kill $round: no background write seen"
  sleep "0.0$((RANDOM % 5))"  # somewhere in the write
  before=$(cat "$work/killed/checkpoints/latest")
  kill -KILL "$job"
  wait "$job" 2>/dev/null
  after=$(cat "$work/killed/checkpoints/latest")
  [[ -f "$work/killed/checkpoints/$after/COMPLETE" ]] || fail "kill $round: latest ($after) is not complete"
  "$llmtrain" inspect --checkpoint "$work/killed/checkpoints/$after" >"$work/inspect.log" 2>&1 ||
    fail "kill $round: the checkpoint left ($after) does not verify: $(cat "$work/inspect.log")"
  echo "  kill $round during a background write: latest was $before, is $after, verifies"
done
"$llmtrain" train --config "$work/big.json" --run-dir "$work/killed" >>"$work/killed.log" 2>&1 || fail "resume after kills: $(tail -n 3 "$work/killed.log")"
same_final "$work/bigref" "$work/killed" || fail "after kills during background writes, the final checkpoint differs"
[[ "$(losses "$work/bigref")" == "$(losses "$work/killed")" ]] || fail "after kills, the loss curve differs"
pass "kill -9 during background writes (3 times): the previous checkpoint verifies; the resumed run ends bit-identical"

# 3. SIGTERM during a background write.
"$llmtrain" train --config "$work/big.json" --run-dir "$work/term" >"$work/term.log" 2>&1 &
job=$!
for _ in $(seq 1 6000); do [[ -f "$work/term/checkpoints/latest" ]] && break; sleep 0.01; done
during_write "$work/term" || fail "SIGTERM: no background write seen"
kill -TERM "$job"
wait "$job"; status=$?
(( status == 75 )) || fail "SIGTERM: exit status $status, expected 75: $(tail -n 3 "$work/term.log")"
stopped=$(cat "$work/term/checkpoints/latest")
grep -q "stopped by a signal after step $((10#${stopped#step_}))" "$work/term.log" ||
  fail "SIGTERM: latest ($stopped) is not the checkpoint of the stop: $(tail -n 5 "$work/term.log")"
compgen -G "$work/term/checkpoints/step_*/*.tmp*" >/dev/null && fail "SIGTERM: temporary files left: $(ls "$work"/term/checkpoints/*)"
"$llmtrain" train --config "$work/big.json" --run-dir "$work/term" >>"$work/term.log" 2>&1 || fail "resubmitted run: $(tail -n 3 "$work/term.log")"
same_final "$work/bigref" "$work/term" || fail "SIGTERM: the resubmitted run differs from the uninterrupted one"
pass "SIGTERM during a background write: exit 75 with $stopped complete; the resubmitted run ends bit-identical"
echo "$passed passed, 0 failed"
