#!/usr/bin/env bash
# nanoGPT's own CPU recipe (its README: shakespeare_char, 4 layers, 4 heads, 128 channels, block
# 64, batch 12, 2,000 iterations, lr 1e-3 -> 1e-4, warm-up 100, beta2 0.99, weight decay 0.1,
# clip 1.0, dropout 0), trained by llmtrain and, where a nanoGPT checkout and PyTorch 2 are given,
# by nanoGPT's train.py (--device=cpu --compile=False), the two alternating ROUNDS times on the same
# threads. Both read the same text, split 90/10 (llmtrain as bytes, nanoGPT as its own
# characters: the same characters for an ASCII text such as tinyshakespeare). Prints each run's
# median time per iteration over iterations 100-ITERS, its last validation loss, and the ratio.
# nanoGPT is not vendored: pass its checkout (its data/shakespeare_char/prepare.py downloads the
# text; this script writes the same files from TEXT instead, so no network is needed).
#
# Usage: scripts/bench_nanogpt.sh TEXT [NANOGPT_DIR]
# Environment: THREADS (default 2), ROUNDS (default 2), ITERS (default 2000), PYTHON (the
# interpreter with PyTorch 2 for nanoGPT; default .venv-torch/bin/python, from
# scripts/setup.sh --with-torch-muon), BUILD_DIR (default build).
set -euo pipefail
cd "$(dirname "$0")/.."
if (($# < 1)) || [[ ! -f "$1" ]]; then
  echo "usage: scripts/bench_nanogpt.sh TEXT [NANOGPT_DIR]   (TEXT: a plain text file, such as tinyshakespeare)" >&2
  exit 2
fi
text="$(realpath "$1")"
nanogpt="${2:+$(realpath "$2")}"
threads="${THREADS:-2}" rounds="${ROUNDS:-2}" iters="${ITERS:-2000}"
python="${PYTHON:-$PWD/.venv-torch/bin/python}"
build="${BUILD_DIR:-build}"
if [[ -n "$nanogpt" ]]; then
  [[ -f "$nanogpt/train.py" && -f "$nanogpt/model.py" ]] || { echo "bench_nanogpt.sh: $nanogpt holds no nanoGPT train.py" >&2; exit 2; }
  "$python" -c 'import torch, sys; sys.exit(int(torch.__version__.split(".")[0]) < 2)' 2>/dev/null ||
    { echo "bench_nanogpt.sh: $python has no PyTorch 2 (scripts/setup.sh --with-torch-muon, or set PYTHON)" >&2; exit 2; }
fi
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" -j "$(nproc)" --target llmtrain >/dev/null
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS="$threads" OPENBLAS_NUM_THREADS="$threads" MKL_NUM_THREADS="$threads"

# llmtrain: the text as bytes, the last 10% for validation; the recipe as a config.
"$build/src/llmtrain" tokenize --input "$text" --output "$work/data" --val-fraction 0.1 >/dev/null
cat > "$work/recipe.json" <<JSON
{
  "model": {"arch": "gpt2", "vocab_size": 256, "context_length": 64, "n_layer": 4, "n_head": 4, "d_model": 128},
  "data": {"train": "$work/data/train_*.bin", "val": "$work/data/val_*.bin"},
  "train": {"micro_batch_size": 12, "global_batch_size": 12, "max_steps": $iters, "log_every": 250,
            "eval_every": 250, "eval_batches": 20, "grad_clip": 1.0},
  "optim": {"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 100, "weight_decay": 0.1, "beta2": 0.99},
  "checkpoint": {"every": 0}
}
JSON

# nanoGPT: its prepare.py's files (sorted characters, 90/10 split, uint16) in a copy of the checkout.
if [[ -n "$nanogpt" ]]; then
  cp -r "$nanogpt" "$work/nanogpt"
  mkdir -p "$work/nanogpt/data/bench_char"
  "$python" - "$text" "$work/nanogpt/data/bench_char" <<'PY'
import pickle, sys
import numpy as np
text = open(sys.argv[1], encoding="utf-8").read()
chars = sorted(set(text))
stoi = {c: i for i, c in enumerate(chars)}
n = len(text)
for name, part in (("train", text[: int(n * 0.9)]), ("val", text[int(n * 0.9):])):
    np.array([stoi[c] for c in part], dtype=np.uint16).tofile(f"{sys.argv[2]}/{name}.bin")
with open(f"{sys.argv[2]}/meta.pkl", "wb") as f:
    pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": stoi}, f)
PY
fi

# TOOL ROUND: one run; prints "MS_PER_ITER VAL_LOSS".
run_llmtrain() {
  "$build/src/llmtrain" train --config "$work/recipe.json" --run-dir "$work/llmtrain$1" --device cpu >/dev/null 2>&1
  /usr/bin/python3 - "$work/llmtrain$1/metrics.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
steps = [r for r in rows if "loss" in r and r["step"] >= 100]
val = [r["val_loss"] for r in rows if "val_loss" in r]
tokens = 12 * 64
print(f"{statistics.median(tokens / r['tokens_per_s'] * 1000 for r in steps):.2f} {val[-1]:.4f}")
PY
}
run_nanogpt() {
  (cd "$work/nanogpt" && "$python" train.py config/train_shakespeare_char.py --device=cpu --compile=False \
     --eval_iters=20 --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 \
     --max_iters="$iters" --lr_decay_iters="$iters" --dropout=0.0 --dataset=bench_char \
     --out_dir="$work/nanogpt-out$1" --always_save_checkpoint=False) > "$work/nanogpt$1.log" 2>&1
  /usr/bin/python3 - "$work/nanogpt$1.log" <<'PY'
import re, statistics, sys
log = open(sys.argv[1]).read()
ms = [float(t) for i, t in re.findall(r"^iter (\d+): loss [\d.]+, time ([\d.]+)ms", log, re.M) if int(i) >= 100]
val = re.findall(r"val loss ([\d.]+)", log)
print(f"{statistics.median(ms):.2f} {float(val[-1]):.4f}")
PY
}

ours=() theirs=()
for round in $(seq "$rounds"); do
  ours+=("$(run_llmtrain "$round")")
  [[ -n "$nanogpt" ]] && theirs+=("$(run_nanogpt "$round")")
done
echo "nanoGPT's CPU recipe: shakespeare_char L=4 NH=4 C=128 T=64 B=12, $iters iterations, $threads threads," \
  "$(nproc) cores, $rounds alternating rounds (ms per iteration: median of iterations 100-$iters)"
for round in $(seq "$rounds"); do
  read -r ms val <<< "${ours[round - 1]}"
  line=$(printf '  round %d: llmtrain %7.2f ms/iter, val_loss %.4f' "$round" "$ms" "$val")
  if [[ -n "$nanogpt" ]]; then
    read -r ms val <<< "${theirs[round - 1]}"
    line+=$(printf ' | nanoGPT %7.2f ms/iter, val loss %.4f' "$ms" "$val")
  fi
  echo "$line"
done
/usr/bin/python3 - "${ours[*]}" "${theirs[*]:-}" <<'PY'
import statistics, sys
ours = [float(x) for x in sys.argv[1].split()[0::2]]
print(f"  llmtrain {statistics.median(ours):7.2f} ms/iter (median of rounds)")
if sys.argv[2].strip():
    theirs = [float(x) for x in sys.argv[2].split()[0::2]]
    print(f"  nanoGPT  {statistics.median(theirs):7.2f} ms/iter")
    print(f"  speed-up {statistics.median(theirs) / statistics.median(ours):7.2f}x (goal: >= 1.5x)")
PY
