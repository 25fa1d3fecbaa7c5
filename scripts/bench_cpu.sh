#!/usr/bin/env bash
# CPU training benchmark: the same GPT-2 shape (L=4, C=256, NH=4, T=256, B=8, V=256, fp32, AdamW)
# trained by llmtrain and by PyTorch (CPU, /usr/bin/python3's), same thread count. The two
# alternate, ROUNDS times in one run, so that a change in the machine's load falls on both; each
# prints tokens/s per round, the medians over rounds and their ratio, then llmtrain's time per op
# (all rounds together). Needs PyTorch (scripts/setup.sh --with-torch) and a configurable build.
# Environment: THREADS (default 2), ROUNDS (default 3), STEPS per llmtrain round (default 12,
# the first 3 not counted) and per PyTorch round (its own warm-up step first), BUILD_DIR (default build).
set -euo pipefail
cd "$(dirname "$0")/.."
threads="${THREADS:-2}"
rounds="${ROUNDS:-3}"
steps="${STEPS:-12}"
source scripts/lib/bench_setup.sh
bench_setup 8 "$steps"
cores=$(nproc)  # before OMP_NUM_THREADS, which nproc obeys
export OMP_NUM_THREADS="$threads" OPENBLAS_NUM_THREADS="$threads"
ours=() theirs=()
for round in $(seq "$rounds"); do
  "$build/src/llmtrain" train --config "$work/bench.json" --run-dir "$work/run$round" --device cpu --profile-ops \
    2> "$work/train$round.err" >/dev/null
  ours+=("$(median_rate "$work/run$round/metrics.jsonl" 3)")  # after warm-up: page faults, thread start
  theirs+=("$(/usr/bin/python3 scripts/torch_step_rate.py --threads "$threads" --steps "$steps")")
done

echo "CPU training, GPT-2 L=4 C=256 NH=4 T=256 B=8 V=256, fp32, AdamW, $threads threads, $cores cores," \
  "$rounds alternating rounds"
for round in $(seq "$rounds"); do
  printf '  round %d: llmtrain %8s  pytorch %8s tokens/s\n' "$round" "${ours[round - 1]}" "${theirs[round - 1]}"
done
/usr/bin/python3 - "${ours[*]}" "${theirs[*]}" <<'PY'
import statistics, sys
ours, theirs = (statistics.median(float(x) for x in a.split()) for a in sys.argv[1:3])
print(f"  {'llmtrain':10s} {ours:10.1f} tokens/s (median of rounds)")
print(f"  {'pytorch':10s} {theirs:10.1f} tokens/s")
print(f"  {'ratio':10s} {ours / theirs:10.2f}x (goal: >= 1.5x)")
PY
echo "llmtrain time per op ($rounds x $steps steps):"
/usr/bin/python3 - "$work"/train*.err <<'PY'
import re, sys
total, ops = 0.0, {}
for path in sys.argv[1:]:
    for line in open(path):
        m = re.search(r"\]\s+(\w+)\s+(\d+) calls\s+([\d.]+) s", line)
        if m:
            ops[m[1]] = ops.get(m[1], 0.0) + float(m[3])
            total += float(m[3])
for name, t in sorted(ops.items(), key=lambda kv: -kv[1]):
    print(f"  {name:26s} {t:8.3f} s {100 * t / total:5.1f}%")
PY
