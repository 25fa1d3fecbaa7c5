#!/usr/bin/env bash
# Fully sharded data parallelism (ZeRO 3) on CPU ranks:
#  1. A world-size-4 ZeRO-3 checkpoint resumed at world size 1 (ZeRO 0), 2 (ZeRO 1) and 2 (ZeRO 3,
#     layers kept gathered), and a world-size-2 ZeRO-1 checkpoint resumed under ZeRO 3 at world
#     size 4, continue the loss curve of the run that wrote them (1e-5 relative).
#  2. SIGKILL at random moments of a world-size-2 ZeRO-3 run, resumed each time: the final weights,
#     optimizer state and losses are bit-identical to an uninterrupted run.
#  3. Communication: the collectives of one update (their count and the bytes this rank sends, as
#     metrics.jsonl reports them) are those the algorithm needs, computed here by hand from the
#     model's shapes: per micro-step and layer one all-gather in forward, one in backward (none
#     when the layers stay gathered; none in forward for the first layer after the first
#     micro-step: it stays gathered) and one reduce-scatter; ring volumes (n-1)/n S and 2 (n-1)/n S.
#  4. Memory: the weights, gradients and optimizer state a rank holds (state_bytes) fall with the
#     data-parallel size and stay within what `llmtrain plan` says for ZeRO 3.
# Usage: zero3_test.sh LLMTRAIN MPIEXEC
source "$(dirname "$0")/checkpoint_test_setup.sh"
config() {  # config FILE MAX_STEPS EVERY ZERO [MODEL]
  local model=${5:-'{"vocab_size": 256, "context_length": 32, "n_layer": 3, "n_head": 2, "d_model": 32}'}
  cat > "$1" <<JSON
{"model": $model,
 "data": {"train": "$work/data/train_*.bin", "val": "$work/data/val_*.bin"},
 "train": {"micro_batch_size": 2, "global_batch_size": 8, "max_steps": $2, "log_every": 100000, "eval_every": 0,
           "eval_batches": 2},
 "optim": {"warmup_steps": 10},
 "dist": {"zero_stage": $4},
 "checkpoint": {"every": $3, "keep_last": 5}}
JSON
}

# 1. Resume across world sizes and ZeRO stages.
config "$work/z3.json" 20 10 3
mpi 4 "$llmtrain" train --config "$work/z3.json" --run-dir "$work/z3ref" >"$work/z3ref.log" 2>&1 ||
  fail "world size 4 ZeRO 3 run: $(tail -n 3 "$work/z3ref.log")"
for target in "1 0 true" "2 1 true" "2 3 false"; do
  read -r ranks zero reshard <<<"$target"
  run="$work/z3at${ranks}z$zero"
  launch "$ranks" train --config "$work/z3.json" --run-dir "$run" --set dist.zero_stage="$zero" \
    --set dist.reshard_after_forward="$reshard" --resume "$work/z3ref/checkpoints/step_00000010" >"$run.log" 2>&1 ||
    fail "resume at world size $ranks, ZeRO $zero: $(tail -n 3 "$run.log")"
  same_losses "$work/z3ref/metrics.jsonl" "$run/metrics.jsonl" ||
    fail "world-size-4 ZeRO-3 checkpoint at world size $ranks, ZeRO $zero: losses differ"
  pass "world-size-4 ZeRO-3 checkpoint resumed at world size $ranks, ZeRO $zero (reshard_after_forward $reshard): same losses"
done
config "$work/z1.json" 20 10 1
mpi 2 "$llmtrain" train --config "$work/z1.json" --run-dir "$work/z1ref" >/dev/null 2>&1 || fail "world size 2 ZeRO 1 run"
mpi 4 "$llmtrain" train --config "$work/z1.json" --run-dir "$work/z1at4z3" --set dist.zero_stage=3 \
  --resume "$work/z1ref/checkpoints/step_00000010" >"$work/z1at4z3.log" 2>&1 || fail "ZeRO-1 checkpoint under ZeRO 3"
same_losses "$work/z1ref/metrics.jsonl" "$work/z1at4z3/metrics.jsonl" || fail "ZeRO-1 checkpoint under ZeRO 3: losses differ"
pass "world-size-2 ZeRO-1 checkpoint resumed under ZeRO 3 at world size 4: same losses"

# 2. SIGKILL at random moments, resumed each time.
config "$work/kill.json" 3000 3 3
mpi 2 "$llmtrain" train --config "$work/kill.json" --run-dir "$work/killref" >/dev/null 2>&1 || fail "reference run"
kills=0
RANDOM=7
while true; do
  mpi 2 "$llmtrain" train --config "$work/kill.json" --run-dir "$work/killed" >>"$work/killed.log" 2>&1 &
  job=$!
  if (( kills < 8 )); then
    sleep "0.$(( (RANDOM % 40) + 20 ))"
    if kill -0 "$job" 2>/dev/null; then
      pkill -KILL -f "run-dir $work/killed" 2>/dev/null
      kill -KILL "$job" 2>/dev/null
      wait "$job" 2>/dev/null
      kills=$((kills + 1))
      continue
    fi
  fi
  wait "$job" || fail "resumed run failed: $(tail -n 5 "$work/killed.log")"
  break
done
(( kills >= 6 )) || fail "only $kills kills before the run finished"
same_files "$work/killref" "$work/killed" || fail "weights or optimizer state after $kills kills differ from the uninterrupted run"
[[ "$(grep -o '"loss":[^,}]*' "$work/killref/metrics.jsonl")" == "$(grep -o '"loss":[^,}]*' "$work/killed/metrics.jsonl")" ]] ||
  fail "loss curve differs after $kills kills"
pass "world size 2, ZeRO 3: SIGKILL $kills times, resumed each time: weights, optimizer state and losses bit-identical"

# 3. The collectives of an update, against the algorithm's count and ring volumes.
llama='{"arch": "llama", "vocab_size": 256, "context_length": 32, "n_layer": 3, "n_head": 4, "n_kv_head": 2, "d_model": 32, "ffn_hidden": 40}'
for case in "gpt2 2 3 true" "gpt2 4 3 true" "gpt2 2 3 false" "llama 2 3 true" "gpt2 2 0 true" "gpt2 2 1 true"; do
  read -r arch ranks zero reshard <<<"$case"
  model='{"vocab_size": 256, "context_length": 32, "n_layer": 3, "n_head": 2, "d_model": 32}'
  [[ "$arch" == llama ]] && model="$llama"
  config "$work/comm.json" 2 0 "$zero" "$model"
  sed -i 's/"warmup_steps": 10/"warmup_steps": 1/' "$work/comm.json"
  run="$work/comm-$arch-$ranks-$zero-$reshard"
  mpi "$ranks" "$llmtrain" train --config "$work/comm.json" --run-dir "$run" \
    --set dist.reshard_after_forward="$reshard" >"$run.log" 2>&1 || fail "communication run $case: $(tail -n 3 "$run.log")"
  /usr/bin/python3 - "$run/metrics.jsonl" "$arch" "$ranks" "$zero" "$reshard" <<'PY' || fail "communication of $case"
import json, sys
metrics, arch, W, zero, reshard = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "true"
step = [l for l in map(json.loads, open(metrics)) if l.get("step") == 2 and "loss" in l][0]
got = {k: (v[0], v[1]) for k, v in step["collectives"].items()}
# The model's units from its shapes: GPT-2 (ln_f | each layer | wpe, wte), Llama (norm, untied head | each layer | embed).
V, T, L, C = 256, 32, 3, 32
if arch == "gpt2":
    F = 4 * C
    layer = 2 * C + (3 * C * C + 3 * C) + (C * C + C) + 2 * C + (F * C + F) + (C * F + C)
    roots = [2 * C, T * C + V * C]
else:
    F, NH, NKV, HS = 40, 4, 2, 8
    layer = C + NH * HS * C + 2 * NKV * HS * C + C * NH * HS + C + 3 * F * C
    roots = [V * C + C, V * C]
P = L * layer + sum(roots)
micro = 8 // (2 * W)
share = (W - 1) / W
ceil = lambda n: -(-n // W)
expect = {}
if zero == 3:
    gathers_per_layer = 2 if reshard else 1
    # The first layer stays gathered from one micro-step's backward to the next one's forward.
    layer_gathers = micro * L * gathers_per_layer - (micro - 1)
    expect["all-gather"] = (layer_gathers + len(roots),
                            share * W * 4 * (layer_gathers * ceil(layer) + sum(ceil(r) for r in roots)))
    expect["reduce-scatter"] = (micro * (L + len(roots)), micro * share * W * 4 * (L * ceil(layer) + sum(ceil(r) for r in roots)))
    expect["all-reduce"] = (1, 2 * share * 16)  # the loss and the squared norm, two doubles
elif zero == 0:
    # gradient buckets of dist.bucket_mb (25 MiB: one here), then the loss (one double)
    expect["all-reduce"] = (2, 2 * share * (4 * P + 8))
else:
    expect["reduce-scatter"] = (1, share * W * 4 * ceil(P))
    expect["all-gather"] = (1, share * W * 4 * ceil(P))
    expect["all-reduce"] = (1, 2 * share * 16)
for kind in sorted(set(expect) | set(got)):
    print(f"  {kind}: {got.get(kind)} expected {expect.get(kind)}")
assert set(got) == set(expect), (got, expect)
for kind, (calls, sent) in expect.items():
    assert got[kind][0] == calls and abs(got[kind][1] - sent) < 1e-6 * sent, (kind, got[kind], calls, sent)
PY
  pass "$arch, world size $ranks, ZeRO $zero (reshard_after_forward $reshard): collectives and bytes of an update as the algorithm needs"
done

# 4. Memory per rank: state_bytes at data-parallel sizes 1, 2 and 4, against `plan`.
model='{"vocab_size": 256, "context_length": 32, "n_layer": 6, "n_head": 4, "d_model": 64}'
for ranks in 1 2 4; do
  config "$work/mem.json" 1 0 3 "$model"
  sed -i 's/"warmup_steps": 10/"warmup_steps": 1/' "$work/mem.json"
  launch "$ranks" train --config "$work/mem.json" --run-dir "$work/mem$ranks" >"$work/mem$ranks.log" 2>&1 ||
    fail "memory run at world size $ranks: $(tail -n 3 "$work/mem$ranks.log")"
  "$llmtrain" plan --config "$work/mem.json" --world-size "$ranks" >"$work/plan$ranks.txt" 2>&1 || fail "plan at world size $ranks"
done
/usr/bin/python3 - "$work" <<'PY' || fail "memory per rank"
import json, re, sys
work = sys.argv[1]
units = {"B": 1, "KiB": 1024, "MiB": 1024 ** 2, "GiB": 1024 ** 3}
def plan_state(ranks):  # weights + gradients + optimizer + gathered of plan's "fp32 ZeRO 3" row
    row = [l for l in open(f"{work}/plan{ranks}.txt") if l.startswith("fp32 ZeRO 3")][0]
    sizes = re.findall(r"([0-9.]+) (B|KiB|MiB|GiB)", row)
    return sum(float(v) * units[u] for v, u in sizes[:4])
measured = {}
for ranks in (1, 2, 4):
    step = [l for l in map(json.loads, open(f"{work}/mem{ranks}/metrics.jsonl")) if "state_bytes" in l][0]
    measured[ranks] = step["state_bytes"]
    planned = plan_state(ranks)
    print(f"  data-parallel size {ranks}: state {measured[ranks]} bytes, plan {planned:.0f}")
    assert abs(measured[ranks] - planned) <= 0.005 * planned, (ranks, measured[ranks], planned)
# The sharded part (16 bytes a parameter: weights, gradients, m, v) halves with each doubling; the
# rest (units outside the layers and two layers' slots, gathered) does not shrink.
P = 6 * (12 * 64 * 64 + 13 * 64) + 2 * 64 + 32 * 64 + 256 * 64
for a, b in ((1, 2), (2, 4)):
    saved = measured[a] - measured[b]
    print(f"  {a} -> {b} ranks: {saved} bytes fewer, 16 P (1/{a} - 1/{b}) = {16 * P * (1 / a - 1 / b):.0f}")
    assert saved >= 0.8 * 16 * P * (1 / a - 1 / b), saved
PY
pass "ZeRO 3 state per rank at data-parallel sizes 1, 2, 4 as plan says (0.5%), its sharded part falling as 1/size"

echo "$passed passed, 0 failed"
