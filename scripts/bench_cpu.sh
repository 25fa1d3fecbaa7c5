#!/usr/bin/env bash
# CPU training benchmark: the same GPT-2 shape (L=4, C=256, NH=4, T=256, B=8, V=256, fp32, AdamW)
# trained by llmtrain and by PyTorch (CPU), same thread count. The runs alternate, ROUNDS times in
# one call, so that a change in the machine's load falls on all; each prints tokens/s per round,
# the medians over rounds and their ratio, then llmtrain's time per op. With PyTorch 2 (PYTHON)
# PyTorch runs twice a round: eager with SDPA and the fused AdamW, and the same through
# torch.compile; the ratio is against the faster. The machine's sgemm rate (PyTorch's fp32 matmul
# of 2048 x 2048 matrices, same threads) is printed, and llmtrain's model FLOP/s as a fraction of
# it (6 x parameters + attention per token, as plan and the MFU count them).
# Environment: THREADS (default 2), ROUNDS (default 3), STEPS per llmtrain round (default 12,
# the first 3 not counted) and per PyTorch round (its own warm-up steps first), BUILD_DIR (default
# build), PYTHON (default /usr/bin/python3: Debian's PyTorch from scripts/setup.sh --with-torch;
# .venv-torch/bin/python after scripts/setup.sh --with-torch-muon for PyTorch 2).
set -euo pipefail
cd "$(dirname "$0")/.."
threads="${THREADS:-2}"
rounds="${ROUNDS:-3}"
steps="${STEPS:-12}"
python="${PYTHON:-/usr/bin/python3}"
source scripts/lib/bench_setup.sh
bench_setup 8 "$steps"
cores=$(nproc)  # before OMP_NUM_THREADS, which nproc obeys
export OMP_NUM_THREADS="$threads" OPENBLAS_NUM_THREADS="$threads"
torch2=0
"$python" -c 'import torch, sys; sys.exit(int(torch.__version__.split(".")[0]) < 2)' 2>/dev/null && torch2=1
# The machine's sgemm rate, in GFLOP/s: llmtrain's MFU is then the fraction of it.
sgemm=$("$python" - "$threads" <<'PY'
import sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
a @ b
start = time.perf_counter()
for _ in range(10):
    a @ b
print(f"{2 * 2048**3 * 10 / (time.perf_counter() - start) / 1e9:.1f}")
PY
)
ours=() fraction=() eager=() compiled=()
for round in $(seq "$rounds"); do
  "$build/src/llmtrain" train --config "$work/bench.json" --run-dir "$work/run$round" --device cpu --profile-ops \
    --set train.peak_tflops="$(awk -v g="$sgemm" 'BEGIN { print g / 1000 }')" 2> "$work/train$round.err" >/dev/null
  ours+=("$(median_rate "$work/run$round/metrics.jsonl" 3)")  # after warm-up: page faults, thread start
  fraction+=("$(/usr/bin/python3 - "$work/run$round/metrics.jsonl" <<'PY'
import json, statistics, sys
mfu = [json.loads(l)["mfu"] for l in open(sys.argv[1]) if '"loss"' in l][3:]
print(f"{statistics.median(mfu):.3f}")
PY
)")
  if ((torch2)); then
    eager+=("$("$python" scripts/torch_step_rate.py --threads "$threads" --steps "$steps" --best)")
    compiled+=("$("$python" scripts/torch_step_rate.py --threads "$threads" --steps "$steps" --best --compile 2>/dev/null)")
  else
    eager+=("$("$python" scripts/torch_step_rate.py --threads "$threads" --steps "$steps")")
  fi
done

echo "CPU training, GPT-2 L=4 C=256 NH=4 T=256 B=8 V=256, fp32, AdamW, $threads threads, $cores cores," \
  "$rounds alternating rounds; sgemm rate $sgemm GFLOP/s (PyTorch $("$python" -c 'import torch; print(torch.__version__)'), 2048^3)"
for round in $(seq "$rounds"); do
  printf '  round %d: llmtrain %8s (%s of sgemm)  pytorch %8s%s tokens/s\n' "$round" "${ours[round - 1]}" \
    "${fraction[round - 1]}" "${eager[round - 1]}" "${compiled[round - 1]:+, compiled ${compiled[round - 1]}}"
done
/usr/bin/python3 - "${ours[*]}" "${eager[*]}" "${compiled[*]:-}" "${fraction[*]}" <<'PY'
import statistics, sys
ours, eager = (statistics.median(float(x) for x in a.split()) for a in sys.argv[1:3])
compiled = statistics.median(float(x) for x in sys.argv[3].split()) if sys.argv[3].strip() else 0.0
fraction = statistics.median(float(x) for x in sys.argv[4].split())
print(f"  {'llmtrain':10s} {ours:10.1f} tokens/s (median of rounds), {100 * fraction:.0f}% of the sgemm rate")
print(f"  {'pytorch':10s} {eager:10.1f} tokens/s" + (f", torch.compile {compiled:.1f}" if compiled else ""))
print(f"  {'ratio':10s} {ours / max(eager, compiled):10.2f}x against the faster")
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
