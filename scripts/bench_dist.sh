#!/usr/bin/env bash
# Data-parallel scaling on the CPU backend: the benchmark GPT-2 shape (L=4, C=256, NH=4, T=256,
# V=256, global batch 16, micro-batch 8) trained by 1 rank and by 2 ranks under mpirun, one
# thread each. Prints tokens/s and the scaling efficiency (2-rank rate / twice the 1-rank rate).
# Environment: STEPS (default 20), BUILD_DIR (default build).
set -euo pipefail
cd "$(dirname "$0")/.."
steps="${STEPS:-20}"
source scripts/lib/bench_setup.sh
bench_setup 16 "$steps"
cores=$(nproc)  # before OMP_NUM_THREADS, which nproc obeys
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
"$build/src/llmtrain" train --config "$work/bench.json" --run-dir "$work/w1" --device cpu >/dev/null 2>&1
one=$(median_rate "$work/w1/metrics.jsonl" 3)
mpirun --allow-run-as-root --oversubscribe -np 2 "$build/src/llmtrain" train --config "$work/bench.json" \
  --run-dir "$work/w2" --device cpu >/dev/null 2>&1
two=$(median_rate "$work/w2/metrics.jsonl" 3)
echo "CPU data parallelism, GPT-2 L=4 C=256 T=256, global batch 16, 1 thread per rank, $cores cores"
printf '  %-8s %10s tokens/s\n' "1 rank" "$one" "2 ranks" "$two"
/usr/bin/python3 -c "print(f'  scaling efficiency {float($two) / (2 * float($one)) * 100:.0f}%')"
