#!/usr/bin/env bash
# plan --host-memory and --ranks-per-node: bad values stop with one error line and exit 2;
# --suggest leaves out a layout whose ranks need more host memory per node than given, and keeps
# it when it fits, at a threshold computed by hand.
# The shipped 13B and 70B configs use the micro-batch --suggest suggests for 64 GPUs of 141 GB on
# nodes of 8 with 2 TB of host memory.
# Usage: plan_host_test.sh LLMTRAIN SOURCE_DIR
set -uo pipefail
llmtrain="$1"
source_dir="$2"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAILED: $*"; exit 1; }

# A Llama of one layer and one head: vocab 11, d_model 4, SwiGLU 6, untied.
#   lm_head 44 + final norm 4 = 48; the layer: 2 norms 8, q, k, v, o 16 each, gate, up, down 24 each
#   = 144; embed_tokens 44: P = 236. On 2 GPUs (tensor 1: one head; pipeline 1: one layer) only
#   1 x 2 x 1 with ZeRO 0 to 3. Every rank owns 118 parameters (ZeRO 0-2: ceil(236 / 2); ZeRO 3:
#   ceil(48 / 2) + ceil(144 / 2) + ceil(44 / 2)) and stages their f32 weights, m and v: 1,416 bytes.
#   Host per GPU rank at its peak (a save): 2 GiB + 32 MiB + 1,416 = 2,181,039,496 bytes; per node
#   of 2 ranks 4,362,078,992.
cat > "$work/c.json" <<JSON
{"model": {"arch": "llama", "vocab_size": 11, "context_length": 8, "n_layer": 1, "n_head": 1, "n_kv_head": 1,
           "d_model": 4, "ffn_hidden": 6, "tie_embeddings": false},
 "data": {"train": "$work/none_*.bin"},
 "train": {"micro_batch_size": 2, "global_batch_size": 4}}
JSON

# Bad values: exit 2, exactly one line on stderr, "llmtrain: error: ..." naming the flag.
bad() {
  local flag="$1"; shift
  "$llmtrain" plan --config "$work/c.json" "$@" >"$work/out" 2>"$work/err"
  local status=$?
  (( status == 2 )) || fail "$*: exit $status, expected 2: $(cat "$work/err")"
  [[ $(grep -c . "$work/err") == 1 ]] || fail "$*: expected one line on stderr: $(cat "$work/err")"
  grep -q "^llmtrain: error: .*$flag" "$work/err" || fail "$*: the line does not name $flag: $(cat "$work/err")"
  echo "bad value ($*): $(cat "$work/err")"
}
bad --host-memory --suggest --gpus 2 --host-memory abc
bad --host-memory --suggest --gpus 2 --host-memory 0GB
bad --host-memory --suggest --gpus 2 --host-memory -5GB
bad --host-memory --suggest --gpus 2 --host-memory 12XB
bad --host-memory --suggest --gpus 2 --host-memory 9e30TB
bad --host-memory --host-memory ""
bad --ranks-per-node --suggest --gpus 2 --ranks-per-node 0
bad --ranks-per-node --suggest --gpus 2 --ranks-per-node abc
bad --ranks-per-node --suggest --gpus 2 --ranks-per-node 99999999999
bad --ranks-per-node --ranks-per-node -1

suggest() { "$llmtrain" plan --config "$work/c.json" --suggest --gpus 2 --device-memory 80GB "$@" 2>&1; }
out=$(suggest --ranks-per-node 2 --host-memory 4362.078992MB) || fail "suggest at the threshold: $out"
grep -q "^fit: 4 of 4 " <<<"$out" || fail "4362.078992MB per node of 2: every choice should fit: $out"
grep -q "2.03 GiB" <<<"$out" || fail "host/rank column: $out"
echo "fits at 4,362,078,992 bytes per node of 2 ranks: $(grep '^fit:' <<<"$out" | cut -c1-40)"
out=$(suggest --ranks-per-node 2 --host-memory 4362.078991MB) || fail "suggest below the threshold: $out"
grep -q "^left out: 4 (mesh, ZeRO stage) choice(s) that fit the device but not the host" <<<"$out" || fail "one byte less: $out"
grep -q "^none fits: .*needs 2.03 GiB per rank, 4.06 GiB per node of 2" <<<"$out" || fail "one byte less: $out"
echo "refused at 4,362,078,991 bytes: $(grep '^none fits' <<<"$out")"
# The same memory per node holds one rank: it fits again.
out=$(suggest --ranks-per-node 1 --host-memory 4362.078991MB) || fail "one rank per node: $out"
grep -q "^fit: 4 of 4 " <<<"$out" || fail "one rank per node should fit: $out"
out=$(suggest --ranks-per-node 1 --host-memory 2181.039495MB)
grep -q "^none fits" <<<"$out" || fail "one rank per node, one byte less than a rank: $out"
# Without --host-memory nothing is left out for the host.
out=$(suggest) || fail "no --host-memory: $out"
grep -q "^fit: 4 of 4 " <<<"$out" && ! grep -q "not the host" <<<"$out" || fail "no --host-memory: $out"

for model in 13b 70b; do
  config="$source_dir/configs/llama2-$model.json"
  out=$("$llmtrain" plan --config "$config" --suggest --gpus 64 --device-memory 141GB --host-memory 2TB) ||
    fail "$model: $out"
  line=$(grep "^suggested: " <<<"$out") || fail "$model: no suggestion: $out"
  suggested=$(sed -E 's/.* at micro-batch ([0-9]+),.*/\1/' <<<"$line")
  configured=$(/usr/bin/python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["train"]["micro_batch_size"])' "$config")
  [[ "$suggested" == "$configured" ]] || fail "$model: config micro-batch $configured, suggested $suggested: $line"
  echo "llama2-$model: micro-batch $configured, as suggested: ${line:0:60}"
done
# A long context puts context parallelism first: the suggested --set options give the first row's
# whole mesh, its context size included (tensor x data x pipeline, then cpN).
out=$("$llmtrain" plan --config "$source_dir/configs/llama2-70b.json" --suggest --gpus 64 --device-memory 141GB \
  --set model.context_length=131072 --set train.micro_batch_size=1) || fail "70b at 128k: $out"
line=$(grep "^suggested: " <<<"$out") || fail "70b at 128k: no suggestion: $out"
read -r t d p cp < <(sed -E 's/^suggested: ([0-9]+) x ([0-9]+) x ([0-9]+)( sp)? cp([0-9]+) .*/\1 \2 \3 \5/' <<<"$line")
[[ "$cp" =~ ^[0-9]+$ ]] || fail "70b at 128k: the first row has no context parallelism: $line"
for want in "dist.tensor_parallel=$t" "dist.context_parallel=$cp" "dist.pipeline_parallel=$p"; do
  grep -q -- "--set $want " <<<"$line" || fail "70b at 128k: the suggestion lacks --set $want: $line"
done
(( t * d * p * cp == 64 )) || fail "70b at 128k: the mesh $t x $d x $p cp$cp is not 64 ranks: $line"
echo "llama2-70b at 128k tokens: $t x $d x $p cp$cp, set as $(grep -o -- '--set dist.context_parallel=[0-9]*' <<<"$line")"
echo "7 passed (thresholds, shipped micro-batches, a context-parallel suggestion), 10 bad values refused"
