#!/usr/bin/env bash
# Pipeline parallelism on CPU ranks:
#  1. A 2-stage checkpoint resumed on one rank, and a one-rank checkpoint resumed in a 2-stage
#     pipeline (and in 2 stages x tensor parallel 2), continue the loss curve (1e-5 relative).
#     The interleaved schedule (2 stages x 2 chunks) gives the one-rank losses, and resumes from
#     and into one rank.
#  2. The stages' transfers in an update (metrics.jsonl): each stage but the last sends one
#     activation of (B T, C) floats per micro-batch, each but the first one gradient (per chunk
#     under the interleaved schedule); the log names the stage split.
#  3. A stage that stops answering mid-step stops the whole job within dist.timeout_s, and the
#     message names the stage and rank that never answered.
# Usage: pipeline_test.sh LLMTRAIN MPIEXEC
source "$(dirname "$0")/checkpoint_test_setup.sh"
config() {  # config FILE MAX_STEPS EVERY
  cat > "$1" <<JSON
{"model": {"vocab_size": 251, "context_length": 32, "n_layer": 4, "n_head": 4, "d_model": 32},
 "data": {"train": "$work/data/train_*.bin", "val": "$work/data/val_*.bin"},
 "train": {"micro_batch_size": 2, "global_batch_size": 8, "max_steps": $2, "log_every": 100000, "eval_every": 0,
           "eval_batches": 2},
 "optim": {"warmup_steps": 1, "lr": 0.003},
 "checkpoint": {"every": $3, "keep_last": 5}}
JSON
}

# 1. Resume across pipeline layouts.
config "$work/pp.json" 20 10
mpi 2 "$llmtrain" train --config "$work/pp.json" --run-dir "$work/p2ref" --set dist.pipeline_parallel=2 \
  >"$work/p2ref.log" 2>&1 || fail "2-stage run: $(tail -n 3 "$work/p2ref.log")"
grep -q "pipeline: 2 stages" "$work/p2ref.log" || fail "the log does not name the stage split: $(grep pipeline "$work/p2ref.log")"
"$llmtrain" train --config "$work/pp.json" --run-dir "$work/p2at1" --resume "$work/p2ref/checkpoints/step_00000010" \
  >"$work/p2at1.log" 2>&1 || fail "2-stage checkpoint on one rank: $(tail -n 3 "$work/p2at1.log")"
same_losses "$work/p2ref/metrics.jsonl" "$work/p2at1/metrics.jsonl" || fail "2-stage checkpoint on one rank: losses differ"
pass "2-stage checkpoint resumed on one rank: same losses"
"$llmtrain" train --config "$work/pp.json" --run-dir "$work/r1" >/dev/null 2>&1 || fail "one-rank run"
for layout in "2 1" "4 2"; do
  read -r ranks tensor <<<"$layout"
  run="$work/r1at$ranks"
  mpi "$ranks" "$llmtrain" train --config "$work/pp.json" --run-dir "$run" --set dist.pipeline_parallel=2 \
    --set dist.tensor_parallel="$tensor" --resume "$work/r1/checkpoints/step_00000010" >"$run.log" 2>&1 ||
    fail "one-rank checkpoint in 2 stages x tensor $tensor: $(tail -n 3 "$run.log")"
  same_losses "$work/r1/metrics.jsonl" "$run/metrics.jsonl" || fail "one-rank checkpoint in 2 stages x tensor $tensor: losses differ"
  pass "one-rank checkpoint resumed in 2 stages x tensor parallel $tensor: same losses"
done

# The interleaved schedule: 2 stages of 2 chunks (one layer each), 4 micro-batches per update.
interleaved=(--set dist.pipeline_parallel=2 --set dist.pipeline_schedule=interleaved --set dist.virtual_stages=2)
mpi 2 "$llmtrain" train --config "$work/pp.json" --run-dir "$work/i2ref" "${interleaved[@]}" >"$work/i2ref.log" 2>&1 ||
  fail "interleaved run: $(tail -n 3 "$work/i2ref.log")"
grep -q "interleaved" "$work/i2ref.log" || fail "the log does not name the interleaved schedule: $(grep pipeline "$work/i2ref.log")"
/usr/bin/python3 - "$work/r1/metrics.jsonl" "$work/i2ref/metrics.jsonl" <<'PY' || fail "interleaved run: losses differ from one rank's"
import json, sys
ref, got = ({l["step"]: l["loss"] for l in map(json.loads, open(f)) if "loss" in l} for f in sys.argv[1:])
assert sorted(got) == sorted(ref) == list(range(1, 21)), (sorted(ref), sorted(got))
worst = max(abs(got[s] - ref[s]) / abs(ref[s]) for s in got)
print(f"  interleaved against one rank, steps 1-20, largest relative difference {worst:.1e}")
assert worst <= 1e-5
PY
"$llmtrain" train --config "$work/pp.json" --run-dir "$work/i2at1" --resume "$work/i2ref/checkpoints/step_00000010" \
  >"$work/i2at1.log" 2>&1 || fail "interleaved checkpoint on one rank: $(tail -n 3 "$work/i2at1.log")"
same_losses "$work/r1/metrics.jsonl" "$work/i2at1/metrics.jsonl" || fail "interleaved checkpoint on one rank: losses differ"
mpi 2 "$llmtrain" train --config "$work/pp.json" --run-dir "$work/r1ati2" "${interleaved[@]}" \
  --resume "$work/r1/checkpoints/step_00000010" >"$work/r1ati2.log" 2>&1 ||
  fail "one-rank checkpoint interleaved: $(tail -n 3 "$work/r1ati2.log")"
same_losses "$work/r1/metrics.jsonl" "$work/r1ati2/metrics.jsonl" || fail "one-rank checkpoint interleaved: losses differ"
pass "interleaved (2 stages x 2 chunks): the one-rank losses, and resume from and into one rank"

# 2. Transfers per update: 4 micro-batches of (2 x 32, 32) f32 activations.
config "$work/comm.json" 2 0
for stages in 2 4; do
  mpi "$stages" "$llmtrain" train --config "$work/comm.json" --run-dir "$work/comm$stages" --set dist.pipeline_parallel="$stages" \
    >"$work/comm$stages.log" 2>&1 || fail "communication run, $stages stages: $(tail -n 3 "$work/comm$stages.log")"
done
# stage0_transfers RUN N: rank 0 (the first stage) sent N transfers of one (2 x 32, 32) f32
# tensor each at step 2 and started N receives; with a tied embedding (GPT-2), one more of each:
# its (V, C) f32 gradients exchanged with the last stage over the same device link, not through
# the host. Its pipeline transfers are not in "collectives" (the data group); the metrics count
# them apart.
stage0_transfers() {
  /usr/bin/python3 - "$1/metrics.jsonl" "$2" "$1/config.json" <<'PY'
import json, sys
step = [l for l in map(json.loads, open(sys.argv[1])) if l.get("step") == 2 and "loss" in l][0]
n = int(sys.argv[2])
model = json.load(open(sys.argv[3]))["model"]
tied = model["vocab_size"] * model["d_model"] * 4 if model.get("tie_embeddings", model["arch"] == "gpt2") else 0
extra = 1 if tied else 0
sent = step["pipeline_collectives"]
print(f"  stage 0: {sent}")
assert sent["send"] == [n + extra, n * 64 * 32 * 4 + tied], sent
assert sent["recv"][0] == n + extra, sent
assert "all-reduce" not in sent or sent["all-reduce"][1] < 64, sent  # the loss only, no embedding
PY
}
# 1F1B: each micro-batch's activation sent, its gradient received.
stage0_transfers "$work/comm2" 4 || fail "transfers per update"
pass "stage 0 sends one (B T, C) activation and receives one gradient per micro-batch"
mpi 2 "$llmtrain" train --config "$work/comm.json" --run-dir "$work/commi" "${interleaved[@]}" >"$work/commi.log" 2>&1 ||
  fail "communication run, interleaved: $(tail -n 3 "$work/commi.log")"
# Stage 0 holds virtual stages 0 and 2 of 4: both send their activations on (8) and virtual
# stage 2 its input gradients back (4); it receives virtual stage 2's inputs (4) and both
# chunks' output gradients (8).
stage0_transfers "$work/commi" 12 || fail "interleaved transfers per update"
pass "interleaved: stage 0 sends 2 activations and 1 gradient per micro-batch (its 2 chunks)"

# 3. A stage that stops answering stops the job within dist.timeout_s, naming it.
config "$work/hang.json" 100000 0
mpi 2 "$llmtrain" train --config "$work/hang.json" --run-dir "$work/hang" --set dist.pipeline_parallel=2 \
  --set dist.timeout_s=3 >"$work/hang.log" 2>&1 &
job=$!
for _ in $(seq 1 200); do [[ -s "$work/hang/metrics.jsonl" ]] && break; sleep 0.05; done
victim=$(pgrep -f "run-dir $work/hang" | while read -r pid; do
  [[ "$(tr '\0' ' ' < /proc/$pid/cmdline)" == *llmtrain\ train* ]] && grep -q OMPI_COMM_WORLD_RANK=1 /proc/$pid/environ 2>/dev/null && echo "$pid"
done | head -n 1)
[[ -n "$victim" ]] || fail "no rank-1 process to stop"
kill -STOP "$victim"
start=$(date +%s)
wait "$job"; status=$?
elapsed=$(( $(date +%s) - start ))
kill -CONT "$victim" 2>/dev/null
(( status != 0 && elapsed < 60 )) || fail "job with a stopped stage: exit $status after $elapsed s"
# A transfer names the peer ("stage 1 (rank 1)"), a collective the missing rank ("rank(s) 1 (stage 1)").
grep -Eq "stage 1 \(rank 1\)|rank\(s\) 1 \(stage 1\)" "$work/hang.log" ||
  fail "the message does not name stage 1 and rank 1: $(grep -i error "$work/hang.log" | head -n 3)"
pass "a stopped stage ends the job in $elapsed s (dist.timeout_s 3) with a message naming stage 1 and rank 1"

echo "$passed passed, 0 failed"
