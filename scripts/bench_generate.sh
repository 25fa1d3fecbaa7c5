#!/usr/bin/env bash
# Decoding on a shared machine: `llmtrain generate` of 400 tokens from a small model (the quick
# start's, configs/quickstart.json, trained STEPS steps here unless CHECKPOINT names a run), timed
# on the machine as it is and then while one busy process (`yes`) runs pinned to core 0. Both with
# the default thread settings (OMP_NUM_THREADS unset: one thread per core). Prints both times (the
# best of REPEATS runs each) and their ratio; the goal is within 2x. A benchmark, not a test: run
# it on an otherwise quiet machine. It also times 1 thread with the busy process, to tell the cost
# of threads from that of sharing a core.
# Environment: CHECKPOINT, STEPS (default 30), REPEATS (default 3), TOKENS (default 400),
# BUILD_DIR (default build).
set -euo pipefail
cd "$(dirname "$0")/.."
steps="${STEPS:-30}"
repeats="${REPEATS:-3}"
tokens="${TOKENS:-400}"
build="${BUILD_DIR:-build}"
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" -j "$(nproc)" --target llmtrain >/dev/null
llmtrain="$build/src/llmtrain"
work=$(mktemp -d)
busy=""
trap '[[ -n "$busy" ]] && kill "$busy" 2>/dev/null; rm -rf "$work"' EXIT

checkpoint="${CHECKPOINT:-}"
if [[ -z "$checkpoint" ]]; then
  mapfile -t corpus < <(find /usr/share/games/fortunes -maxdepth 1 -type f ! -name '*.dat' | sort)
  "$llmtrain" tokenize --input "${corpus[@]}" --output "$work/data" --tokenizer byte --val-fraction 0.05 >/dev/null
  "$llmtrain" train --config configs/quickstart.json --run-dir "$work/run" --set train.max_steps="$steps" \
    --set "data.train=$work/data/train_*.bin" --set "data.val=$work/data/val_*.bin" --set train.eval_every=0 \
    --set checkpoint.every="$steps" --set optim.warmup_steps=$((steps / 3)) >"$work/train.log" 2>&1 ||
    { echo "bench_generate.sh: training the model failed:" >&2; tail -n 3 "$work/train.log" >&2; exit 1; }
  checkpoint="$work/run"
fi

# The best of $repeats wall-clock times of one generate, in seconds; default threads, or the
# environment assignments given as arguments.
best_time() {
  local best="" start end t
  for _ in $(seq "$repeats"); do
    start=$(date +%s%N)
    env -u OMP_NUM_THREADS -u OPENBLAS_NUM_THREADS "$@" "$llmtrain" generate --checkpoint "$checkpoint" \
      --max-new-tokens "$tokens" --temperature 0.8 --top-k 40 --seed 1 >/dev/null 2>&1
    end=$(date +%s%N)
    t=$(( (end - start) / 1000 ))  # microseconds
    if [[ -z "$best" || "$t" -lt "$best" ]]; then best=$t; fi
  done
  /usr/bin/python3 -c "print(f'{$best / 1e6:.3f}')"
}

idle=$(best_time)
taskset -c 0 yes >/dev/null &
busy=$!
sleep 0.5
contended=$(best_time)
single=$(best_time OMP_NUM_THREADS=1)
kill "$busy"
wait "$busy" 2>/dev/null || true
busy=""

echo "generate, $tokens tokens, quick-start model, default threads ($(nproc) cores), best of $repeats"
printf '  %-44s %8s s\n' "as the machine is" "$idle" "one busy process pinned to core 0" "$contended" \
  "the same, OMP_NUM_THREADS=1 (for comparison)" "$single"
/usr/bin/python3 -c "print(f'  ratio, busy / as it is {float($contended) / float($idle):24.2f}x (goal: <= 2x)')"
