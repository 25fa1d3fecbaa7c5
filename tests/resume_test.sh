#!/usr/bin/env bash
# Checkpoints that never lose a run (CPU, world sizes 1 and 2):
#  1. SIGKILL at 12 random moments (some while a checkpoint is written), each time resumed with
#     --resume auto: the final weights and optimizer state are bit-identical to an uninterrupted run.
#  2. SIGTERM: a checkpoint is written and the exit status is 75; the resubmitted run ends
#     bit-identical to the uninterrupted one.
#  3. A world-size-2 ZeRO-1 checkpoint resumed at world sizes 1 and 4 continues with the same losses.
#  4. Damaged checkpoints: auto-resume falls back to the previous one; --resume PATH exits 2 naming
#     the file; a full disk while saving stops the run and leaves the previous checkpoint usable.
# Usage: resume_test.sh LLMTRAIN MPIEXEC
source "$(dirname "$0")/checkpoint_test_setup.sh"
config() {  # config FILE MAX_STEPS EVERY ZERO
  cat > "$1" <<JSON
{"model": {"vocab_size": 256, "context_length": 32, "n_layer": 2, "n_head": 2, "d_model": 32},
 "data": {"train": "$work/data/train_*.bin", "val": "$work/data/val_*.bin"},
 "train": {"micro_batch_size": 2, "global_batch_size": 8, "max_steps": $2, "log_every": 100000, "eval_every": 0,
           "eval_batches": 2},
 "optim": {"warmup_steps": 10},
 "dist": {"zero_stage": $4},
 "checkpoint": {"every": $3, "keep_last": 2}}
JSON
}
losses() { grep -o '"loss":[^,}]*' "$1/metrics.jsonl"; }

# 1. SIGKILL at random moments.
for ranks in 1 2; do
  config "$work/kill.json" 3000 3 1  # long enough that 12 kills always come before the end
  launch "$ranks" train --config "$work/kill.json" --run-dir "$work/ref$ranks" >/dev/null 2>&1 || fail "reference run ($ranks rank(s))"
  kills=0
  RANDOM=$((42 + ranks))
  while true; do
    launch "$ranks" train --config "$work/kill.json" --run-dir "$work/killed$ranks" >>"$work/killed$ranks.log" 2>&1 &
    job=$!
    if (( kills < 12 )); then
      sleep "0.$(( (RANDOM % 30) + 5 ))"
      if kill -0 "$job" 2>/dev/null; then
        pkill -KILL -f "run-dir $work/killed$ranks" 2>/dev/null
        kill -KILL "$job" 2>/dev/null
        wait "$job" 2>/dev/null
        kills=$((kills + 1))
        continue
      fi
    fi
    wait "$job" || fail "resumed run ($ranks rank(s)) failed: $(tail -n 5 "$work/killed$ranks.log")"
    break
  done
  (( kills >= 10 )) || fail "only $kills kills before the run finished ($ranks rank(s))"
  same_files "$work/ref$ranks" "$work/killed$ranks" || fail "weights after $kills kills differ from the uninterrupted run ($ranks rank(s))"
  [[ "$(losses "$work/ref$ranks")" == "$(losses "$work/killed$ranks")" ]] || fail "loss curve differs ($ranks rank(s))"
  pass "$ranks rank(s): SIGKILL $kills times, resumed each time: weights, optimizer state and losses bit-identical"
done

# 2. SIGTERM: checkpoint, exit 75, resubmit.
config "$work/term.json" 1200 1000 0
"$llmtrain" train --config "$work/term.json" --run-dir "$work/termref" >/dev/null 2>&1 || fail "reference run"
"$llmtrain" train --config "$work/term.json" --run-dir "$work/term" >"$work/term.log" 2>&1 &
job=$!
for _ in $(seq 1 100); do [[ -s "$work/term/metrics.jsonl" ]] && break; sleep 0.02; done
kill -TERM "$job"
wait "$job"; status=$?
(( status == 75 )) || fail "SIGTERM: exit status $status, expected 75: $(tail -n 3 "$work/term.log")"
stopped_at=$(cat "$work/term/checkpoints/latest")
"$llmtrain" train --config "$work/term.json" --run-dir "$work/term" >>"$work/term.log" 2>&1 || fail "resubmitted run"
same_files "$work/termref" "$work/term" || fail "SIGTERM: the resubmitted run differs from the uninterrupted one"
pass "SIGTERM: checkpoint $stopped_at, exit 75; the resubmitted run ends bit-identical"

# 3. World size 2 with ZeRO 1, resumed at world sizes 1 and 4 from its step-10 checkpoint.
config "$work/z1.json" 20 10 1
sed -i 's/"keep_last": 2/"keep_last": 5/' "$work/z1.json"
mpi 2 "$llmtrain" train --config "$work/z1.json" --run-dir "$work/z1ref" >/dev/null 2>&1 || fail "world size 2 ZeRO 1 run"
for ranks in 1 4; do
  launch "$ranks" train --config "$work/z1.json" --run-dir "$work/z1at$ranks" \
    --resume "$work/z1ref/checkpoints/step_00000010" >/dev/null 2>&1 || fail "resume at world size $ranks"
  same_losses "$work/z1ref/metrics.jsonl" "$work/z1at$ranks/metrics.jsonl" || fail "world size $ranks: losses differ from the world-size-2 run"
  pass "world-size-2 ZeRO-1 checkpoint resumed at world size $ranks: same losses (1e-5)"
done

# 4. Damaged checkpoints.
config "$work/dmg.json" 12 4 0
sed -i 's/"keep_last": 2/"keep_last": 3/' "$work/dmg.json"
"$llmtrain" train --config "$work/dmg.json" --run-dir "$work/dmg" >/dev/null 2>&1 || fail "damage run"
last="$work/dmg/checkpoints/step_00000012"
printf 'x' | dd of="$last/model.safetensors" bs=1 seek=100 conv=notrunc 2>/dev/null       # corrupted
out=$("$llmtrain" train --config "$work/dmg.json" --run-dir "$work/dmg" --resume "$last" 2>&1); status=$?
(( status == 2 )) && grep -q "model.safetensors: checksum mismatch" <<<"$out" || fail "explicit resume of a corrupted checkpoint: $status $out"
sed -i 's/"max_steps": 12/"max_steps": 13/' "$work/dmg.json"
out=$("$llmtrain" train --config "$work/dmg.json" --run-dir "$work/dmg" 2>&1) || fail "auto-resume past a corrupted checkpoint: $out"
grep -q "skipping damaged checkpoint: .*step_00000012/model.safetensors: checksum mismatch" <<<"$out" &&
  grep -q "resuming from .*step_00000008" <<<"$out" || fail "auto-resume did not fall back to step 8: $out"
pass "corrupted checkpoint: explicit resume exits 2 naming the file; auto falls back to the previous one"
truncate -s 500 "$work/dmg/checkpoints/step_00000008/optim-00000.safetensors"                # truncated
out=$("$llmtrain" train --config "$work/dmg.json" --run-dir "$work/dmg" --resume "$work/dmg/checkpoints/step_00000008" 2>&1); status=$?
(( status == 2 )) && grep -q "optim-00000.safetensors" <<<"$out" || fail "truncated checkpoint: $status $out"
rm "$work/dmg/checkpoints/step_00000013/COMPLETE"                                           # partial
out=$("$llmtrain" train --config "$work/dmg.json" --run-dir "$work/dmg" --resume "$work/dmg/checkpoints/step_00000013" 2>&1); status=$?
(( status == 2 )) && grep -q "incomplete checkpoint (no COMPLETE file)" <<<"$out" || fail "partial checkpoint: $status $out"
pass "truncated and partial checkpoints: explicit resume exits 2 naming what is wrong"

# Full disk: a 1 MiB file system for the checkpoints (needs root and mount; skipped visibly otherwise).
mkdir -p "$work/full"
if mount -t tmpfs -o size=700k tmpfs "$work/full" 2>/dev/null; then
  config "$work/full.json" 40 1 0
  sed -i "s|\"keep_last\": 2}|\"keep_last\": 100, \"dir\": \"$work/full\"}|" "$work/full.json"
  out=$("$llmtrain" train --config "$work/full.json" --run-dir "$work/fullrun" 2>&1); status=$?
  (( status == 1 )) && grep -q "llmtrain: error: .*No space left on device" <<<"$out" || fail "full disk: $status $(tail -n 2 <<<"$out")"
  latest=$(cat "$work/full/latest")
  "$llmtrain" eval --checkpoint "$work/full/$latest" >/dev/null 2>&1 || fail "full disk: the previous checkpoint $latest does not load"
  pass "full disk while saving: exit 1 with a clear message; the previous checkpoint ($latest) loads"
else
  echo "SKIPPED: full-disk case needs root to mount a small tmpfs"
fi
echo "$passed passed, 0 failed"
