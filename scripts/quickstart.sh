#!/usr/bin/env bash
# Quick start: installs the dependencies, builds llmtrain, tokenizes the default corpus (the text of
# Debian's `fortunes` package, installed by setup.sh; no network needed) as bytes, trains a small
# GPT-2 on the CPU for a few minutes (configs/quickstart.json) and prints a generated sample.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh
# The same build folder and options as scripts/test.sh (which adds its own explicitly), so that
# either script may run first; only the binary is built here.
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release
cmake --build build -j "${JOBS:-$(nproc)}" --target llmtrain
build/src/llmtrain info

# The fortune files themselves; *.dat are their indexes and *.u8 links to the same files.
mapfile -t corpus < <(find /usr/share/games/fortunes -maxdepth 1 -type f ! -name '*.dat' | sort)
build/src/llmtrain tokenize --input "${corpus[@]}" --output data/tiny --tokenizer byte --val-fraction 0.05 --force

export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}"
# Idle OpenMP threads sleep at once instead of spinning (docs/training.md, Threads): on a machine that other
# work shares, spinning threads take the cores that the busy ones wait for.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-passive}"
run=runs/quickstart-$(date +%Y%m%d-%H%M%S)
build/src/llmtrain train --config configs/quickstart.json --run-dir "$run"
echo "--- a sample from $run:"
build/src/llmtrain generate --checkpoint "$run" --max-new-tokens 400 --temperature 0.8 --top-k 40 --seed 1
