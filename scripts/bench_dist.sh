#!/usr/bin/env bash
# Data-parallel scaling on the CPU backend: the benchmark GPT-2 shape (L=4, C=256, NH=4, T=256,
# V=256, global batch 16, micro-batch 8) trained by 1 rank and by 2 ranks under mpirun, one
# thread each. Prints tokens/s and the scaling efficiency (2-rank rate / twice the 1-rank rate).
# Environment: STEPS (default 20), BUILD_DIR (default build).
set -euo pipefail
cd "$(dirname "$0")/.."
build="${BUILD_DIR:-build}"
steps="${STEPS:-20}"
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" -j 2 --target llmtrain >/dev/null

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mapfile -t corpus < <(find /usr/share/games/fortunes -maxdepth 1 -type f ! -name '*.dat' | sort)
"$build/src/llmtrain" tokenize --input "${corpus[@]}" --output "$work/data" --val-fraction 0 >/dev/null
cat > "$work/bench.json" <<JSON
{
  "model": {"vocab_size": 256, "context_length": 256, "n_layer": 4, "n_head": 4, "d_model": 256},
  "data": {"train": "$work/data/train_*.bin"},
  "train": {"micro_batch_size": 8, "global_batch_size": 16, "max_steps": $steps, "log_every": 1000},
  "optim": {"warmup_steps": 5},
  "checkpoint": {"every": 0}
}
JSON
cores=$(nproc)
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
median_rate() {
  /usr/bin/python3 - "$1" <<'PY'
import json, statistics, sys
rates = [json.loads(l)["tokens_per_s"] for l in open(sys.argv[1]) if '"loss"' in l][3:]
print(f"{statistics.median(rates):.1f}")
PY
}
"$build/src/llmtrain" train --config "$work/bench.json" --run-dir "$work/w1" >/dev/null 2>&1
one=$(median_rate "$work/w1/metrics.jsonl")
mpirun --allow-run-as-root --oversubscribe -np 2 "$build/src/llmtrain" train --config "$work/bench.json" \
  --run-dir "$work/w2" >/dev/null 2>&1
two=$(median_rate "$work/w2/metrics.jsonl")
echo "CPU data parallelism, GPT-2 L=4 C=256 T=256, global batch 16, 1 thread per rank, $cores cores"
printf '  %-8s %10s tokens/s\n' "1 rank" "$one" "2 ranks" "$two"
/usr/bin/python3 -c "print(f'  scaling efficiency {float($two) / (2 * float($one)) * 100:.0f}%')"
