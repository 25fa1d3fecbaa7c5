#!/usr/bin/env bash
# Checkpoint save throughput against a plain sequential write of the same bytes to the same disk
# (dd with fsync). The model is GPT-2 124M's shape with a 64-token context (weights 498 MB; a
# checkpoint holds weights, m and v: about 1.5 GB); one training step, then the save.
# Environment: DIR (where to write; default a temporary folder under the repository), BUILD_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/bench_setup.sh
bench_setup 1 1
dir="${DIR:-$work}"
cat > "$work/save.json" <<JSON
{
  "model": {"vocab_size": 50257, "context_length": 64, "n_layer": 12, "n_head": 12, "d_model": 768},
  "data": {"train": "$work/data/train_*.bin"},
  "train": {"micro_batch_size": 1, "global_batch_size": 1, "max_steps": 1},
  "optim": {"warmup_steps": 0},
  "checkpoint": {"every": 1, "dir": "$dir/checkpoints"}
}
JSON
line=$(OMP_NUM_THREADS="$(nproc)" "$build/src/llmtrain" train --config "$work/save.json" --run-dir "$work/run" 2>&1 |
       grep '^checkpoint ')
echo "llmtrain save: ${line#* }"
bytes=$(du -b -c "$dir"/checkpoints/step_*/* | tail -n 1 | cut -f1)
start=$(date +%s.%N)
dd if=/dev/zero of="$dir/plain.bin" bs=1M count=$((bytes / 1048576)) conv=fsync status=none
end=$(date +%s.%N)
rm -f "$dir/plain.bin"
/usr/bin/python3 -c "print(f'plain sequential write (dd, fsync): {$bytes / 1e6:.1f} MB in {$end - $start:.2f} s ({$bytes / 1e6 / ($end - $start):.0f} MB/s)')"
