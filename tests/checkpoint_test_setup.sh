# Shared by the checkpoint tests (sourced, not run): "$1" LLMTRAIN, "$2" MPIEXEC. Sets $llmtrain,
# $mpiexec and $work (a temporary folder, removed on exit with any run still in it), one thread
# per process, pass/fail reporting, mpi RANKS ARGS..., launch, same_files, same_losses, and a small
# corpus tokenized into $work/data.
set -uo pipefail
llmtrain="$1"
mpiexec="$2"
work=$(mktemp -d)
cleanup() {
  pkill -KILL -f "run-dir $work/" 2>/dev/null
  mountpoint -q "$work/full" 2>/dev/null && umount "$work/full"
  rm -rf "$work"
}
trap cleanup EXIT
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
passed=0
pass() { echo "ok: $*"; passed=$((passed + 1)); }
fail() { echo "FAILED: $*"; echo "$passed passed, 1 failed"; exit 1; }
mpi() { "$mpiexec" --allow-run-as-root --oversubscribe -np "$@"; }

# launch RANKS ARGS...: llmtrain as one process, or under mpirun with RANKS ranks.
launch() {
  local ranks="$1"; shift
  if [[ "$ranks" == 1 ]]; then "$llmtrain" "$@"; else mpi "$ranks" "$llmtrain" "$@"; fi
}
# same_files DIR_A DIR_B: the two runs' final checkpoints hold identical safetensors files.
same_files() {
  local a="$1/checkpoints/$(cat "$1/checkpoints/latest")" b="$2/checkpoints/$(cat "$2/checkpoints/latest")"
  [[ "$(basename "$a")" == "$(basename "$b")" ]] || return 1
  for f in "$a"/*.safetensors; do cmp -s "$f" "$b/$(basename "$f")" || return 1; done
}
# same_losses REF_METRICS GOT_METRICS: a run resumed from step 10 logs steps 11-20 with the losses
# of the run that wrote the checkpoint, to 1e-5 relative.
same_losses() {
  /usr/bin/python3 - "$1" "$2" <<'PY'
import json, sys
ref = {l["step"]: l["loss"] for l in map(json.loads, open(sys.argv[1])) if "loss" in l}
got = {l["step"]: l["loss"] for l in map(json.loads, open(sys.argv[2])) if "loss" in l}
assert sorted(got) == list(range(11, 21)), sorted(got)
worst = max(abs(got[s] - ref[s]) / abs(ref[s]) for s in got)
print(f"  steps 11-20, largest relative difference {worst:.1e}")
assert worst <= 1e-5
PY
}

for i in $(seq 1 600); do printf 'line %d of the resume test corpus, with some words\n' "$i"; done > "$work/text.txt"
"$llmtrain" tokenize --input "$work/text.txt" --output "$work/data" >/dev/null || fail "tokenize"
