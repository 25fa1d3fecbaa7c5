#!/usr/bin/env python3
"""The positions train.eval_tasks runs per validation on a HellaSwag-shaped task, against what
padding every ending to the context length runs (how validation scored them before), at several
context lengths.

The task: 10,042 examples (HellaSwag's validation split) of four endings each, in HellaSwag's
fields, with words drawn from TEXT: ctx_a of 20-60 words, ctx_b of 5-15, endings of 10-30
(about HellaSwag's lengths in GPT-2 tokens). TEXT is tokenized with GPT-2's BPE (encoder.json and
vocab.bpe in GPT2_DIR); a tiny GPT-2 starts training with the task at each context length and
is stopped once its start-up line has counted the positions ("train.eval_tasks hellaswag: N
sequences in M micro-batches, P positions per validation (padding each to the context: Q)").

Usage: bench_eval_tasks.py LLMTRAIN TEXT GPT2_DIR [CONTEXT ...]   (default contexts: 1024 8192)
"""
import json
import os
import random
import re
import subprocess
import sys
import tempfile

NOTE = re.compile(r"train\.eval_tasks hellaswag: .*")


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    llmtrain, text_path, gpt2_dir = sys.argv[1:4]
    contexts = [int(c) for c in sys.argv[4:]] or [1024, 8192]
    with open(text_path, encoding="utf-8") as f:
        words = f.read().split()
    rng = random.Random(0)

    def phrase(lo, hi):
        n = rng.randint(lo, hi)
        at = rng.randrange(len(words) - n)
        return " ".join(words[at:at + n])

    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([llmtrain, "tokenize", "--input", text_path, "--output", f"{tmp}/shards",
                        "--tokenizer", f"gpt2:{gpt2_dir}"], check=True, capture_output=True)
        with open(f"{tmp}/hellaswag.jsonl", "w") as f:
            for _ in range(10042):
                row = {"activity_label": phrase(1, 3), "ctx_a": phrase(20, 60), "ctx_b": phrase(5, 15),
                       "endings": [phrase(10, 30) for _ in range(4)], "label": rng.randrange(4)}
                f.write(json.dumps(row) + "\n")
        for T in contexts:
            config = {"model": {"vocab_size": 50304, "context_length": T, "n_layer": 1, "n_head": 2, "d_model": 32},
                      "data": {"train": f"{tmp}/shards/train_*.bin"},
                      "train": {"micro_batch_size": 8, "global_batch_size": 8, "max_steps": 1, "eval_every": 0,
                                "eval_tasks": [{"task": "hellaswag", "path": f"{tmp}/hellaswag.jsonl"}]},
                      "optim": {"warmup_steps": 0}}
            with open(f"{tmp}/c.json", "w") as f:
                json.dump(config, f)
            env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
            p = subprocess.Popen([llmtrain, "train", "--config", f"{tmp}/c.json", "--run-dir", f"{tmp}/run_{T}"],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
            found = None
            seen = []
            for line in p.stdout:
                seen.append(line)
                found = NOTE.search(line)
                if found:
                    break
            p.kill()
            p.wait()
            if not found:
                sys.exit(f"context {T}: no train.eval_tasks line in the run's output:\n{''.join(seen)[-2000:]}")
            print(f"context {T}: {found.group(0)}", flush=True)


if __name__ == "__main__":
    main()
