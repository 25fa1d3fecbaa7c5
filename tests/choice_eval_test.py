#!/usr/bin/python3
"""eval --task hellaswag_llmc|choice on the Hugging Face export of a tiny GPT-2 trained a few steps
on byte-tokenized text:

  1. every example's log-likelihood of each ending (its byte tokens after the context's, given
     the context) equals transformers' within 1e-4 (an independent forward pass), and the
     choices follow from those figures by the task's rules (llm.c's: the highest total, the
     highest mean per ending token; and for choice the highest total per UTF-8 byte). The rules
     are the ones this file states, not an outside reference: hellaswag_harness_test.py compares
     eval --task hellaswag with lm-evaluation-harness's own hellaswag task;
  2. the same figures under mpirun -np 2 (examples spread over the ranks), with the plain
     {"context", "choices", "label"} format (--task choice) and through train.eval_tasks;
  3. a bad task file exits 2 with one line naming the file and line, writing no --json file.

Usage: choice_eval_test.py LLMTRAIN [MPIEXEC]
Without torch and transformers for /usr/bin/python3 (nor in the repository's .venv-lm-eval, made
by scripts/setup.sh --with-lm-eval) it runs 2. and 3. and prints SKIPPED for 1.
"""
import json
import math
import os
import subprocess
import sys
import tempfile

# Where /usr/bin/python3 lacks torch and transformers, the repository's .venv-lm-eval (which has
# them) runs this file instead.
VENV_PYTHON = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, ".venv-lm-eval", "bin", "python")
try:
    import torch  # noqa: F401
    import transformers  # noqa: F401
except ImportError:
    if os.path.exists(VENV_PYTHON) and os.path.abspath(sys.executable) != os.path.abspath(VENV_PYTHON):
        os.execv(VENV_PYTHON, [VENV_PYTHON, os.path.abspath(__file__), *sys.argv[1:]])

LLMTRAIN = sys.argv[1]
MPIEXEC = sys.argv[2] if len(sys.argv) > 2 else ""
TOL = 1e-4
failures = []
ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")


def check(ok, what):
    print(("ok: " if ok else "FAILED: ") + what, flush=True)
    if not ok:
        failures.append(what)


def run(*args, expect=0, mpi=0):
    command = [LLMTRAIN, *args]
    if mpi:
        command = [MPIEXEC, "--allow-run-as-root", "--oversubscribe", "-np", str(mpi), *command]
    r = subprocess.run(command, capture_output=True, env=ENV)
    if r.returncode != expect:
        sys.exit(f"FAILED: {' '.join(command)}: exit {r.returncode}\n{r.stderr.decode(errors='replace')}")
    return r


# Hand-made examples in HellaSwag's format: two-byte UTF-8 in some endings (bytes != characters),
# endings of different lengths, a label given as a string as the Hugging Face copy has it.
EXAMPLES = [
    {"ctx": "the quick brown fox", "endings": ["jumps over the lazy dog", "sat", "caf\u00e9 au lait", "runs"], "label": 0},
    {"ctx": "a man is sitting on a roof. he", "endings": ["is using wrap to wrap a pair of skis.",
                                                          "starts pulling up roofing on a roof.",
                                                          "is ripping level tiles off.", "holds a dog"], "label": 1},
    {"ctx": "fortune", "endings": ["favors the bold", "cookie", "\u00e9t\u00e9", "x"], "label": "2"},
    {"ctx": "the lazy dog", "endings": ["sleeps", "jumps over the quick brown fox", "barks at the moon", "is lazy"], "label": 3},
    {"ctx": "over the", "endings": ["lazy dog", "moon and back", "hills and far away", "top"], "label": 0},
]


def reference(logliks_of, task):
    """The scores and choices that each ending's log-likelihood and token count imply for `task`."""
    preds = []
    rules = {"choice": "total", "choice_norm": "per token"} if task == "hellaswag_llmc" else \
        {"choice": "total", "choice_norm": "per token", "choice_norm_bytes": "per byte"}
    for i, ex in enumerate(EXAMPLES):
        ll = logliks_of[i]
        tokens = [len((" " + e).encode()) for e in ex["endings"]]  # bytes: one token each
        divisor = {"total": [1] * len(ll), "per token": tokens, "per byte": [len(e.encode()) for e in ex["endings"]]}
        argmax = lambda xs: max(range(len(xs)), key=lambda k: (xs[k], -k))
        pred = {"label": int(ex["label"]), "ending_tokens": tokens}
        for key, rule in rules.items():
            pred[key] = argmax([l / d for l, d in zip(ll, divisor[rule])])
        preds.append(pred)
    n = len(preds)
    acc = {"acc" + key[len("choice"):]: sum(p[key] == p["label"] for p in preds) / n for key in rules}
    return preds, acc


def same_result(got, want, what, keys=("acc", "acc_norm")):
    check(got["n"] == want["n"] and got["task"] == want["task"], f"{what}: task and n")
    for k in keys:
        check(abs(got[k] - want[k]) < 1e-12, f"{what}: {k} {got[k]} vs {want[k]}")
    picks = ["choice" + k[len("acc"):] for k in keys] + ["ending_tokens"]
    for a, b in zip(got["predictions"], want["predictions"]):
        check(all(abs(x - y) <= TOL for x, y in zip(a["logliks"], b["logliks"])) and
              [a[k] for k in picks] == [b[k] for k in picks], f"{what}: example {a['index']}")


with tempfile.TemporaryDirectory() as tmp:
    text = "".join(f"the quick brown fox jumps over the lazy dog {i % 7}. fortune favors the bold.\n" for i in range(300))
    with open(f"{tmp}/corpus.txt", "w") as f:
        f.write(text)
    run("tokenize", "--input", f"{tmp}/corpus.txt", "--output", f"{tmp}/shards")
    config = {"model": {"vocab_size": 256, "context_length": 64, "n_layer": 2, "n_head": 2, "d_model": 32},
              "data": {"train": f"{tmp}/shards/train_*.bin", "val": f"{tmp}/shards/val_*.bin"},
              "train": {"micro_batch_size": 4, "global_batch_size": 8, "max_steps": 30, "eval_every": 0},
              "optim": {"lr": 0.01, "warmup_steps": 2}}
    with open(f"{tmp}/c.json", "w") as f:
        json.dump(config, f)
    run("train", "--config", f"{tmp}/c.json", "--run-dir", f"{tmp}/run")
    with open(f"{tmp}/hs.jsonl", "w") as f:
        for ex in EXAMPLES:
            f.write(json.dumps(ex) + "\n")
    out = run("eval", "--checkpoint", f"{tmp}/run", "--task", "hellaswag_llmc", f"{tmp}/hs.jsonl", "--json",
              f"{tmp}/hs.json")
    with open(f"{tmp}/hs.json") as f:
        got = json.load(f)
    print(out.stdout.decode().strip())
    check(f"acc {got['acc']:.4f} | acc_norm {got['acc_norm']:.4f}\n" in out.stdout.decode() and
          "acc_norm_bytes" not in got, "the printed scores are the --json file's, llm.c's two")
    # Internal consistency: the choices follow from the reported log-likelihoods.
    preds, acc = reference([p["logliks"] for p in got["predictions"]], "hellaswag_llmc")
    check([[p[k] for k in ("choice", "choice_norm", "ending_tokens")] for p in preds] ==
          [[p[k] for k in ("choice", "choice_norm", "ending_tokens")] for p in got["predictions"]],
          "choices and token counts follow from the log-likelihoods")

    # 2. Two ranks; the plain format.
    if MPIEXEC:
        run("eval", "--checkpoint", f"{tmp}/run", "--task", "hellaswag_llmc", f"{tmp}/hs.jsonl", "--json",
            f"{tmp}/hs2.json", mpi=2)
        with open(f"{tmp}/hs2.json") as f:
            same_result(json.load(f), got, "mpirun -np 2")
    else:
        print("SKIPPED: no mpirun in this build: the two-rank comparison")
    with open(f"{tmp}/plain.jsonl", "w") as f:
        for ex in EXAMPLES:
            f.write(json.dumps({"context": ex["ctx"], "choices": ex["endings"], "label": int(ex["label"])}) + "\n")
    run("eval", "--checkpoint", f"{tmp}/run", "--task", "choice", f"{tmp}/plain.jsonl", "--json", f"{tmp}/plain.json")
    with open(f"{tmp}/plain.json") as f:
        plain = json.load(f)
    plain_preds, plain_acc = reference([p["logliks"] for p in plain["predictions"]], "choice")
    check(all(abs(plain[k] - plain_acc[k]) < 1e-12 for k in plain_acc) and
          [p["choice_norm_bytes"] for p in plain["predictions"]] == [p["choice_norm_bytes"] for p in plain_preds],
          "--task choice: acc_norm_bytes follows from its log-likelihoods")
    plain["task"] = "hellaswag_llmc"
    same_result(plain, got, "--task choice")

    # train.eval_tasks: the same scores at the run's last validation (the same weights as the
    # checkpoint above), at one rank and, spread over them, at two.
    config["train"]["eval_every"] = 30
    config["train"]["eval_tasks"] = [{"task": "hellaswag_llmc", "path": f"{tmp}/hs.jsonl"},
                                     {"task": "choice", "path": f"{tmp}/plain.jsonl", "limit": 3, "name": "plain3"}]
    with open(f"{tmp}/tasks.json", "w") as f:
        json.dump(config, f)
    for ranks in (1, 2) if MPIEXEC else (1,):
        run_dir = f"{tmp}/tasks{ranks}"
        r = run("train", "--config", f"{tmp}/tasks.json", "--run-dir", run_dir, mpi=ranks if ranks > 1 else 0)
        with open(f"{run_dir}/metrics.jsonl") as f:
            line = [m for m in map(json.loads, f) if "hellaswag_llmc/acc" in m]
        check(len(line) == 1 and line[0]["step"] == 30, f"{ranks} rank(s): one validation with task scores")
        m = line[0]
        check(all(m[f"hellaswag_llmc/{k}"] == got[k] for k in ("acc", "acc_norm")) and
              "hellaswag_llmc/acc_norm_bytes" not in m and "plain3/acc_norm_bytes" in m,
              f"{ranks} rank(s): train.eval_tasks' hellaswag_llmc scores are eval --task's")
        first3 = [p["choice"] == p["label"] for p in got["predictions"][:3]]
        check(abs(m["plain3/acc"] - sum(first3) / 3) < 1e-12, f"{ranks} rank(s): a named task with a limit")
        check(f"hellaswag_llmc/acc {got['acc']:.4f}" in r.stderr.decode(), f"{ranks} rank(s): the scores in the log line")

    # 3. Bad files.
    with open(f"{tmp}/bad.jsonl", "w") as f:
        f.write(json.dumps(EXAMPLES[0]) + "\n" + json.dumps(dict(EXAMPLES[1], label=4)) + "\n")
    r = run("eval", "--checkpoint", f"{tmp}/run", "--task", "hellaswag_llmc", f"{tmp}/bad.jsonl", "--json",
            f"{tmp}/bad.json", expect=2)
    err = r.stderr.decode()
    check(err.count("\n") == 1 and f"{tmp}/bad.jsonl:2: \"label\" must be the index of one of the 4 choices, got 4" in err
          and not os.path.exists(f"{tmp}/bad.json"), f"a label out of range: {err.strip()}")

    # 1. transformers on the export.
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        print(f"SKIPPED: the comparison with transformers needs torch and transformers ({e}); "
              "install them with scripts/setup.sh --with-lm-eval (or --with-torch --with-onnx)")
        sys.exit(1 if failures else 0)
    run("export", "--checkpoint", f"{tmp}/run", "--output", f"{tmp}/hf", "--format", "hf")
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(f"{tmp}/hf", torch_dtype=torch.float32, attn_implementation="eager")
    model.eval()
    logliks = []
    for ex in EXAMPLES:
        context = list(ex["ctx"].encode())  # the byte tokenizer: token id = byte
        row = []
        for ending in ex["endings"]:
            tail = list((" " + ending).encode())
            ids = (context + tail)[-65:]  # at most context_length + 1 tokens
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([ids[:-1]])).logits[0].double()
            logprobs = torch.log_softmax(logits, dim=-1)
            row.append(sum(float(logprobs[len(ids) - 1 - len(tail) + k, t]) for k, t in enumerate(tail)))
        logliks.append(row)
    preds, acc = reference(logliks, "hellaswag_llmc")
    want = {"task": "hellaswag_llmc", "n": len(EXAMPLES), **acc,
            "predictions": [dict(p, index=i, logliks=logliks[i]) for i, p in enumerate(preds)]}
    same_result(got, want, "transformers")
    print(f"transformers: acc {acc['acc']:.4f} acc_norm {acc['acc_norm']:.4f}")

sys.exit(1 if failures else 0)
