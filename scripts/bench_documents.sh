#!/usr/bin/env bash
# CPU flash attention on packed sequences: the document mask (data.document_mask) against plain
# causal attention, forward and backward, on T = 4096 with documents of mean length T / 8
# (bench/bench_documents.cpp). Environment: BUILD_DIR (default build), T (default 4096), MEAN
# (default T / 8), B (4), NH (4), HS (64), REPS (3), THREADS (default: every core).
set -euo pipefail
cd "$(dirname "$0")/.."
build="${BUILD_DIR:-build}"
T="${T:-4096}"
export OMP_NUM_THREADS="${THREADS:-$(nproc)}" OPENBLAS_NUM_THREADS=1
"$build/bench/bench_documents" "$T" "${MEAN:-$((T / 8))}" "${B:-4}" "${NH:-4}" "${HS:-64}" "${REPS:-3}"
