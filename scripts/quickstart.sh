#!/usr/bin/env bash
# Quick start: installs the dependencies, builds llmtrain, shows what it found, and tokenizes the
# default corpus (the text of Debian's `fortunes` package, installed by setup.sh; no network needed)
# into data/tiny/, where configs/tiny.json reads it. Training joins this script with the training loop.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DBUILD_TESTING=OFF
cmake --build build -j "${JOBS:-$(nproc)}" --target llmtrain
build/src/llmtrain info

# The fortune files themselves; *.dat are their indexes and *.u8 links to the same files.
mapfile -t corpus < <(find /usr/share/games/fortunes -maxdepth 1 -type f ! -name '*.dat' | sort)
build/src/llmtrain tokenize --input "${corpus[@]}" --output data/tiny --tokenizer byte --val-fraction 0.05 --force
build/src/llmtrain check-config --config configs/tiny.json >/dev/null && echo "configs/tiny.json is valid and its data is in data/tiny/"
