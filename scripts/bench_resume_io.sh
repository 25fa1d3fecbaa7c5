#!/usr/bin/env bash
# Bytes each rank reads to resume, at 4, 8 and 16 CPU ranks: a small model (ZeRO 3, so that every
# rank keeps, writes and reads back 1/W of the weights and optimizer state) trains 2 steps and
# saves, then resumes for one step more. Each rank's rchar (/proc/PID/io: every byte read(2) and pread(2) returned, the
# checkpoint's chunks, headers and ranges tables and state.json among them) is taken from a shell
# that waited for it, and set against a run of one step from scratch: the difference is what
# resuming read. A rank reads the files whose spans (state.json) hold its ranges, about 1/W of the
# checkpoint; where state.json has no spans (an earlier version wrote it), every rank opens every
# file and reads its header and ranges, in a file this small the whole file: the whole
# checkpoint each. The last column, a rank's bytes x W over the checkpoint's, is about 1 for the
# former, W for the latter.
# Usage: scripts/bench_resume_io.sh [LLMTRAIN [MPIEXEC]] (default build-cpu/src/llmtrain, mpirun);
# RANKS="4 8 16" to choose the world sizes.
set -euo pipefail
cd "$(dirname "$0")/.."
llmtrain="$(realpath "${1:-build-cpu/src/llmtrain}")"
mpiexec="${2:-mpirun}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
die() { echo "bench_resume_io: error: $*" >&2; exit 1; }

for i in $(seq 1 3000); do printf 'the quick brown fox %d jumps over the lazy dog\n' "$i"; done > "$work/text.txt"
"$llmtrain" tokenize --input "$work/text.txt" --output "$work/data" --val-fraction 0 >/dev/null || die "tokenize"
cat > "$work/c.json" <<JSON
{"model": {"vocab_size": 256, "context_length": 32, "n_layer": 2, "n_head": 4, "d_model": 128},
 "data": {"train": "$work/data/train_*.bin"},
 "train": {"micro_batch_size": 1, "global_batch_size": 16, "max_steps": 2, "log_every": 1000, "eval_every": 0},
 "optim": {"warmup_steps": 0},
 "dist": {"zero_stage": 3},
 "checkpoint": {"every": 0, "async": false}}
JSON

# run NP RUN_DIR STEPS: trains under mpirun; each rank's rchar lands in RUN_DIR.io/RANK.
run() {
  local np="$1" dir="$2" steps="$3"
  mkdir -p "$dir.io"
  "$mpiexec" --allow-run-as-root --oversubscribe -np "$np" sh -c \
    '"$0" "$@" || exit $?; awk "/^rchar/ {print \$2}" /proc/$$/io > "'"$dir"'.io/$OMPI_COMM_WORLD_RANK"' \
    "$llmtrain" train --config "$work/c.json" --run-dir "$dir" --set train.max_steps="$steps" > "$dir.log" 2>&1 ||
    die "$np ranks, $dir: $(tail -3 "$dir.log")"
}

printf '%6s %14s %14s %14s %14s %10s\n' ranks "checkpoint B" "min/rank B" "median/rank B" "max/rank B" "max x W/ckpt"
for np in ${RANKS:-4 8 16}; do
  run "$np" "$work/r$np" 2                  # the checkpoint at step 2
  run "$np" "$work/r$np" 3                  # resumed: one step more
  run "$np" "$work/fresh$np" 1              # one step from scratch: what a run reads anyway
  [[ -d "$work/r$np/checkpoints/step_00000002" ]] || die "no checkpoint at step 2"
  grep -q "resum" "$work/r$np.log" || die "$np ranks: the second run did not resume"
  /usr/bin/python3 - "$np" "$work/r$np" "$work/fresh$np" <<'PY'
import os, statistics, sys
np_, resumed, fresh = int(sys.argv[1]), sys.argv[2], sys.argv[3]
ckpt = os.path.join(resumed, "checkpoints", "step_00000002")
size = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt))
read = []
for r in range(np_):
    a = int(open(f"{resumed}.io/{r}").read())   # the resumed run's (the last to write it)
    b = int(open(f"{fresh}.io/{r}").read())
    read.append(a - b)
print(f"{np_:6d} {size:14d} {min(read):14d} {int(statistics.median(read)):14d} {max(read):14d} {max(read) * np_ / size:10.2f}")
for r, n in enumerate(read):
    print(f"       rank {r:2d}: {n} bytes")
PY
done
