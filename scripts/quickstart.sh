#!/usr/bin/env bash
# Quick start: installs the dependencies, builds llmtrain and shows what it found.
# Training on the embedded default corpus joins this script when the training loop lands.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DBUILD_TESTING=OFF
cmake --build build -j "${JOBS:-$(nproc)}" --target llmtrain
build/src/llmtrain info
build/src/llmtrain check-config --config configs/tiny.json
