#!/usr/bin/python3
"""train.eval_tasks on every mesh, on CPU ranks under mpirun.

A tiny GPT-2 is trained 30 steps on one rank; then each layout resumes that checkpoint for one
more update and validates (step 31) with two tasks (HellaSwag's format and the plain one, with
a context longer than the model's, choices of several lengths and a count of endings that fills
no whole number of micro-batches):

  1. the one-rank run's log-likelihoods (RUN_DIR/tasks/NAME/step_00000031.json, the per-position
     losses of the validation's forward passes over micro-batches padded to their longest
     sequence: 64 positions, or the whole context of 256 for the long context) equal those
     `eval --task` computes on its checkpoint, which scores through the same path
     (eval/sequence_scoring.h; its values are checked against PyTorch's logits in test_eval and
     against transformers and lm-evaluation-harness in their own tests), with the same choices;
     the start-up line counts the positions a validation runs and what padding every sequence to
     the context would;
  2. tensor parallelism 2 (with and without sequence parallelism), ZeRO 3 over 2 ranks, a 2-stage
     pipeline (1F1B and interleaved), context parallelism 2 and tensor 2 x data 2 under ZeRO 3
     (4 ranks) give the one-rank run's scores (hellaswag's acc, acc_norm and acc_bytes; choice's
     acc, acc_norm and acc_norm_bytes), the same choices and token counts, and log-likelihoods
     within 1e-4;
  3. `eval --task` under mpirun with --tensor-parallel 2 and with --context-parallel 2 (each rank
     reading only its part of the weights) gives the one-rank scores too.

Usage: eval_tasks_mesh_test.py LLMTRAIN MPIEXEC
"""
import json
import os
import re
import subprocess
import sys
import tempfile

LLMTRAIN, MPIEXEC = sys.argv[1], sys.argv[2]
TOL = 1e-4
ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
failures = []


def check(ok, what):
    print(("ok: " if ok else "FAILED: ") + what, flush=True)
    if not ok:
        failures.append(what)


def run(*args, ranks=1):
    command = [LLMTRAIN, *args]
    if ranks > 1:
        command = [MPIEXEC, "--allow-run-as-root", "--oversubscribe", "-np", str(ranks), *command]
    r = subprocess.run(command, capture_output=True, env=ENV)
    if r.returncode != 0:
        sys.exit(f"FAILED: {' '.join(command)}: exit {r.returncode}\n{r.stderr.decode(errors='replace')[-3000:]}")
    return r


LONG = " ".join(["fortune favors the bold and the quick brown fox jumps over the lazy dog while the moon"] * 4)  # > 256 bytes
HELLASWAG = [  # HellaSwag's fields: lm-evaluation-harness's query is "activity_label: ctx_a Ctx_b"
    {"ctx": "the quick brown fox", "endings": ["jumps over the lazy dog", "sat", "caf\u00e9 au lait", "runs"], "label": 0},
    {"ctx": LONG, "endings": ["rises", "and back", "over the hills", "x"], "label": 2},
    {"ctx": "fortune", "endings": ["favors the bold", "cookie", "\u00e9t\u00e9", "x"], "label": "0"},
    {"ctx": "the lazy dog", "endings": ["sleeps", "jumps over the quick brown fox", "barks at the moon", "is lazy"], "label": 3},
    {"ctx": "over the", "endings": ["lazy dog", "moon and back", "hills and far away", "top"], "label": 0},
]
for row in HELLASWAG:
    row.update(activity_label="fox", ctx_a=row["ctx"].split(" ")[0], ctx_b=" ".join(row["ctx"].split(" ")[1:]))
SCORES = {"hellaswag": ("acc", "acc_norm", "acc_bytes"), "plain": ("acc", "acc_norm", "acc_norm_bytes")}
PLAIN = [
    {"context": "the quick", "choices": ["brown fox", "slow snail", "red"], "label": 0},
    {"context": "jumps over the", "choices": ["lazy dog", "fence"], "label": 1},
]
LAYOUTS = [  # (what, ranks, --set overrides)
    ("tensor parallel 2", 2, ["dist.tensor_parallel=2", "dist.sequence_parallel=false"]),
    ("tensor parallel 2, sequence parallel", 2, ["dist.tensor_parallel=2", "dist.sequence_parallel=true"]),
    ("ZeRO 3 over 2 ranks", 2, ["dist.zero_stage=3"]),
    ("pipeline 2", 2, ["dist.pipeline_parallel=2"]),
    ("pipeline 2, interleaved", 2, ["dist.pipeline_parallel=2", "dist.pipeline_schedule=interleaved",
                                    "dist.virtual_stages=2"]),
    ("context parallel 2", 2, ["dist.context_parallel=2"]),
    ("tensor 2 x data 2, ZeRO 3", 4, ["dist.tensor_parallel=2", "dist.zero_stage=3"]),
]


def load_result(run_dir, name):
    with open(f"{run_dir}/tasks/{name}/step_00000031.json") as f:
        return json.load(f)


def same(got, want, what, name):
    scores = SCORES[name]
    check(got["n"] == want["n"] and all(got[k] == want[k] for k in scores),
          f"{what}: n {got['n']}, {', '.join(f'{k} {got[k]}' for k in scores)} "
          f"(want {', '.join(str(want[k]) for k in scores)})")
    keys = ("label", "ending_tokens", *("choice" + k[len("acc"):] for k in scores))
    check(all([a[k] for k in keys] == [b[k] for k in keys] for a, b in zip(got["predictions"], want["predictions"])),
          f"{what}: every example's choices and token counts")
    worst = max(abs(x - y) for a, b in zip(got["predictions"], want["predictions"])
                for x, y in zip(a["logliks"], b["logliks"]))
    check(worst <= TOL, f"{what}: log-likelihoods within {TOL} (largest difference {worst:.2e})")


with tempfile.TemporaryDirectory() as tmp:
    text = "".join(f"the quick brown fox jumps over the lazy dog {i % 7}. fortune favors the bold.\n" for i in range(300))
    with open(f"{tmp}/corpus.txt", "w") as f:
        f.write(text)
    run("tokenize", "--input", f"{tmp}/corpus.txt", "--output", f"{tmp}/shards")
    for name, rows in (("hs", HELLASWAG), ("plain", PLAIN)):
        with open(f"{tmp}/{name}.jsonl", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    config = {"model": {"vocab_size": 256, "context_length": 256, "n_layer": 4, "n_head": 2, "d_model": 32},
              "data": {"train": f"{tmp}/shards/train_*.bin", "val": f"{tmp}/shards/val_*.bin"},
              "train": {"micro_batch_size": 2, "global_batch_size": 8, "max_steps": 31, "eval_every": 0,
                        "eval_batches": 1, "log_every": 100,
                        "eval_tasks": [{"task": "hellaswag", "path": f"{tmp}/hs.jsonl"},
                                       {"task": "choice", "path": f"{tmp}/plain.jsonl", "name": "plain"}]},
              "optim": {"lr": 0.01, "warmup_steps": 2},
              "checkpoint": {"every": 30}}
    with open(f"{tmp}/c.json", "w") as f:
        json.dump(config, f)
    # 30 steps on one rank (validating only at the end), then one more update from there per layout.
    run("train", "--config", f"{tmp}/c.json", "--run-dir", f"{tmp}/base", "--set", "train.max_steps=30")
    start = f"{tmp}/base/checkpoints/step_00000030"

    # 1. One rank against eval --task's independent scoring.
    one = run("train", "--config", f"{tmp}/c.json", "--run-dir", f"{tmp}/one", "--resume", start)
    notes = re.findall(r"train\.eval_tasks (\w+): (\d+) sequences in (\d+) micro-batches, ([\d.]+)M positions per "
                       r"validation \(padding each to the context: ([\d.]+)M\)", one.stderr.decode())
    # hellaswag: 20 endings in 10 micro-batches of 2, the long context's four endings in two of
    # the whole context (256), the rest of 64 positions; plain: 5 choices in 3 micro-batches of 64.
    check(notes == [("hellaswag", "20", "10", f"{(2 * 256 + 8 * 64) * 2 / 1e6:.3g}", f"{10 * 2 * 256 / 1e6:.3g}"),
                    ("plain", "5", "3", f"{3 * 2 * 64 / 1e6:.3g}", f"{3 * 2 * 256 / 1e6:.3g}")],
          f"the start-up lines count each task's positions per validation: {notes}")
    with open(f"{tmp}/one/metrics.jsonl") as f:
        line = [m for m in map(json.loads, f) if "hellaswag/acc" in m]
    reference = {}
    for name, task, path in (("hellaswag", "hellaswag", "hs.jsonl"), ("plain", "choice", "plain.jsonl")):
        reference[name] = load_result(f"{tmp}/one", name)
        run("eval", "--checkpoint", f"{tmp}/one", "--task", task, f"{tmp}/{path}", "--json", f"{tmp}/{name}.json")
        with open(f"{tmp}/{name}.json") as f:
            independent = json.load(f)
        independent["task"] = reference[name]["task"]
        same(reference[name], independent, f"one rank, {name}: train.eval_tasks vs eval --task", name)
        check(len(line) == 1 and all(line[0][f"{name}/{k}"] == reference[name][k] for k in SCORES[name]),
              f"one rank, {name}: metrics.jsonl's scores are the predictions file's")
    check(reference["hellaswag"]["predictions"][1]["ending_tokens"] == [6, 9, 15, 2],
          "a context longer than the model's keeps its last tokens (the endings' counts unchanged)")
    logliks = [x for p in reference["hellaswag"]["predictions"] for x in p["logliks"]]
    check(len(set(logliks)) == len(logliks) and all(x < 0 for x in logliks), "every log-likelihood negative and its own")

    # 2. Every other layout.
    for what, ranks, sets in LAYOUTS:
        run_dir = f"{tmp}/{what.replace(' ', '_').replace(',', '')}"
        overrides = [arg for s in sets for arg in ("--set", s)]
        run("train", "--config", f"{tmp}/c.json", "--run-dir", run_dir, "--resume", start, *overrides, ranks=ranks)
        for name in ("hellaswag", "plain"):
            same(load_result(run_dir, name), reference[name], f"{what}, {name}", name)

    # 3. eval --task on tensor and context ranks.
    for what, option in (("tensor parallel 2", "--tensor-parallel"), ("context parallel 2", "--context-parallel")):
        for name, task, path in (("hellaswag", "hellaswag", "hs.jsonl"), ("plain", "choice", "plain.jsonl")):
            out = f"{tmp}/{name}_{option[2:]}.json"
            run("eval", "--checkpoint", f"{tmp}/one", "--task", task, f"{tmp}/{path}", option, "2", "--json", out,
                ranks=2)
            with open(out) as f:
                got = json.load(f)
            got["task"] = reference[name]["task"]
            same(got, reference[name], f"eval --task {name} {option} 2", name)

if failures:
    print(f"{len(failures)} check(s) failed")
    sys.exit(1)
print("all checks passed")
