#!/usr/bin/env bash
# tokenize's memory and speed on JSON Lines corpora made from a text file: a 100 MB and a 400 MB
# (decompressed) .jsonl.zst, tokenized with GPT-2's BPE on 2 threads; prints each one's peak RSS
# (the 400 MB one should stay within 1.3x of the 100 MB one, both below 512 MB) and tokens/s,
# then tiktoken's encode_ordinary_batch on the same documents and threads (skipped, saying so,
# without scripts/setup.sh --with-tiktoken).
#
# Usage: scripts/bench_tokenize.sh TEXT_FILE GPT2_VOCAB_DIR [BUILD_DIR]
#   TEXT_FILE       any UTF-8 text; its paragraphs are the documents, repeated to size
#   GPT2_VOCAB_DIR  a folder with GPT-2's encoder.json and vocab.bpe
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
text="${1:?usage: bench_tokenize.sh TEXT_FILE GPT2_VOCAB_DIR [BUILD_DIR]}"
vocab="${2:?usage: bench_tokenize.sh TEXT_FILE GPT2_VOCAB_DIR [BUILD_DIR]}"
build="${3:-build-cpu}"
bin="$build/src/llmtrain"
[[ -x "$bin" ]] || { echo "bench_tokenize.sh: $bin is missing (build first)" >&2; exit 2; }
command -v zstd >/dev/null || { echo "bench_tokenize.sh: the zstd tool is missing (apt-get install zstd)" >&2; exit 2; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

make_corpus() {  # SIZE_MB OUT: JSON Lines of the text's paragraphs, numbered so that they differ
  /usr/bin/python3 - "$text" "$1" "$2" <<'PY'
import json, sys
paragraphs = [p for p in open(sys.argv[1], encoding="utf-8").read().split("\n\n") if p.strip()]
target, n = int(sys.argv[2]) * 1_000_000, 0
with open(sys.argv[3], "w", encoding="utf-8") as out:
    while out.tell() < target:
        for p in paragraphs:
            out.write(json.dumps({"text": f"{n}: {p}\n"}) + "\n")
            n += 1
            if out.tell() >= target:
                break
PY
}

for size in 100 400; do
  make_corpus "$size" "$work/c$size.jsonl"
  zstd -q -T2 --rm "$work/c$size.jsonl" -o "$work/c$size.jsonl.zst"
  /usr/bin/python3 scripts/lib/peak_rss.py "$work/rss$size" \
    "$bin" tokenize --input "$work/c$size.jsonl.zst" --output "$work/out$size" --tokenizer "gpt2:$vocab" \
    --threads 2 > "$work/log$size" 2> "$work/err$size" || { cat "$work/err$size" >&2; exit 1; }
  line="$(cat "$work/log$size")"
  tokens=$(sed -E 's/.* -> ([0-9]+) train \+ ([0-9]+) val.*/\1 + \2/' <<<"$line" | bc)
  seconds=$(sed -E 's/.*, ([0-9.]+) s in all.*/\1/' <<<"$line")
  mb=$(sed -E 's/^tokenize: ([0-9.]+) MB.*/\1/' <<<"$line")
  rss=$(cat "$work/rss$size.0")
  printf 'corpus %s MB of JSON Lines (%s MB of text): %s tokens in %s s = %.0f tokens/s, peak RSS %.1f MB\n' \
    "$size" "$mb" "$tokens" "$seconds" "$(bc -l <<<"$tokens / $seconds")" "$(bc -l <<<"$rss / 1024")"
  eval "rss_$size=$rss"
  rm -rf "$work/out$size"
done
printf 'peak RSS 400 MB / 100 MB: %.2fx\n' "$(bc -l <<<"$rss_400 / $rss_100")"

python=.venv-tiktoken/bin/python
if [[ -x "$python" ]] && "$python" -c "import tiktoken" 2>/dev/null; then
  zstd -q -d -c "$work/c100.jsonl.zst" > "$work/c100.jsonl"
  "$python" - "$vocab" "$work/c100.jsonl" <<'PY'
import json, sys, time
import tiktoken
from tiktoken.load import data_gym_to_mergeable_bpe_ranks
ranks = data_gym_to_mergeable_bpe_ranks(sys.argv[1] + "/vocab.bpe", sys.argv[1] + "/encoder.json")
enc = tiktoken.Encoding("gpt2", explicit_n_vocab=50257, mergeable_ranks=ranks,
                        special_tokens={"<|endoftext|>": 50256},
                        pat_str=r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
docs = [json.loads(line)["text"] for line in open(sys.argv[2], encoding="utf-8")]
start = time.perf_counter()
tokens = sum(len(t) for t in enc.encode_ordinary_batch(docs, num_threads=2)) + len(docs)  # + end-of-text
seconds = time.perf_counter() - start
print(f"tiktoken {tiktoken.__version__} encode_ordinary_batch, 2 threads, the 100 MB corpus's documents "
      f"(already in memory): {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.0f} tokens/s")
PY
else
  echo "tiktoken comparison SKIPPED: no tiktoken in .venv-tiktoken (scripts/setup.sh --with-tiktoken)"
fi
