#!/usr/bin/env bash
# Data pipeline benchmark. Prints:
#   - tokenizer throughput (encoding MB/s) for byte and GPT-2 BPE, with 1 and 2 threads;
#   - GPT-2 BPE on a pathological input, a 10 MB line of letters without spaces (one BPE piece:
#     encoding must stay near linear), and the fixed cost of a run on a 1 KB file (reading the
#     vocabulary, writing it next to the shards);
#   - loader throughput (tokens/s delivered by the background loader, T=256, B=8, shuffled);
#   - what a CPU training step consumes (a PyTorch GPT-2 step, L=4 C=256 T=256 B=8 V=256, 2 threads)
#     and the ratio loader / training step (goal: at least 100).
# Corpus: ../shared/data/tinyshakespeare.txt when present, else the fortunes package's text;
# 8 copies, each one document. Needs a configured build (scripts/test.sh or quickstart.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
build="${BUILD_DIR:-build}"
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" -j "${JOBS:-2}" --target llmtrain bench_loader >/dev/null

corpus=../shared/data/tinyshakespeare.txt
[[ -f "$corpus" ]] || corpus=$(ls /usr/share/games/fortunes/*.u8 2>/dev/null | head -n 1)
gpt2_vocab=../shared/data/gpt2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for i in 1 2 3 4 5 6 7 8; do cp "$corpus" "$work/doc_$i.txt"; done
size_mb=$(du -m --apparent-size -c "$work"/doc_*.txt | tail -n 1 | cut -f1)
echo "corpus: 8 x $(basename "$corpus") (${size_mb} MB)"

tokenizers=(byte)
[[ -f "$gpt2_vocab/encoder.json" ]] && tokenizers+=("gpt2:$gpt2_vocab")
printf '%-10s %8s %12s\n' tokenizer threads "encode MB/s"
for tok in "${tokenizers[@]}"; do
  for threads in 1 2; do
    line=$("$build/src/llmtrain" tokenize --input "$work"/doc_*.txt --output "$work/out" --tokenizer "$tok" \
           --threads "$threads" --force)
    printf '%-10s %8s %12s\n' "${tok%%:*}" "$threads" "$(sed -E 's/.*encoding ([0-9.]+) MB\/s.*/\1/' <<<"$line")"
  done
done

if [[ -f "$gpt2_vocab/encoder.json" ]]; then
  { LC_ALL=C tr -dc 'a-z' </dev/urandom || true; } | head -c 10000000 >"$work/long_line.txt"  # tr: SIGPIPE
  head -c 1000 "$corpus" >"$work/small.txt"
  for name in long_line small; do
    start=$(date +%s.%N)
    line=$("$build/src/llmtrain" tokenize --input "$work/$name.txt" --output "$work/out_$name" \
           --tokenizer "gpt2:$gpt2_vocab" --threads 1 --force 2>/dev/null)
    seconds=$(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN { printf "%.2f", e - s }')
    case $name in
      long_line) echo "gpt2, 10 MB line without spaces: $seconds s for the run ($(grep -o 'encoding [0-9.]* MB/s' <<<"$line"))" ;;
      small) echo "gpt2, 1 KB file: $seconds s for the run (vocabulary read + saved beside the shards)" ;;
    esac
  done
fi

loader_line=$("$build/bench/bench_loader" --shards "$work/out/train_*.bin" --T 256 --B 8 --seconds 3)
echo "$loader_line"
loader=$(sed -E 's/loader: ([0-9.e+]+) tokens\/s.*/\1/' <<<"$loader_line")

python=/usr/bin/python3
if "$python" -c "import torch" 2>/dev/null; then
  step=$(OMP_NUM_THREADS=2 "$python" scripts/torch_step_rate.py --threads 2)
  echo "training step (PyTorch CPU, L=4 C=256 T=256 B=8 V=256, 2 threads): $step tokens/s"
  "$python" -c "print(f'loader / training step: {float($loader) / float($step):.0f}x (goal: >= 100x)')"
else
  echo "training step: PyTorch not installed (scripts/setup.sh --with-torch); no ratio"
fi
