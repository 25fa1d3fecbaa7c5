#!/usr/bin/python3
"""eval --task hellaswag against lm-evaluation-harness's own hellaswag task on the same model.

A tiny GPT-2 with a byte-level BPE tokenizer trained here (tokenize --tokenizer bpe:N) is trained
a few steps and exported (export --format hf). The harness runs its installed hellaswag task
(its process_docs, preprocess and metrics, included from its own YAML) on a local JSON Lines file
of HellaSwag items made here, with WikiHow tags ([title], [step], [header], [substeps]), accented
and otherwise non-ASCII letters, upper case to fold, an empty ctx_b and a context longer than the
model's, through its Hugging Face backend on the export (float32, CPU, every request logged).
Then, at 1 rank and at 2 (mpirun), eval --task hellaswag must give:

  1. every query and every continuation exactly as the harness built them (its logged arguments);
  2. every ending's log-likelihood within 1e-4 of the harness's;
  3. acc, acc_norm and acc_bytes equal to the harness's, and every prediction's choices equal to
     those its per-item acc, acc_norm and acc_bytes imply.

Usage: hellaswag_harness_test.py LLMTRAIN SOURCE_DIR [MPIEXEC]
The harness is looked for in SOURCE_DIR/.venv-lm-eval (scripts/setup.sh --with-lm-eval); without
it the test prints SKIPPED.
"""
import glob
import json
import os
import subprocess
import sys
import tempfile

LLMTRAIN, SOURCE_DIR = sys.argv[1], sys.argv[2]
MPIEXEC = sys.argv[3] if len(sys.argv) > 3 else ""
HARNESS_PYTHON = os.path.join(SOURCE_DIR, ".venv-lm-eval", "bin", "python")
TOL = 1e-4
ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
failures = []


def check(ok, what):
    print(("ok: " if ok else "FAILED: ") + what, flush=True)
    if not ok:
        failures.append(what)


def run(command, env=ENV):
    r = subprocess.run(command, capture_output=True, env=env)
    if r.returncode != 0:
        sys.exit(f"FAILED: {' '.join(command)}: exit {r.returncode}\n{r.stderr.decode(errors='replace')[-4000:]}")
    return r


probe = subprocess.run([HARNESS_PYTHON, "-c", "import lm_eval, lm_eval.models.huggingface, os; "
                        "print(os.path.dirname(lm_eval.__file__))"], capture_output=True) \
    if os.path.exists(HARNESS_PYTHON) else None
if probe is None or probe.returncode != 0:
    why = "no " + HARNESS_PYTHON if probe is None else probe.stderr.decode(errors="replace").strip().splitlines()[-1]
    print(f"SKIPPED: lm-evaluation-harness is not installed ({why}); install it with scripts/setup.sh --with-lm-eval")
    sys.exit(0)
HARNESS_DIR = probe.stdout.decode().strip()
version = subprocess.run([HARNESS_PYTHON, "-c", "import importlib.metadata as m; print(m.version('lm_eval'))"],
                         capture_output=True).stdout.decode().strip()
print(f"lm-evaluation-harness {version} at {HARNESS_DIR}")


def item(i, label, ctx_a, ctx_b, endings, activity="Baking bread"):
    """One line in HellaSwag's published form (the Hugging Face copy's fields and label strings)."""
    return {"ind": i, "activity_label": activity, "ctx_a": ctx_a, "ctx_b": ctx_b,
            "ctx": (ctx_a + " " + ctx_b).strip(), "endings": endings, "source_id": f"wikihow~{i}",
            "split": "val", "split_type": "indomain", "label": str(label)}


ITEMS = [
    item(0, 2, "[header] How to bake bread [title] Preheat the oven. [step] Heat it to 200 degrees.",
         "THEN mix the flour", ["[substeps] with water and salt.", "and  the yeast  [step] in a bowl.",
                                "until it is smooth [title] Knead it.", "over the oven."]),
    item(1, 0, "A man is in a caf\u00e9 with a cr\u00e8me br\u00fbl\u00e9e.", "\u00e9LAN is what he SHOWS",
         ["as he eats the cr\u00e8me.", "na\u00efvely to the \u00c9cole.", "sitting \u00e0 la fen\u00eatre.",
          "and leaves."], activity="Eating dessert"),
    item(2, 3, "[title] How to say hello in German [step] Use \u00dcbung.", "\u00dfTRASSE is a street",
         ["[step] Stra\u00dfe is the word.", "\u00fcber alles.", "M\u00fcller says it.", "and so on."],
         activity="Learning \u00c5ngstr\u00f6m"),
    item(3, 1, "The ni\u00f1o plays [step] with a ball.", "",
         ["  \u00f1and\u00fa runs.  ", "kicks it [header] far.", "sits.", "[substeps] Then he  cries."],
         activity="Playing"),
    item(4, 0, " ".join(["The quick brown fox jumps over the lazy dog near the bread oven."] * 6),
         "the fox", ["runs away.", "bakes bread [title] at night.", "sleeps.", "jumps over the oven."]),
    item(5, 2, "\u0130stanbul has a bazaar.", "\u01c6ungla and \u0181ALL",
         ["are names.", "\u0131s a word.", "\u1ebfT \u1ea0 are Vietnamese.", "xx"], activity="Travel"),
]

with tempfile.TemporaryDirectory() as tmp:
    text = "".join(f"[title] How to bake bread {i % 5}. [step] Preheat the oven, mix the flour with water. "
                   f"A man in a caf\u00e9 eats cr\u00e8me br\u00fbl\u00e9e. The quick brown fox jumps. "
                   f"Stra\u00dfe \u00fcber ni\u00f1o.\n" for i in range(200))
    with open(f"{tmp}/corpus.txt", "w") as f:
        f.write(text)
    run([LLMTRAIN, "tokenize", "--input", f"{tmp}/corpus.txt", "--output", f"{tmp}/shards", "--tokenizer", "bpe:320"])
    config = {"model": {"vocab_size": 320, "context_length": 64, "n_layer": 2, "n_head": 2, "d_model": 32},
              "data": {"train": f"{tmp}/shards/train_*.bin", "val": f"{tmp}/shards/val_*.bin"},
              "train": {"micro_batch_size": 4, "global_batch_size": 8, "max_steps": 30, "eval_every": 0},
              "optim": {"lr": 0.01, "warmup_steps": 2}}
    with open(f"{tmp}/c.json", "w") as f:
        json.dump(config, f)
    run([LLMTRAIN, "train", "--config", f"{tmp}/c.json", "--run-dir", f"{tmp}/run"])
    run([LLMTRAIN, "export", "--checkpoint", f"{tmp}/run", "--output", f"{tmp}/hf", "--format", "hf"])
    # The run's BPE files (tokenize wrote them beside the shards) under the names transformers'
    # GPT2Tokenizer reads, in a folder of their own (llmtrain's tokenizer.json is not a fast
    # tokenizer's).
    os.makedirs(f"{tmp}/hf_tokenizer")
    for ours, theirs in (("encoder.json", "vocab.json"), ("vocab.bpe", "merges.txt")):
        with open(f"{tmp}/shards/{ours}", "rb") as src, open(f"{tmp}/hf_tokenizer/{theirs}", "wb") as dst:
            dst.write(src.read())
    with open(f"{tmp}/hf_tokenizer/tokenizer_config.json", "w") as f:
        json.dump({"tokenizer_class": "GPT2Tokenizer", "model_max_length": 64}, f)
    with open(f"{tmp}/hs.jsonl", "w") as f:
        for it in ITEMS:
            f.write(json.dumps(it) + "\n")

    # The harness's own hellaswag task (its YAML, process_docs and preprocess) on the local file,
    # reporting acc_bytes as well.
    os.makedirs(f"{tmp}/tasks")
    with open(f"{tmp}/tasks/hellaswag_local.yaml", "w") as f:
        f.write(f"include: {HARNESS_DIR}/tasks/hellaswag/hellaswag.yaml\n"
                "task: hellaswag_local\n"
                "dataset_path: json\n"
                "dataset_name: null\n"
                f"dataset_kwargs:\n  data_files:\n    validation: {tmp}/hs.jsonl\n"
                "training_split: null\n"
                "metric_list:\n"
                + "".join(f"  - metric: {m}\n    aggregation: mean\n    higher_is_better: true\n"
                          for m in ("acc", "acc_norm", "acc_bytes")))
    offline = dict(ENV, HF_HOME=f"{tmp}/hf_home", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
                   TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    run([HARNESS_PYTHON, "-m", "lm_eval", "--model", "hf", "--model_args",
         f"pretrained={tmp}/hf,tokenizer={tmp}/hf_tokenizer,dtype=float32", "--tasks", "hellaswag_local",
         "--include_path", f"{tmp}/tasks", "--device", "cpu", "--batch_size", "1", "--output_path",
         f"{tmp}/harness", "--log_samples"], env=offline)
    results_file = glob.glob(f"{tmp}/harness/**/results_*.json", recursive=True)
    samples_file = glob.glob(f"{tmp}/harness/**/samples_hellaswag_local_*.jsonl", recursive=True)
    if len(results_file) != 1 or len(samples_file) != 1:
        sys.exit(f"FAILED: the harness wrote {results_file} and {samples_file}")
    with open(results_file[0]) as f:
        harness = json.load(f)["results"]["hellaswag_local"]
    with open(samples_file[0]) as f:
        samples = sorted(map(json.loads, f), key=lambda s: s["doc_id"])
    check(len(samples) == len(ITEMS), f"the harness scored {len(samples)} items")
    print(f"lm-evaluation-harness: acc {harness['acc,none']:.4f} acc_norm {harness['acc_norm,none']:.4f} "
          f"acc_bytes {harness['acc_bytes,none']:.4f}")

    def args_of(sample):
        """The (context, continuation) pairs the harness scored, in choice order."""
        args = sample["arguments"]
        rows = args.values() if isinstance(args, dict) else args
        return [(a["arg_0"], a["arg_1"]) if isinstance(a, dict) else tuple(a) for a in rows]

    for ranks in (1, 2) if MPIEXEC else (1,):
        what = f"{ranks} rank(s)"
        command = [LLMTRAIN, "eval", "--checkpoint", f"{tmp}/run", "--task", "hellaswag", f"{tmp}/hs.jsonl",
                   "--json", f"{tmp}/ours{ranks}.json"]
        if ranks > 1:
            command = [MPIEXEC, "--allow-run-as-root", "--oversubscribe", "-np", str(ranks), *command]
        out = run(command).stdout.decode()
        with open(f"{tmp}/ours{ranks}.json") as f:
            ours = json.load(f)
        print(out.strip())
        check(f"acc {ours['acc']:.4f} | acc_norm {ours['acc_norm']:.4f} | acc_bytes {ours['acc_bytes']:.4f}" in out,
              f"{what}: the printed scores are the --json file's")
        worst = 0.0
        for p, s in zip(ours["predictions"], samples):
            pairs = args_of(s)
            check(pairs == [(p["context"], " " + c) for c in p["choices"]],
                  f"{what}: item {p['index']}: query and continuations are the harness's")
            theirs = [float(r[0]) for r in s["filtered_resps"]]
            diffs = [abs(a - b) for a, b in zip(p["logliks"], theirs)]
            worst = max(worst, *diffs)
            check(len(theirs) == len(p["logliks"]) and max(diffs) <= TOL,
                  f"{what}: item {p['index']}: log-likelihoods {[round(x, 5) for x in p['logliks']]} vs "
                  f"{[round(x, 5) for x in theirs]}")
            for metric, pick in (("acc", "choice"), ("acc_norm", "choice_norm"), ("acc_bytes", "choice_bytes")):
                check(float(p[pick] == p["label"]) == float(s[metric]),
                      f"{what}: item {p['index']}: {metric} {s[metric]} (choice {p[pick]}, label {p['label']})")
        print(f"{what}: largest log-likelihood difference {worst:.2e}")
        for metric in ("acc", "acc_norm", "acc_bytes"):
            check(abs(ours[metric] - harness[f"{metric},none"]) < 1e-12,
                  f"{what}: {metric} {ours[metric]:.4f} vs the harness's {harness[metric + ',none']:.4f}")
    if not MPIEXEC:
        print("SKIPPED: no mpirun in this build: the two-rank comparison")

sys.exit(1 if failures else 0)
