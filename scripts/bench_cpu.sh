#!/usr/bin/env bash
# CPU training benchmark: the same GPT-2 shape (L=4, C=256, NH=4, T=256, B=8, V=256, fp32, AdamW)
# trained by llmtrain and by PyTorch (CPU), same thread count, in one run. Prints both tokens/s,
# the ratio, and llmtrain's time per op. Needs PyTorch (scripts/setup.sh --with-torch) and a
# configured build (scripts/test.sh or scripts/quickstart.sh).
# Environment: THREADS (default 2), STEPS (default 30), BUILD_DIR (default build).
set -euo pipefail
cd "$(dirname "$0")/.."
threads="${THREADS:-2}"
steps="${STEPS:-30}"
source scripts/lib/bench_setup.sh
bench_setup 8 "$steps"
cores=$(nproc)  # before OMP_NUM_THREADS, which nproc obeys
export OMP_NUM_THREADS="$threads" OPENBLAS_NUM_THREADS="$threads"
"$build/src/llmtrain" train --config "$work/bench.json" --run-dir "$work/run" --device cpu --profile-ops 2> "$work/train.err" >/dev/null
# Median over the steps after the first five (warm-up: page faults, thread start).
ours=$(median_rate "$work/run/metrics.jsonl" 5)
theirs=$(/usr/bin/python3 scripts/torch_step_rate.py --threads "$threads" --steps 20)

echo "CPU training, GPT-2 L=4 C=256 NH=4 T=256 B=8 V=256, fp32, $threads threads, $cores cores"
printf '  %-10s %10s tokens/s\n' llmtrain "$ours" pytorch "$theirs"
/usr/bin/python3 -c "print(f'  ratio      {float($ours) / float($theirs):10.2f}x (goal: >= 1.5x)')"
echo "llmtrain time per op ($steps steps):"
sed -n '/op time/,$p' "$work/train.err" | sed -E 's/^\[[^]]*\] /  /'
