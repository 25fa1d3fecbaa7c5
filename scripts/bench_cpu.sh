#!/usr/bin/env bash
# CPU training benchmark: the same GPT-2 shape (L=4, C=256, NH=4, T=256, B=8, V=256, fp32, AdamW)
# trained by llmtrain and by PyTorch (CPU), same thread count, in one run. Prints both tokens/s,
# the ratio, and llmtrain's time per op. Needs PyTorch (scripts/setup.sh --with-torch) and a
# configured build (scripts/test.sh or scripts/quickstart.sh).
# Environment: THREADS (default 2), STEPS (default 30), BUILD_DIR (default build).
set -euo pipefail
cd "$(dirname "$0")/.."
build="${BUILD_DIR:-build}"
threads="${THREADS:-2}"
steps="${STEPS:-30}"
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" -j "$threads" --target llmtrain >/dev/null

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mapfile -t corpus < <(find /usr/share/games/fortunes -maxdepth 1 -type f ! -name '*.dat' | sort)
"$build/src/llmtrain" tokenize --input "${corpus[@]}" --output "$work/data" --val-fraction 0 >/dev/null
cat > "$work/bench.json" <<JSON
{
  "model": {"vocab_size": 256, "context_length": 256, "n_layer": 4, "n_head": 4, "d_model": 256},
  "data": {"train": "$work/data/train_*.bin"},
  "train": {"micro_batch_size": 8, "global_batch_size": 8, "max_steps": $steps, "log_every": 1000},
  "optim": {"warmup_steps": 5},
  "checkpoint": {"every": 0}
}
JSON
export OMP_NUM_THREADS="$threads" OPENBLAS_NUM_THREADS="$threads"
"$build/src/llmtrain" train --config "$work/bench.json" --run-dir "$work/run" --profile-ops 2> "$work/train.err" >/dev/null
# Median tokens/s over the steps after the first five (warm-up: page faults, thread start).
ours=$(/usr/bin/python3 - "$work/run/metrics.jsonl" <<'PY'
import json, statistics, sys
rates = [json.loads(l)["tokens_per_s"] for l in open(sys.argv[1]) if '"loss"' in l][5:]
print(f"{statistics.median(rates):.1f}")
PY
)
theirs=$(/usr/bin/python3 scripts/torch_step_rate.py --threads "$threads" --steps 20)

echo "CPU training, GPT-2 L=4 C=256 NH=4 T=256 B=8 V=256, fp32, $threads threads, $(nproc) cores"
printf '  %-10s %10s tokens/s\n' llmtrain "$ours" pytorch "$theirs"
/usr/bin/python3 -c "print(f'  ratio      {float($ours) / float($theirs):10.2f}x (goal: >= 1.5x)')"
echo "llmtrain time per op ($steps steps):"
sed -n '/^op time/,$p' "$work/train.err" | sed 's/^/  /'
