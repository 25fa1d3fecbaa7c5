#!/usr/bin/env bash
# Checkpoint cost on GPT-2 124M's shape (64-token context; weights 498 MB, with AdamW's m and v
# about 1.5 GB a checkpoint), against a plain sequential write of the same bytes to the same disk:
#   1. four training steps saving at steps 2 and 4, in the background (checkpoint.async, the
#      default): each save's write time and throughput, and how long training stalled for it;
#   2. the same with synchronous saves (checkpoint.async false), for comparison;
#   3. dd with fsync (conv=fsync) of the same bytes (the checkpoint's files, read from a copy in
#      memory, /dev/shm) to the same folder, before and after the synchronous run (the disk is
#      shared: the faster of the two is the reference). Not zeros: some disks write zeros faster;
#   4. resuming from the last checkpoint with its pages dropped from the page cache: the whole
#      process (checksums verified, weights and optimizer state loaded, no step taken);
#   5. what background saves cost training: PAIRS pairs of runs with one compute thread
#      (OMP_NUM_THREADS=1), 24 steps each, one saving only at the end and one also every 4 steps
#      (5 saves more); the training time between steps 1 and 24 (metrics.jsonl's elapsed_s) of
#      each pair's two runs, their difference per save (the median over the pairs) against dd's
#      time for the same bytes.
# Prints the figures and the ratios against their targets; exits 1 when any figure cannot be
# read from the logs (it never ends silently).
# Environment: DIR (where to write; default a temporary folder), BUILD_DIR (default build),
# PAIRS (default 5), SLOWDOWN_ONLY=1 (part 5 alone).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/bench_setup.sh
bench_setup 1 1
dir="${DIR:-$work}"
llmtrain="$build/src/llmtrain"
die() { echo "bench_checkpoint: error: $*" >&2; exit 1; }

config() {  # config FILE ASYNC CHECKPOINT_DIR [STEPS EVERY]
  cat > "$1" <<JSON
{
  "model": {"vocab_size": 50257, "context_length": 64, "n_layer": 12, "n_head": 12, "d_model": 768},
  "data": {"train": "$work/data/train_*.bin"},
  "train": {"micro_batch_size": 1, "global_batch_size": 1, "max_steps": ${4:-4}, "log_every": 1},
  "optim": {"warmup_steps": 0},
  "checkpoint": {"every": ${5:-2}, "keep_last": 2, "async": $2, "dir": "$3"}
}
JSON
}

# The save lines of a run's log as "MB WRITE_S MB_PER_S STALL_S WAITED_S", one per save (WAITED_S:
# the part of the stall spent waiting for the previous save to finish writing).
saves() {
  /usr/bin/python3 - "$1" <<'PY'
import re, sys
for line in open(sys.argv[1]):
    m = re.search(r"checkpoint .*step_\d+: ([\d.]+) MB written in ([\d.]+) s \(([\d.]+) MB/s\).*training stalled ([\d.]+) s"
                  r"(?: \(([\d.]+) s of it waiting)?", line)
    if m:
        print(*m.groups(default="0"))
PY
}
# Seconds dd takes to write the bytes of file $1 with fsync into DIR.
dd_seconds() {
  local start end
  start=$(date +%s.%N)
  dd if="$1" of="$dir/plain.bin" bs=1M conv=fsync status=none
  end=$(date +%s.%N)
  rm -f "$dir/plain.bin"
  /usr/bin/python3 -c "print($end - $start)"
}

run() {  # run NAME ASYNC
  rm -rf "$dir/$1"
  config "$work/$1.json" "$2" "$dir/$1"
  OMP_NUM_THREADS="$(nproc)" "$llmtrain" train --config "$work/$1.json" --run-dir "$work/run-$1" >"$work/$1.log" 2>&1 ||
    die "the $1 run failed: $(tail -n 3 "$work/$1.log")"
  local lines
  lines=$(saves "$work/$1.log")
  [[ $(wc -l <<<"$lines") == 2 ]] || die "expected 2 save lines in the $1 run's log, found: $(grep checkpoint "$work/$1.log" || true)"
  echo "$lines"
}

# Part 5: seconds of training between steps 1 and 24 of a 24-step run saving every EVERY steps
# (0: at the end only), on one compute thread.
train_seconds() {  # train_seconds NAME EVERY
  rm -rf "$dir/$1" "$work/run-$1"
  config "$work/$1.json" true "$dir/$1" 24 "$2"
  OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 "$llmtrain" train --config "$work/$1.json" --run-dir "$work/run-$1" \
    >"$work/$1.log" 2>&1 || die "the $1 run failed: $(tail -n 3 "$work/$1.log")"
  /usr/bin/python3 - "$work/run-$1/metrics.jsonl" <<'PY'
import json, sys
elapsed = {r["step"]: r["elapsed_s"] for r in map(json.loads, open(sys.argv[1])) if "elapsed_s" in r}
print(f"{elapsed[24] - elapsed[1]:.3f}")
PY
  rm -rf "$dir/$1"
}

slowdown() {  # prints "NOSAVE_S SAVE_S" per pair, then the dd seconds of the same bytes
  local pairs="${PAIRS:-5}" k
  for ((k = 1; k <= pairs; ++k)); do
    echo "$(train_seconds quiet 0) $(train_seconds saving 4)"
  done
}

# Part 5 in full: the pairs, between two dd timings of the bytes in file $1, and the summary.
report_slowdown() {  # report_slowdown SAME_BYTES_FILE
  local dd1 dd2 pairs
  dd1=$(dd_seconds "$1")
  pairs=$(slowdown)
  dd2=$(dd_seconds "$1")
  /usr/bin/python3 - "$(stat -c %s "$1")" "$dd1" "$dd2" "$pairs" <<'PY'
import statistics, sys
nbytes, dd1, dd2 = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
pairs = [tuple(map(float, line.split())) for line in sys.argv[4].strip().splitlines()]
dd = min(dd1, dd2)
print(f"training with one compute thread, {nbytes / 1e6:.1f} MB per save; dd with fsync: {dd1:.2f} s, {dd2:.2f} s")
per_save = []
for k, (quiet, saving) in enumerate(pairs):
    per_save.append((saving - quiet) / 5)
    print(f"  pair {k + 1}: steps 1-24 without saves {quiet:.2f} s, with 5 background saves {saving:.2f} s: "
          f"{per_save[-1]:+.3f} s per save")
median = statistics.median(per_save)
print(f"training slowed by {median:.3f} s per background save (median of {len(pairs)} pairs) = "
      f"{median / dd:.2f} x dd's time for the same bytes (target <= 0.25)")
PY
}

mkdir -p "$dir"
memory="${TMPFS:-/dev/shm}"
[[ -d "$memory" ]] || die "no $memory for dd's source (set TMPFS to a memory file system)"
same_bytes="$memory/bench_checkpoint.$$"
trap 'rm -rf "$work" "$same_bytes"' EXIT
if [[ "${SLOWDOWN_ONLY:-0}" == 1 ]]; then
  run async true >/dev/null  # a checkpoint's bytes for dd
  cat "$dir"/async/step_00000004/* > "$same_bytes"
  report_slowdown "$same_bytes"
  exit 0
fi
async=$(run async true)
bytes=$(du -b -c "$dir"/async/step_00000004/* | tail -n 1 | cut -f1)
(( bytes > 1480000000 && bytes < 1490000000 )) || die "the checkpoint holds $bytes bytes, expected about 1484 MB"
cat "$dir"/async/step_00000004/* > "$same_bytes"
dd_before=$(dd_seconds "$same_bytes")
sync=$(run sync false)
dd_after=$(dd_seconds "$same_bytes")

# Resume: drop the checkpoint's pages from the page cache first (dd's nocache advice), so that
# the files are read from the disk; max_steps is the checkpoint's step, so no update is made.
for f in "$dir"/async/step_00000004/*; do dd if="$f" iflag=nocache count=0 status=none; done
cp -r "$work/run-async" "$work/run-resume"
start_resume=$(date +%s.%N)
OMP_NUM_THREADS="$(nproc)" "$llmtrain" train --config "$work/async.json" --run-dir "$work/run-resume" \
  --resume "$dir/async/step_00000004" >"$work/resume.log" 2>&1 || die "resume failed: $(tail -n 3 "$work/resume.log")"
end_resume=$(date +%s.%N)
grep -q "resuming from .*step_00000004" "$work/resume.log" || die "the resumed run does not say it resumed: $(cat "$work/resume.log")"

/usr/bin/python3 - "$bytes" "$dd_before" "$dd_after" "$start_resume" "$end_resume" "$async" "$sync" <<'PY'
import sys
nbytes, dd1, dd2, r0, r1 = int(sys.argv[1]), *map(float, sys.argv[2:6])
parse = lambda text: [tuple(map(float, line.split())) for line in text.strip().splitlines()]
runs = {"background (async)": parse(sys.argv[6]), "synchronous": parse(sys.argv[7])}
dd_rate = nbytes / 1e6 / min(dd1, dd2)
print(f"checkpoint of GPT-2 124M's shape: {nbytes / 1e6:.1f} MB (weights, AdamW m and v)")
for name, saves in runs.items():
    for k, (mb, write_s, rate, stall_s, waited_s) in enumerate(saves):
        print(f"  {name} save {k + 1}: written in {write_s:.2f} s ({rate:.0f} MB/s), training stalled {stall_s:.3f} s "
              f"({100 * stall_s / write_s:.2f}% of the write time; {waited_s:.3f} s of it waiting for the previous save)")
print(f"  dd with fsync, same bytes, same disk: {dd1:.2f} s before the synchronous run, {dd2:.2f} s after "
      f"(the faster: {dd_rate:.0f} MB/s)")
print(f"  resume from the last checkpoint, read from the disk (verify, load; whole process): {r1 - r0:.2f} s")
worst = min(rate for _, _, rate, _, _ in runs["background (async)"])
stall = max((stall_s - waited_s) / write_s for _, write_s, _, stall_s, waited_s in runs["background (async)"])
print(f"save throughput / dd's: {100 * worst / dd_rate:.0f}% (slower background save; target >= 80%)")
print(f"background stall / write time, waits for the previous save aside: {100 * stall:.2f}% (worst save; target < 10%)")
PY
report_slowdown "$same_bytes"
