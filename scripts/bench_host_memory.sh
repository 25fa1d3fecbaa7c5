#!/usr/bin/env bash
# Host memory per rank of a Llama of about 150M parameters (d_model 1024, 12 layers, FFN 2752,
# byte vocabulary, 64-token context) on 4 CPU ranks at tensor 2 x data 2 with ZeRO 3:
#   1. train 2 updates and save (start-up, training, a save);
#   2. resume that checkpoint on another mesh (data 2, ZeRO 3, no tensor parallelism), 1 update
#      and a save (a resume, training, a save);
# each rank's peak resident memory (the process's maximum RSS, so every phase of the run is under
# it), minus that of the same run with a tiny model (d_model 64, 2 layers: the process's own
# libraries, MPI, buffers), against the state the rank holds (state_bytes: weights, gradients,
# optimizer state and the buffers that gather and reduce them). The target: at most 1.5x.
#   3. export the 4-rank checkpoint of part 1 to Hugging Face's sharded layout (bf16 in 100 MB
#      shards, and fp32): the exporting process's peak resident memory less the tiny model's
#      export's, against the largest tensor and the whole model (the target: about one tensor).
# Environment: LLMTRAIN (the binary; default build/src/llmtrain), MPIEXEC (default mpiexec).
# Prints one line per rank and run; exits 1 when a figure cannot be read.
set -euo pipefail
cd "$(dirname "$0")/.."
llmtrain="${LLMTRAIN:-build/src/llmtrain}"
mpiexec="${MPIEXEC:-mpiexec}"
[[ -x "$llmtrain" ]] || { echo "bench_host_memory: no $llmtrain (build first, or set LLMTRAIN)" >&2; exit 1; }
work=$(mktemp -d)
trap '[[ -n "${KEEP:-}" ]] || rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1

# Each rank runs llmtrain through scripts/lib/peak_rss.py, which writes its peak RSS (KiB).
peak="$PWD/scripts/lib/peak_rss.py"
for i in $(seq 1 3000); do printf 'line %d of the host memory benchmark corpus, with a few words\n' "$i"; done > "$work/text.txt"
"$llmtrain" tokenize --input "$work/text.txt" --output "$work/data" >/dev/null

config() {  # config FILE MODEL
  cat > "$1" <<JSON
{"model": $2,
 "data": {"train": "$work/data/train_*.bin"},
 "train": {"micro_batch_size": 1, "global_batch_size": 2, "max_steps": 2, "log_every": 1, "eval_every": 0},
 "optim": {"warmup_steps": 1},
 "dist": {"zero_stage": 3, "tensor_parallel": 2},
 "checkpoint": {"every": 0, "async": false}}
JSON
}
config "$work/big.json" '{"arch": "llama", "vocab_size": 256, "context_length": 64, "n_layer": 12, "n_head": 16,
  "n_kv_head": 16, "d_model": 1024, "ffn_hidden": 2752}'
config "$work/tiny.json" '{"arch": "llama", "vocab_size": 256, "context_length": 64, "n_layer": 2, "n_head": 4,
  "n_kv_head": 4, "d_model": 64, "ffn_hidden": 176}'

run() {  # run NAME CONFIG [ARGS...]: 4 or 2 ranks as the args say; peaks in $work/NAME.peak.RANK
  local name="$1" config="$2" ranks=4; shift 2
  [[ " $* " == *" dist.tensor_parallel=1 "* ]] && ranks=2
  "$mpiexec" --allow-run-as-root --oversubscribe -np "$ranks" /usr/bin/python3 "$peak" "$work/$name.peak" \
    "$llmtrain" train --config "$config" "$@" >"$work/$name.log" 2>&1 ||
    { echo "bench_host_memory: $name failed: $(grep -m 3 error "$work/$name.log")" >&2; exit 1; }
}
state_mb() {  # the state_bytes of a run's metrics (rank 0's), in MB
  /usr/bin/python3 - "$1" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if "state_bytes" in l]
print(f"{rows[-1]['state_bytes'] / 1e6:.1f}")
PY
}

for size in tiny big; do
  run "$size-train" "$work/$size.json" --run-dir "$work/$size-train"
  run "$size-resume" "$work/$size.json" --run-dir "$work/$size-resume" --resume "$work/$size-train/checkpoints/step_00000002" \
    --set train.max_steps=3 --set dist.tensor_parallel=1
done
params=$(sed -n 's/.*train: \([0-9]*\) parameters.*/\1/p' "$work/big-train.log" | head -n 1)
echo "bench_host_memory: Llama of $params parameters, 4 CPU ranks, $("$llmtrain" --version)"
worst=0
for phase in "train:tensor 2 x data 2, ZeRO 3: start-up, 2 updates, a save" "resume:resumed at data 2, ZeRO 3: a resume, 1 update, a save"; do
  name="${phase%%:*}"
  state=$(state_mb "$work/big-$name/metrics.jsonl")
  ranks=$(ls "$work/big-$name.peak".* | wc -l)
  echo "  ${phase#*:} (state_bytes $state MB a rank)"
  for ((r = 0; r < ranks; ++r)); do
    big=$(cat "$work/big-$name.peak.$r") tiny=$(cat "$work/tiny-$name.peak.$r")
    line=$(/usr/bin/python3 -c "
big, tiny, state = $big / 1024, $tiny / 1024, $state
extra = big * 1.048576 - tiny * 1.048576
print(f'    rank {$r}: peak RSS {big * 1.048576:.0f} MB, tiny model {tiny * 1.048576:.0f} MB, difference {extra:.0f} MB = {extra / state:.2f}x state_bytes')")
    echo "$line"
    ratio=${line##*= }; ratio=${ratio%x*}
    worst=$(/usr/bin/python3 -c "print(max($worst, $ratio))")
  done
done
echo "bench_host_memory: largest ratio $worst (target: at most 1.5)"

# 3. Export, one process: peak RSS less the tiny model's export's.
export_peak() {  # export_peak SIZE DTYPE: KiB
  rm -rf "$work/$1-hf-$2"
  /usr/bin/python3 "$peak" "$work/$1-export-$2.peak" "$llmtrain" export --checkpoint "$work/$1-train" \
    --format hf --dtype "$2" --shard-gb 0.1 --output "$work/$1-hf-$2" >"$work/$1-export-$2.log" 2>&1 ||
    { echo "bench_host_memory: export of $1 failed: $(tail -n 3 "$work/$1-export-$2.log")" >&2; exit 1; }
  cat "$work/$1-export-$2.peak.0"
}
for dtype in fp32 bf16; do
  big=$(export_peak big "$dtype") tiny=$(export_peak tiny "$dtype")
  shards=$(ls "$work/big-hf-$dtype"/model-*-of-*.safetensors | wc -l)
  /usr/bin/python3 - "$big" "$tiny" "$params" "$dtype" "$shards" "$work/big-hf-fp32" <<'PY'
import glob, json, struct, sys
big, tiny, params, dtype, shards = int(sys.argv[1]) * 1024 / 1e6, int(sys.argv[2]) * 1024 / 1e6, int(sys.argv[3]), sys.argv[4], sys.argv[5]
largest = 0  # the largest tensor, f32, as the fp32 export's files hold it
for path in glob.glob(sys.argv[6] + "/model-*-of-*.safetensors"):
    with open(path, "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    largest = max([largest] + [t["data_offsets"][1] - t["data_offsets"][0] for k, t in header.items() if k != "__metadata__"])
largest /= 1e6
model = params * 4 / 1e6
extra = big - tiny
print(f"  export --format hf --dtype {dtype} of the 4-rank checkpoint ({shards} shards): peak RSS {big:.0f} MB, "
      f"tiny model {tiny:.0f} MB, difference {extra:.0f} MB = {extra / largest:.1f}x the largest tensor "
      f"({largest:.1f} MB), {extra / model:.3f}x the model ({model:.0f} MB)")
PY
done
