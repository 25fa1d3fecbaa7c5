#!/usr/bin/env bash
# Context parallelism on CPU ranks (fp32, 10 updates, GPT-2 and Llama with grouped-query attention):
#  1. Context parallel 2 and 4 alone, 2 x tensor parallel 2, 2 x data 2 under ZeRO 3 and
#     2 x pipeline 2 log the one-rank run's losses (1e-5) and end with its weights (1e-4); the
#     all-gather variant gives the ring's to rounding (1e-6, 1e-5).
#     bf16 with full recomputation at context parallel 2 gives one rank's to bf16 rounding.
#  2. A context-parallel-4 checkpoint resumed on one rank, and a one-rank checkpoint resumed at
#     context parallel 4, continue the one-rank loss curve (1e-5 relative); eval at context
#     parallel 2 prints the one-rank validation loss.
#  3. Communication: what each rank sends its context group in one update (metrics.jsonl), against
#     the formula: per micro-step and layer, forward CP-1 key/value blocks of B T/CP 2 NKV HS
#     elements, backward CP-1 blocks again and CP-1 f32 blocks of their gradients (ring); an
#     all-gather of the blocks in forward and in backward and a reduce-scatter of their gradients
#     (all-gather variant, ring volumes (n-1)/n S).
#  4. A sequence length that does not split into 2 x CP chunks is a config error naming both keys.
# Usage: context_parallel_test.sh LLMTRAIN MPIEXEC
source "$(dirname "$0")/checkpoint_test_setup.sh"
gpt2='{"vocab_size": 256, "context_length": 32, "n_layer": 2, "n_head": 4, "d_model": 32}'
llama='{"arch": "llama", "vocab_size": 256, "context_length": 32, "n_layer": 2, "n_head": 4, "n_kv_head": 2, "d_model": 32, "ffn_hidden": 40}'
config() {  # config FILE MAX_STEPS EVERY MODEL
  cat > "$1" <<JSON
{"model": $4,
 "data": {"train": "$work/data/train_*.bin", "val": "$work/data/val_*.bin"},
 "train": {"micro_batch_size": 2, "global_batch_size": 8, "max_steps": $2, "log_every": 100000, "eval_every": 5,
           "eval_batches": 2},
 "optim": {"warmup_steps": 1},
 "checkpoint": {"every": $3, "keep_last": 5}}
JSON
}
# same_run REF GOT LOSS_TOL WEIGHT_TOL: the same losses (and validation losses) step by step, and
# final weights within the tolerances (absolute).
same_run() {
  /usr/bin/python3 - "$@" "$llmtrain" <<'PY'
import json, os, struct, subprocess, sys
import numpy as np
ref, got, loss_tol, weight_tol = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
llmtrain = sys.argv[5]
def losses(run):
    return {(l["step"], k): l[k] for l in map(json.loads, open(f"{run}/metrics.jsonl")) for k in ("loss", "val_loss") if k in l}
a, b = losses(ref), losses(got)
assert sorted(a) == sorted(b) and len(a) >= 10, (sorted(a), sorted(b))
worst_loss = max(abs(a[k] - b[k]) for k in a)
def weights(run):
    # The whole model as one file, whichever ranks wrote which ranges of it.
    folder = f"{run}.weights"
    if not os.path.exists(f"{folder}/model.safetensors"):
        subprocess.run([llmtrain, "export", "--checkpoint", run, "--output", folder], check=True, capture_output=True)
    raw = open(f"{folder}/model.safetensors", "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        assert info["dtype"] == "F32", info
        lo, hi = info["data_offsets"]
        out[name] = np.frombuffer(raw[8 + n + lo:8 + n + hi], dtype=np.float32)
    return out
wa, wb = weights(ref), weights(got)
assert sorted(wa) == sorted(wb)
worst_weight = max(float(np.max(np.abs(wa[k] - wb[k]))) for k in wa)
print(f"  largest loss difference {worst_loss:.1e}, largest weight difference {worst_weight:.1e}")
assert worst_loss <= loss_tol and worst_weight <= weight_tol
PY
}

# 1. Equality with one rank.
for arch in gpt2 llama; do
  model=${!arch}
  config "$work/$arch.json" 10 0 "$model"
  "$llmtrain" train --config "$work/$arch.json" --run-dir "$work/$arch-one" >"$work/$arch-one.log" 2>&1 ||
    fail "$arch one rank: $(tail -n 3 "$work/$arch-one.log")"
  sp=false
  [[ "$arch" == llama ]] && sp=true
  for case in "2 cp2 2 1 1 0" "4 cp4 4 1 1 0" "4 cp2-tp2 2 2 1 0" "4 cp2-dp2-zero3 2 1 1 3" "4 cp2-pp2 2 1 2 0"; do
    read -r ranks name cp tp pp zero <<<"$case"
    run="$work/$arch-$name"
    mpi "$ranks" "$llmtrain" train --config "$work/$arch.json" --run-dir "$run" --set dist.context_parallel="$cp" \
      --set dist.tensor_parallel="$tp" --set dist.sequence_parallel="$sp" --set dist.pipeline_parallel="$pp" \
      --set dist.zero_stage="$zero" >"$run.log" 2>&1 || fail "$arch $name: $(tail -n 3 "$run.log")"
    same_run "$work/$arch-one" "$run" 1e-5 1e-4 || fail "$arch $name: losses or weights differ from one rank"
    pass "$arch, $name on $ranks ranks: the one-rank losses and weights"
  done
  run="$work/$arch-cp4-allgather"
  mpi 4 "$llmtrain" train --config "$work/$arch.json" --run-dir "$run" --set dist.context_parallel=4 \
    --set dist.context_parallel_mode=allgather >"$run.log" 2>&1 || fail "$arch allgather: $(tail -n 3 "$run.log")"
  same_run "$work/$arch-cp4" "$run" 1e-6 1e-5 || fail "$arch: allgather differs from ring"
  pass "$arch, context parallel 4: the all-gather variant gives the ring's losses and weights to rounding"
done

# bf16 with the whole layer recomputed in backward: the one-rank run's losses to bf16 rounding.
config "$work/bf16.json" 10 0 "$llama"
for ranks in 1 2; do
  launch "$ranks" train --config "$work/bf16.json" --run-dir "$work/bf16-$ranks" --set dist.context_parallel="$ranks" \
    --set train.precision=bf16 --set train.recompute=full >"$work/bf16-$ranks.log" 2>&1 ||
    fail "bf16 at context parallel $ranks: $(tail -n 3 "$work/bf16-$ranks.log")"
done
same_run "$work/bf16-1" "$work/bf16-2" 2e-4 2e-3 || fail "bf16 with full recomputation: context parallel 2 differs from one rank"
pass "llama, bf16 and full recomputation at context parallel 2: the one-rank losses and weights to bf16 rounding"

# 2. Resume across context-parallel sizes.
config "$work/resume.json" 20 10 "$llama"
"$llmtrain" train --config "$work/resume.json" --run-dir "$work/one20" >/dev/null 2>&1 || fail "one-rank 20 updates"
mpi 4 "$llmtrain" train --config "$work/resume.json" --run-dir "$work/cp4-20" --set dist.context_parallel=4 \
  >"$work/cp4-20.log" 2>&1 || fail "context parallel 4, 20 updates: $(tail -n 3 "$work/cp4-20.log")"
"$llmtrain" train --config "$work/resume.json" --run-dir "$work/cp4at1" --resume "$work/cp4-20/checkpoints/step_00000010" \
  >"$work/cp4at1.log" 2>&1 || fail "context-parallel-4 checkpoint on one rank: $(tail -n 3 "$work/cp4at1.log")"
same_losses "$work/one20/metrics.jsonl" "$work/cp4at1/metrics.jsonl" || fail "context-parallel-4 checkpoint on one rank: losses differ"
pass "context-parallel-4 checkpoint resumed on one rank: the one-rank loss curve"
mpi 4 "$llmtrain" train --config "$work/resume.json" --run-dir "$work/oneat4" --set dist.context_parallel=4 \
  --resume "$work/one20/checkpoints/step_00000010" >"$work/oneat4.log" 2>&1 ||
  fail "one-rank checkpoint at context parallel 4: $(tail -n 3 "$work/oneat4.log")"
same_losses "$work/one20/metrics.jsonl" "$work/oneat4/metrics.jsonl" || fail "one-rank checkpoint at context parallel 4: losses differ"
pass "one-rank checkpoint resumed at context parallel 4: the one-rank loss curve"

# eval of a checkpoint at context parallel 2, alone and with data 2: the one-rank validation loss.
one=$("$llmtrain" eval --checkpoint "$work/one20" 2>&1 | tail -n 1)
for ranks in 2 4; do
  got=$(mpi "$ranks" "$llmtrain" eval --checkpoint "$work/one20" --context-parallel 2 2>&1 | tail -n 1)
  [[ "$got" == "$one" && "$one" == *val_loss* ]] || fail "eval at world size $ranks, context parallel 2: '$got', one rank: '$one'"
done
pass "eval at context parallel 2 (world size 2 and 4) prints the one-rank validation loss"

# 3. The context group's traffic in an update, against the formula.
for case in "gpt2 2 ring" "gpt2 4 ring" "llama 2 ring" "llama 4 ring" "llama 4 allgather"; do
  read -r arch cp mode <<<"$case"
  model=${!arch}
  config "$work/comm.json" 2 0 "$model"
  run="$work/comm-$arch-$cp-$mode"
  mpi "$cp" "$llmtrain" train --config "$work/comm.json" --run-dir "$run" --set dist.context_parallel="$cp" \
    --set dist.context_parallel_mode="$mode" >"$run.log" 2>&1 || fail "communication run $case: $(tail -n 3 "$run.log")"
  /usr/bin/python3 - "$run/metrics.jsonl" "$cp" "$arch" "$mode" <<'PY' || fail "context-group traffic of $case"
import json, sys
metrics, n, arch, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
step = [l for l in map(json.loads, open(metrics)) if l.get("step") == 2 and "loss" in l][0]
got = {k: (v[0], v[1]) for k, v in step["context_collectives"].items()}
L, B, T, HS = 2, 2, 32, 8
NKV = 4 if arch == "gpt2" else 2
micro = 8 // B                     # one data-parallel rank: the whole batch in micro-steps of B
block = B * (T // n) * 2 * NKV * HS  # one rank's keys and values of one layer (elements)
if mode == "ring":
    # forward: n-1 blocks (fp32); backward: n-1 blocks and n-1 f32 gradient blocks
    sends = micro * L * 3 * (n - 1)
    expect = {"send": (sends, micro * L * (n - 1) * block * (4 + 4 + 4)), "recv": (sends, 0.0)}
else:
    share = (n - 1) / n
    expect = {"all-gather": (micro * L * 2, micro * L * 2 * share * n * block * 4),
              "reduce-scatter": (micro * L, micro * L * share * n * block * 4)}
print(f"  context group: {got} expected {expect}")
assert set(got) == set(expect), (got, expect)
for kind, (calls, sent) in expect.items():
    assert got[kind][0] == calls and abs(got[kind][1] - sent) <= 1e-6 * max(sent, 1), (kind, got, expect)
PY
  pass "$arch, context parallel $cp ($mode): the context group's bytes per layer as the formula"
done

# 4. A sequence that does not split into 2 x CP chunks.
config "$work/bad.json" 1 0 "$gpt2"
out=$("$llmtrain" train --config "$work/bad.json" --run-dir "$work/bad" --set dist.context_parallel=3 2>&1); status=$?
(( status == 2 )) && grep -q "dist.context_parallel" <<<"$out" && grep -q "model.context_length" <<<"$out" ||
  fail "context_length 32 at context parallel 3: exit $status: $out"
[[ ! -e "$work/bad/metrics.jsonl" ]] || fail "the refused run wrote metrics"
pass "a context length that does not split into 2 x dist.context_parallel chunks: exit 2 naming both keys"

echo "$passed passed, 0 failed"
