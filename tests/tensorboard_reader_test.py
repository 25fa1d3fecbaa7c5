#!/usr/bin/python3
"""A run's TensorBoard event file, read back by TensorBoard's own readers (the `tensorboard`
package's event_file_loader, which checks every record's length and checksums, and its
EventAccumulator, what TensorBoard's dashboards are fed from), agrees with metrics.jsonl:

  1. the file starts with its version event, and every record loads;
  2. each named validation set's val_loss/NAME, the mean val_loss and a task's scores appear at
     exactly the validations' steps, each equal to metrics.jsonl's figure (as a 32-bit float);
  3. every scalar the file holds equals the metrics.jsonl figure of that name and step.

Usage: tensorboard_reader_test.py LLMTRAIN
Without the tensorboard package for /usr/bin/python3 (scripts/setup.sh --with-onnx) it prints
SKIPPED.
"""
import glob
import json
import os
import struct
import subprocess
import sys
import tempfile

try:
    from tensorboard.backend.event_processing import event_accumulator, event_file_loader
except ImportError as e:
    print(f"SKIPPED: /usr/bin/python3 has no tensorboard package ({e}); scripts/setup.sh --with-onnx installs it")
    sys.exit(0)

LLMTRAIN = sys.argv[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
failures = []


def check(ok, what):
    print(("ok: " if ok else "FAILED: ") + what, flush=True)
    if not ok:
        failures.append(what)


def run(*args):
    r = subprocess.run([LLMTRAIN, *args], capture_output=True, env=ENV)
    if r.returncode != 0:
        sys.exit(f"FAILED: llmtrain {' '.join(args)}: exit {r.returncode}\n{r.stderr.decode(errors='replace')}")
    return r


def f32(x):
    """x rounded to a 32-bit float, as an event's simple_value holds it."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


with tempfile.TemporaryDirectory() as tmp:
    corpora = {"words": "".join(f"the quick brown fox jumps over dog {i}\n" for i in range(300)),
               "numbers": "".join(f"{i * 7919 % 1000} + {i % 17} = ?\n" for i in range(400))}
    for name, text in corpora.items():
        with open(f"{tmp}/{name}.txt", "w") as f:
            f.write(text)
        run("tokenize", "--input", f"{tmp}/{name}.txt", "--output", f"{tmp}/{name}")
    with open(f"{tmp}/task.jsonl", "w") as f:
        for ctx, choices, label in (("the quick brown", ["fox", "dog", "= ?"], 0), ("12 +", ["5 = ?", "fox"], 0),
                                    ("jumps over", ["dog 7", "+ 3"], 0)):
            f.write(json.dumps({"context": ctx, "choices": choices, "label": label}) + "\n")
    config = {"model": {"vocab_size": 256, "context_length": 16, "n_layer": 1, "n_head": 2, "d_model": 16},
              "data": {"train": [{"path": f"{tmp}/words/train_*.bin", "weight": 0.75},
                                 {"path": f"{tmp}/numbers/train_*.bin", "weight": 0.25}],
                       "val": {"words": f"{tmp}/words/val_*.bin", "numbers": f"{tmp}/numbers/val_*.bin"}},
              "train": {"micro_batch_size": 2, "global_batch_size": 4, "max_steps": 8, "eval_every": 4,
                        "eval_batches": 2, "eval_tasks": [{"task": "choice", "path": f"{tmp}/task.jsonl"}]},
              "optim": {"warmup_steps": 1, "schedule": "constant"}}
    with open(f"{tmp}/c.json", "w") as f:
        json.dump(config, f)
    run("train", "--config", f"{tmp}/c.json", "--run-dir", f"{tmp}/run")
    with open(f"{tmp}/run/metrics.jsonl") as f:
        metrics = [json.loads(line) for line in f]
    events_files = glob.glob(f"{tmp}/run/tb/events.out.tfevents.*")
    check(len(events_files) == 1, "one event file in RUN_DIR/tb")

    # 1. Every record through TensorBoard's loader (it refuses a record whose checksums fail).
    events = list(event_file_loader.EventFileLoader(events_files[0]).Load())
    check(len(events) > 1 and events[0].file_version == "brain.Event:2", "the first event is the file version")
    check(all(e.wall_time > 1.6e9 for e in events), "every event has a wall time")

    # 2. The named sets, their mean and the task's scores, as TensorBoard's dashboards see them.
    acc = event_accumulator.EventAccumulator(f"{tmp}/run/tb", size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    evals = [m for m in metrics if "val_loss" in m]
    check([m["step"] for m in evals] == [4, 8], "metrics.jsonl: validations at steps 4 and 8")
    for tag in ("val_loss", "val_loss/words", "val_loss/numbers", "choice/acc", "choice/acc_norm", "choice/acc_norm_bytes"):
        if tag not in tags:
            check(False, f"TensorBoard has the tag {tag}")
            continue
        read = [(s.step, s.value) for s in acc.Scalars(tag)]
        want = [(m["step"], f32(m[tag])) for m in evals]
        check(read == want, f"{tag}: TensorBoard's {read} vs metrics.jsonl's {want}")
    words = [m["val_loss/words"] for m in evals]
    numbers = [m["val_loss/numbers"] for m in evals]
    check(all(abs(m["val_loss"] - (w + n) / 2) < 1e-12 and w != n for m, w, n in zip(evals, words, numbers)),
          "val_loss is the mean of two different sets' losses")

    # 3. Every scalar of the file is metrics.jsonl's figure of that name and step (memory_gb is
    # its memory_bytes in 10^9 bytes).
    by_step = {}
    for m in metrics:
        by_step.setdefault(m["step"], {}).update(m)
        if "memory_bytes" in m:
            by_step[m["step"]]["memory_gb"] = m["memory_bytes"] / 1e9
    scalars = 0
    for tag in sorted(tags):
        for s in acc.Scalars(tag):
            scalars += 1
            line = by_step.get(s.step, {})
            if tag not in line or f32(line[tag]) != s.value:
                check(False, f"{tag} at step {s.step}: TensorBoard's {s.value} vs metrics.jsonl's {line.get(tag)}")
    # Per update: loss, lr, grad_norm, tokens_per_s, memory_gb and the two sources' tokens seen
    # (mfu only where the device has a known peak); per validation 3 losses and 3 scores.
    per_update = 7 + ("mfu" in tags)
    check(scalars == 8 * per_update + 2 * 6, f"{scalars} scalars, every one of them metrics.jsonl's")

if failures:
    print(f"{len(failures)} check(s) failed")
    sys.exit(1)
print("all checks passed")
