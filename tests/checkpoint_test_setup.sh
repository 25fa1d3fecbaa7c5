# Sourced by the checkpoint shell tests (not run): "$1" LLMTRAIN, "$2" MPIEXEC. Sets $llmtrain,
# $mpiexec and $work (a temporary folder, removed on exit with any run still in it), one thread
# per process, pass/fail reporting, mpi RANKS ARGS..., and a small corpus tokenized into
# $work/data (the corpus of tests/data/legacy_checkpoints; mesh_equivalence_test.py writes the same).
set -uo pipefail
llmtrain="$1"
mpiexec="$2"
work=$(mktemp -d)
cleanup() {
  pkill -KILL -f "run-dir $work/" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
passed=0
pass() { echo "ok: $*"; passed=$((passed + 1)); }
fail() { echo "FAILED: $*"; echo "$passed passed, 1 failed"; exit 1; }
mpi() { "$mpiexec" --allow-run-as-root --oversubscribe -np "$@"; }

for i in $(seq 1 600); do printf 'line %d of the resume test corpus, with some words\n' "$i"; done > "$work/text.txt"
"$llmtrain" tokenize --input "$work/text.txt" --output "$work/data" >/dev/null || fail "tokenize"
