#!/usr/bin/env bash
# Tensor parallelism on CPU ranks:
#  1. A tensor-parallel-2 x data-2 ZeRO-1 checkpoint resumed with tensor parallelism 1 (one rank),
#     4 (ZeRO 0) and 2 (ZeRO 3), and a one-rank-layout checkpoint (data 2, ZeRO 1) resumed with
#     tensor parallelism 2, continue the loss curve of the run that wrote them (1e-5 relative).
#  2. Communication: the tensor group's collectives in one update, their count and the bytes this
#     rank sends (metrics.jsonl), against Megatron's: per layer and micro-step two all-reduces of
#     the (B T, C) activations in forward and two in backward; the embedding's one; the
#     vocabulary-parallel cross-entropy's max (N) and sums (2 N) and the head's input gradient;
#     and the gradient norm's one (a double); with key/value heads replicated (Llama, size above
#     n_kv_head), one more per layer in backward for their gradients. Ring volumes: 2 (n-1)/n S.
#  3. Memory: the weights, gradients and optimizer state a rank holds fall as 1/size for the
#     split parameters (the norms, GPT-2's position embedding and biases of the row-parallel
#     projections stay whole).
# Usage: tensor_parallel_test.sh LLMTRAIN MPIEXEC
source "$(dirname "$0")/checkpoint_test_setup.sh"
config() {  # config FILE MAX_STEPS EVERY [MODEL]
  local model=${4:-'{"vocab_size": 251, "context_length": 32, "n_layer": 3, "n_head": 4, "d_model": 32}'}
  cat > "$1" <<JSON
{"model": $model,
 "data": {"train": "$work/data/train_*.bin", "val": "$work/data/val_*.bin"},
 "train": {"micro_batch_size": 2, "global_batch_size": 8, "max_steps": $2, "log_every": 100000, "eval_every": 0,
           "eval_batches": 2},
 "optim": {"warmup_steps": 1},
 "checkpoint": {"every": $3, "keep_last": 5}}
JSON
}

# 1. Resume across tensor-parallel sizes.
config "$work/tp.json" 20 10
mpi 4 "$llmtrain" train --config "$work/tp.json" --run-dir "$work/t2ref" --set dist.tensor_parallel=2 \
  --set dist.zero_stage=1 >"$work/t2ref.log" 2>&1 || fail "tensor 2 x data 2 run: $(tail -n 3 "$work/t2ref.log")"
for target in "1 1 0" "4 4 0" "4 2 3"; do
  read -r ranks tensor zero <<<"$target"
  run="$work/t2at${ranks}t${tensor}z$zero"
  launch "$ranks" train --config "$work/tp.json" --run-dir "$run" --set dist.tensor_parallel="$tensor" \
    --set dist.zero_stage="$zero" --resume "$work/t2ref/checkpoints/step_00000010" >"$run.log" 2>&1 ||
    fail "resume at world size $ranks, tensor parallel $tensor: $(tail -n 3 "$run.log")"
  same_losses "$work/t2ref/metrics.jsonl" "$run/metrics.jsonl" || fail "tensor-2 checkpoint at tensor parallel $tensor: losses differ"
  pass "tensor-2 x data-2 ZeRO-1 checkpoint resumed with tensor parallel $tensor (world size $ranks, ZeRO $zero): same losses"
done
mpi 2 "$llmtrain" train --config "$work/tp.json" --run-dir "$work/d2ref" --set dist.zero_stage=1 >/dev/null 2>&1 ||
  fail "data 2 run"
mpi 2 "$llmtrain" train --config "$work/tp.json" --run-dir "$work/d2at2" --set dist.tensor_parallel=2 \
  --resume "$work/d2ref/checkpoints/step_00000010" >"$work/d2at2.log" 2>&1 || fail "data-2 checkpoint under tensor parallel 2"
same_losses "$work/d2ref/metrics.jsonl" "$work/d2at2/metrics.jsonl" || fail "data-2 checkpoint under tensor parallel 2: losses differ"
pass "data-2 ZeRO-1 checkpoint resumed with tensor parallel 2: same losses"

# eval of a checkpoint: one rank, data-parallel ranks, and tensor parallel 2 x data 2.
one=$("$llmtrain" eval --checkpoint "$work/t2ref" 2>&1 | tail -n 1)
for ranks_tensor in "2 1" "4 2" "2 2"; do
  read -r ranks tensor <<<"$ranks_tensor"
  got=$(mpi "$ranks" "$llmtrain" eval --checkpoint "$work/t2ref" --tensor-parallel "$tensor" 2>&1 | tail -n 1)
  [[ "$got" == "$one" && "$one" == *val_loss* ]] || fail "eval at world size $ranks, tensor parallel $tensor: '$got', one rank: '$one'"
done
out=$("$llmtrain" eval --checkpoint "$work/t2ref" --tensor-parallel 2 2>&1); status=$?
(( status == 2 )) && [[ "$(grep -c 'llmtrain: error: --tensor-parallel 2: must divide' <<<"$out")" == 1 ]] ||
  fail "eval --tensor-parallel 2 on one rank: exit $status: $out"
pass "eval under mpirun (data 2, tensor 2 x data 2, tensor 2) prints the one-rank validation loss; a tensor size that does not divide the ranks exits 2"

# 2. The tensor group's collectives in an update, against Megatron's count and ring volumes.
llama='{"arch": "llama", "vocab_size": 251, "context_length": 32, "n_layer": 3, "n_head": 4, "n_kv_head": 2, "d_model": 32, "ffn_hidden": 40}'
for case in "gpt2 2 2 false" "gpt2 4 4 false" "gpt2 4 2 false" "llama 2 2 false" "llama 4 2 false" "llama 4 4 false" \
            "gpt2 2 2 true" "gpt2 4 2 true" "llama 4 4 true"; do
  read -r arch ranks tensor sp <<<"$case"
  model=""
  [[ "$arch" == llama ]] && model="$llama"
  config "$work/comm.json" 2 0 "$model"
  run="$work/comm-$arch-$ranks-$tensor"
  run="$run-$sp"
  mpi "$ranks" "$llmtrain" train --config "$work/comm.json" --run-dir "$run" --set dist.tensor_parallel="$tensor" \
    --set dist.sequence_parallel="$sp" >"$run.log" 2>&1 || fail "communication run $case: $(tail -n 3 "$run.log")"
  /usr/bin/python3 - "$run/metrics.jsonl" "$ranks" "$tensor" "$arch" "$sp" <<'PY' || fail "tensor-group communication of $case"
import json, sys
metrics, W, n, arch, sp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5] == "true"
step = [l for l in map(json.loads, open(metrics)) if l.get("step") == 2 and "loss" in l][0]
got = {k: (v[0], v[1]) for k, v in step["tensor_collectives"].items()}
L, C, B, T = 3, 32, 2, 32
micro = 8 // (B * (W // n))
tokens = B * T
ring = 2 * (n - 1) / n
NKV, HS = 2, 8
norm = 2 * C if arch == "gpt2" else C  # a norm's weight (and bias)
share = (n - 1) / n
act = tokens * C * 4
if not sp:
    calls = 1 + 4 * L + 3       # embedding; 2 + 2 per layer; max, sums, head's input gradient
    sent = ring * (act * (1 + 4 * L + 1) + 4 * tokens + 4 * 2 * tokens)
    per_micro = {"all-reduce": [calls, sent]}
else:
    # Sequence parallelism: all-gathers before the split matmuls (in backward also of the output
    # gradients and, again, of their inputs), reduce-scatters after them, the norms' weight
    # gradients all-reduced, and the cross-entropy's max and sums.
    per_micro = {"all-gather": [6 * L + 2, share * act * (6 * L + 2)],
                 "reduce-scatter": [4 * L + 2, share * act * (4 * L + 2)],
                 "all-reduce": [2 + 2 * L + 1, ring * (4 * tokens + 4 * 2 * tokens + 4 * norm * (2 * L + 1))]}
if arch == "llama" and n > NKV:  # replicated key/value heads: their k and v gradients, one slot per head
    per_micro["all-reduce"][0] += L
    per_micro["all-reduce"][1] += ring * 4 * L * NKV * 2 * HS * C
expect = {k: (micro * c, micro * b) for k, (c, b) in per_micro.items()}
calls, sent = expect["all-reduce"]
expect["all-reduce"] = (calls + 1, sent + ring * 8)  # + the gradient norm (a double) per update
print(f"  tensor group: {got} expected {expect}")
assert set(got) == set(expect), (got, expect)
for kind, (calls, sent) in expect.items():
    assert got[kind][0] == calls and abs(got[kind][1] - sent) < 1e-6 * sent, (kind, got, expect)
PY
  pass "$arch, world size $ranks, tensor parallel $tensor, sequence parallel $sp: the tensor group's collectives of an update as Megatron's"
done

# 3. Memory per rank at tensor-parallel sizes 1, 2 and 4.
config "$work/mem.json" 1 0 '{"vocab_size": 256, "context_length": 32, "n_layer": 4, "n_head": 4, "d_model": 64}'
for tensor in 1 2 4; do
  launch "$tensor" train --config "$work/mem.json" --run-dir "$work/mem$tensor" --set dist.tensor_parallel="$tensor" \
    >"$work/mem$tensor.log" 2>&1 || fail "memory run at tensor parallel $tensor: $(tail -n 3 "$work/mem$tensor.log")"
done
/usr/bin/python3 - "$work" <<'PY' || fail "memory per rank"
import json, sys
work = sys.argv[1]
C, L, V, T, F = 64, 4, 256, 32, 256
whole_per_layer = 2 * C + 2 * C + C + C        # ln_1, ln_2 (weight, bias); the two row-parallel biases
split_per_layer = 3 * C * C + 3 * C + C * C + F * C + F + C * F
replicated = whole_per_layer * L + 2 * C + T * C  # ... ln_f, wpe
split = split_per_layer * L + V * C               # ... wte
for n in (1, 2, 4):
    step = [l for l in map(json.loads, open(f"{work}/mem{n}/metrics.jsonl")) if "state_bytes" in l][0]
    expected = 16 * (replicated + split // n)  # weights, gradients, m and v in fp32 (ZeRO 0)
    print(f"  tensor parallel {n}: state {step['state_bytes']} bytes, 16 x (replicated + split / {n}) = {expected}")
    assert step["state_bytes"] == expected, (n, step["state_bytes"], expected)
PY
pass "state per rank at tensor parallel 1, 2, 4: the split parameters' weights, gradients and optimizer state fall as 1/size"

echo "$passed passed, 0 failed"
