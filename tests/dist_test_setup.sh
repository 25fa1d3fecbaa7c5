# Sourced by the dist shell tests (not run): "$1" LLMTRAIN, "$2" MPIEXEC. Sets $llmtrain, $mpiexec
# and $work (a temporary folder, removed on exit with any run under $work/run* still going), one
# thread per process, fail MESSAGE, and a small corpus tokenized into $work/data.
set -uo pipefail
llmtrain="$1"
mpiexec="$2"
work=$(mktemp -d)
trap 'pkill -KILL -f "$work/run" 2>/dev/null; rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
fail() { echo "FAILED: $*"; exit 1; }

for i in $(seq 1 400); do printf 'the quick brown fox %d jumps over the lazy dog\n' "$i"; done > "$work/text.txt"
"$llmtrain" tokenize --input "$work/text.txt" --output "$work/data" >/dev/null || fail "tokenize"
