# Sourced by the launcher tests: tiny_run DIR LLMTRAIN LOG_EVERY writes DIR/data (byte-token
# shards of a small text) and DIR/c.json, a 1-layer model that trains for ever (until a signal),
# with no periodic checkpoints, so that every checkpoint comes from a stop.
tiny_run() {
  local dir="$1" llmtrain="$2" log_every="$3" i
  for i in $(seq 1 400); do printf 'the quick brown fox %d jumps over the lazy dog\n' "$i"; done > "$dir/text.txt"
  "$llmtrain" tokenize --input "$dir/text.txt" --output "$dir/data" >/dev/null || return 1
  cat > "$dir/c.json" <<JSON
{"model": {"vocab_size": 256, "context_length": 16, "n_layer": 1, "n_head": 2, "d_model": 16},
 "data": {"train": "$dir/data/train_*.bin"},
 "train": {"micro_batch_size": 2, "global_batch_size": 4, "max_steps": 100000000, "log_every": $log_every},
 "optim": {"warmup_steps": 0},
 "checkpoint": {"every": 0}}
JSON
}
