#!/usr/bin/env bash
# Checkpoints written by earlier versions (tests/data/legacy_checkpoints: one model.safetensors,
# optimizer ranges in the files' metadata; or each rank's weights and AdamW state as ranges, before
# the optimizer interface) resume on other meshes and continue the loss curve of the run that wrote
# them (1e-5 relative): world size 2 ZeRO 1 at world size 1 and under ZeRO 3 at world size 4;
# tensor 2 x data 2 ZeRO 1 at tensor 2 ZeRO 3 and at world size 1; world size 2 ZeRO 3 at world
# size 1 and at world size 2 under ZeRO 1.
# Usage: legacy_checkpoint_test.sh LLMTRAIN MPIEXEC
source "$(dirname "$0")/checkpoint_test_setup.sh"
fixtures="$(cd "$(dirname "$0")/data/legacy_checkpoints" && pwd)"
cd "$work" || fail "cd $work"
cp "$fixtures/config.json" "$work/config.json"
for case in "world2_zero1 1 1 0" "world2_zero1 4 1 3" "tensor2_data2_zero1 2 2 3" "tensor2_data2_zero1 1 1 0" \
  "world2_zero3 1 1 0" "world2_zero3 2 1 1"; do
  read -r name ranks tensor zero <<<"$case"
  mkdir -p "$work/$name/checkpoints"
  rm -rf "$work/$name/checkpoints/step_00000010" && cp -r "$fixtures/$name" "$work/$name/checkpoints/step_00000010"
  run="$work/$name-at$ranks-t$tensor-z$zero"
  launch "$ranks" train --config config.json --run-dir "$run" --set dist.zero_stage="$zero" \
    --set dist.tensor_parallel="$tensor" --resume "$work/$name/checkpoints/step_00000010" >"$run.log" 2>&1 ||
    fail "$name at world size $ranks, tensor $tensor, ZeRO $zero: $(tail -n 3 "$run.log")"
  same_losses "$fixtures/$name/metrics.jsonl" "$run/metrics.jsonl" ||
    fail "$name at world size $ranks, tensor $tensor, ZeRO $zero: losses differ from the run that wrote it"
  pass "earlier version's $name checkpoint resumed at world size $ranks, tensor $tensor, ZeRO $zero: same losses"
done
echo "$passed passed, 0 failed"
