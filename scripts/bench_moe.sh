#!/usr/bin/env bash
# Mixture of Experts on 2 CPU ranks: tokens/s of a dense Llama and of a MoE Llama with the same
# active parameters per token (each MoE layer's 8 experts of half the dense MLP's width, top 2),
# the MoE model data parallel and expert parallel (each rank 4 of the 8 experts), and the share of
# the expert-parallel update spent in the expert group's collectives (metrics.jsonl's
# expert_comm_wait_s: the all-to-alls, and the small all-reduces of the shared gradients). One
# thread per rank; the median over the updates after the first 3.
# Environment: BUILD_DIR (default build), STEPS (default 15).
set -euo pipefail
cd "$(dirname "$0")/.."
build="${BUILD_DIR:-build}"
steps="${STEPS:-15}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
/usr/bin/python3 - "$work/text.txt" <<'PY'
import random, sys
random.seed(1)
words = "the a of expert router token slot layer rank batch dense sparse gate up down shared".split()
with open(sys.argv[1], "w") as f:
    for i in range(20000):
        f.write(" ".join(random.choice(words) for _ in range(12)) + f" {i}\n")
PY
"$build/src/llmtrain" tokenize --input "$work/text.txt" --output "$work/data" >/dev/null
config() {  # config FILE MOE_JSON (empty: dense)
  cat > "$1" <<JSON
{"model": {"arch": "llama", "vocab_size": 256, "context_length": 128, "n_layer": 4, "n_head": 4, "n_kv_head": 4,
           "d_model": 128, "ffn_hidden": 512${2:+, \"moe\": $2}},
 "data": {"train": "$work/data/train_*.bin"},
 "train": {"micro_batch_size": 4, "global_batch_size": 16, "max_steps": $steps, "log_every": 1, "eval_every": 0},
 "optim": {"warmup_steps": 0},
 "checkpoint": {"every": 0}}
JSON
}
config "$work/dense.json" ""
config "$work/moe.json" '{"experts": 8, "top_k": 2, "ffn_hidden": 256}'
run() {  # run NAME CONFIG [SETS...]: median tokens/s, expert wait share, active parameters
  local name=$1 cfg=$2
  shift 2
  mpirun --allow-run-as-root --oversubscribe -np 2 "$build/src/llmtrain" train --config "$cfg" --run-dir "$work/$name" \
    --device cpu "$@" >"$work/$name.log" 2>&1 || { cat "$work/$name.log"; exit 1; }
  /usr/bin/python3 - "$work/$name/metrics.jsonl" "$name" <<'PY'
import json, statistics, sys
lines = [l for l in map(json.loads, open(sys.argv[1])) if "tokens_per_s" in l and l["step"] > 3]
rate = statistics.median(l["tokens_per_s"] for l in lines)
share = statistics.median(l.get("expert_comm_wait_s", 0.0) * l["tokens_per_s"] / (16 * 128) for l in lines)
sent = statistics.median(l.get("expert_sent_bytes", 0.0) for l in lines)
print(f"  {sys.argv[2]:<18} {rate:12.0f} {100 * share:16.1f}% {sent / 2**20:20.2f}")
PY
}
echo "MoE vs dense on 2 CPU ranks (1 thread each): Llama d_model 128, 4 layers, 16 x 128 tokens per update"
"$build/src/llmtrain" plan --config "$work/dense.json" | grep '^parameters' | sed 's/^/  dense: /'
"$build/src/llmtrain" plan --config "$work/moe.json" | grep '^moe' | sed 's/^/  moe: /'
printf '  %-18s %12s %17s %20s\n' run "tokens/s" "expert group wait" "expert MiB/update"
run dense-data2 "$work/dense.json"
run moe-data2 "$work/moe.json"
run moe-ep2 "$work/moe.json" --set dist.expert_parallel=2
