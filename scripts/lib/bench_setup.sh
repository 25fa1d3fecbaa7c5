# Shared by the training benchmarks (sourced, not run). Builds llmtrain, tokenizes the fortunes
# corpus into a temporary folder and writes the benchmark config: GPT-2 L=4, C=256, NH=4, T=256,
# V=256, micro-batch 8, fp32, AdamW.
#   bench_setup GLOBAL_BATCH STEPS     sets $build, $work (removed on exit), $work/bench.json
#   median_rate METRICS_JSONL SKIP     median tokens/s of the steps after the first SKIP
bench_setup() {
  local global_batch="$1" steps="$2"
  build="${BUILD_DIR:-build}"
  cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null
  cmake --build "$build" -j "$(nproc)" --target llmtrain >/dev/null
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  local corpus
  mapfile -t corpus < <(find /usr/share/games/fortunes -maxdepth 1 -type f ! -name '*.dat' | sort)
  "$build/src/llmtrain" tokenize --input "${corpus[@]}" --output "$work/data" --val-fraction 0 >/dev/null
  cat > "$work/bench.json" <<JSON
{
  "model": {"vocab_size": 256, "context_length": 256, "n_layer": 4, "n_head": 4, "d_model": 256},
  "data": {"train": "$work/data/train_*.bin"},
  "train": {"micro_batch_size": 8, "global_batch_size": $global_batch, "max_steps": $steps, "log_every": 1000},
  "optim": {"warmup_steps": 5},
  "checkpoint": {"every": 0}
}
JSON
}

median_rate() {
  /usr/bin/python3 - "$1" "$2" <<'PY'
import json, statistics, sys
rates = [json.loads(l)["tokens_per_s"] for l in open(sys.argv[1]) if '"loss"' in l][int(sys.argv[2]):]
print(f"{statistics.median(rates):.1f}")
PY
}
