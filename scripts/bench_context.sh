#!/usr/bin/env bash
# Context parallelism's memory on CPU ranks: one update of a toy Llama (d_model 64, 2 layers, 4
# heads, 2 key/value heads) on one sequence of T = 32,768 tokens at context-parallel sizes 1, 2
# and 4 (one rank per context index, one thread each). Prints each run's peak resident memory
# (rank 0; every rank of a context group holds the same shapes) and its activation part: the peak
# less that of the same run at T = 256, against the one-rank figure / CP.
# Environment: BUILD_DIR (default build), T (default 32768), SIZES (default "1 2 4").
set -euo pipefail
cd "$(dirname "$0")/.."
build="${BUILD_DIR:-build}"
T="${T:-32768}"
sizes="${SIZES:-1 2 4}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
/usr/bin/python3 - "$work/text.txt" <<'PY'
import random, sys
random.seed(1)
words = "the a of context ring block key value query rank chunk head tail sequence token memory".split()
with open(sys.argv[1], "w") as f:
    for i in range(12000):
        f.write(" ".join(random.choice(words) for _ in range(12)) + f" {i}\n")
PY
"$build/src/llmtrain" tokenize --input "$work/text.txt" --output "$work/data" >/dev/null
config() {  # config FILE T
  cat > "$1" <<JSON
{"model": {"arch": "llama", "vocab_size": 256, "context_length": $2, "n_layer": 2, "n_head": 4, "n_kv_head": 2,
           "d_model": 64, "ffn_hidden": 128},
 "data": {"train": "$work/data/train_*.bin"},
 "train": {"micro_batch_size": 1, "global_batch_size": 1, "max_steps": 1, "log_every": 1, "eval_every": 0},
 "optim": {"warmup_steps": 0},
 "checkpoint": {"every": 0}}
JSON
}
config "$work/long.json" "$T"
config "$work/short.json" 256
peak() {  # peak CONFIG CP: rank 0's peak resident bytes in one update
  local run="$work/run-$(basename "$1" .json)-$2" start=$SECONDS
  if [[ "$2" == 1 ]]; then
    "$build/src/llmtrain" train --config "$1" --run-dir "$run" --device cpu >"$run.log" 2>&1
  else
    mpirun --allow-run-as-root --oversubscribe -np "$2" "$build/src/llmtrain" train --config "$1" --run-dir "$run" \
      --device cpu --set dist.context_parallel="$2" >"$run.log" 2>&1
  fi
  /usr/bin/python3 -c "import json,sys; print([l for l in map(json.loads, open(sys.argv[1])) if 'peak_memory_bytes' in l][0]['peak_memory_bytes'], $SECONDS - $start)" "$run/metrics.jsonl"
}
echo "Context parallelism, toy Llama (d_model 64, 2 layers, GQA 4/2), one update of 1 x $T tokens, CPU ranks"
printf '  %-4s %14s %16s %18s %8s\n' CP "peak MiB" "activations MiB" "one-rank / CP MiB" "update s"
one=""
for cp in $sizes; do
  read -r long secs < <(peak "$work/long.json" "$cp")
  read -r short _ < <(peak "$work/short.json" "$cp")
  acts=$(( long - short ))
  [[ -z "$one" ]] && one=$acts
  /usr/bin/python3 -c "print(f'  {$cp:<4} {$long / 2**20:14.1f} {$acts / 2**20:16.1f} {$one / $cp / 2**20:18.1f} {$secs:8d}')"
done
