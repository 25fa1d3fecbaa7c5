#!/usr/bin/python3
"""export --format onnx, checked by ONNX and ONNX Runtime, for a tiny GPT-2 and a tiny Llama with
GQA (configs/tiny.json, configs/tiny-llama.json) trained a few steps on byte-tokenized text:

  1. onnx.checker.check_model (full_check) passes on the cached and the --no-cache export;
  2. ONNX Runtime's logits on a batch of 2 sequences of different lengths (right- and left-padded,
     with attention_mask; cached and --no-cache graphs) equal, within 1e-4, `llmtrain eval
     --dump-logits`'s and those of the Hugging Face export run by `transformers` (skipped visibly
     where transformers is missing: scripts/setup.sh --with-torch --with-onnx);
  3. ONNX Runtime's mean loss over the first eval batch equals `llmtrain eval`'s val_loss (printed
     to 4 decimals);
  4. greedy decoding of 32 tokens through the cache inputs and outputs (past_key_values.*,
     present.*, position_ids) equals `llmtrain generate --temperature 0` token for token;
  5. --dtype fp16 and --external-data exports load and agree with fp32 within fp16's precision.

Usage: onnx_export_test.py LLMTRAIN SOURCE_DIR
Needs onnx and onnxruntime (`scripts/setup.sh --with-onnx`); without them it prints SKIPPED and exits 0.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

try:
    import numpy as np
    import onnx
    import onnxruntime as ort
except ImportError as e:
    print(f"SKIPPED: onnx export test needs numpy, onnx and onnxruntime for /usr/bin/python3 ({e}); "
          "install them with scripts/setup.sh --with-onnx")
    sys.exit(0)

LLMTRAIN, SOURCE = sys.argv[1], sys.argv[2]
TOL = 1e-4
failures = []


def check(ok, what):
    print(("ok: " if ok else "FAILED: ") + what, flush=True)
    if not ok:
        failures.append(what)


def run(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    r = subprocess.run([LLMTRAIN, *args], capture_output=True, env=env)
    if r.returncode != 0:
        sys.exit(f"FAILED: llmtrain {' '.join(args)}: exit {r.returncode}\n{r.stderr.decode(errors='replace')}")
    return r.stdout


def load_transformers(hf_dir):
    """The Hugging Face export loaded by transformers (float32, eager attention), or None where
    transformers is not installed."""
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        print(f"SKIPPED: the comparison with transformers needs torch and transformers ({e}); "
              "install them with scripts/setup.sh --with-torch --with-onnx")
        return None
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32, attn_implementation="eager")
    model.eval()

    def logits(ids, mask, positions):
        with torch.no_grad():
            out = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                        position_ids=torch.from_numpy(positions), use_cache=False)
        return out.logits.numpy()
    return logits


def empty_past(sess, batch):
    past = {}
    for i in sess.get_inputs():
        if i.name.startswith("past_key_values."):
            past[i.name] = np.zeros((batch, i.shape[1], 0, i.shape[3]), dtype=np.float32)
    return past


def cached_forward(sess, ids, mask, positions, past):
    """One call of the cached graph: returns logits and the next past (from present.*)."""
    feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": positions, **past}
    names = [o.name for o in sess.get_outputs()]
    outs = dict(zip(names, sess.run(names, feeds)))
    nxt = {n.replace("present.", "past_key_values."): v for n, v in outs.items() if n.startswith("present.")}
    return outs["logits"], nxt


def greedy(sess, prompt, n):
    ids = np.array([prompt], dtype=np.int64)
    past = empty_past(sess, 1)
    out, pos = [], 0
    for _ in range(n):
        S = ids.shape[1]
        mask = np.ones((1, pos + S), dtype=np.int64)
        positions = np.arange(pos, pos + S, dtype=np.int64)[None]
        logits, past = cached_forward(sess, ids, mask, positions, past)
        nxt = int(np.argmax(logits[0, -1]))
        out.append(nxt)
        pos += S
        ids = np.array([[nxt]], dtype=np.int64)
    return out


def one_model(work, name, config):
    print(f"--- {name} ({config})", flush=True)
    cfg = os.path.join(SOURCE, "configs", config)
    run_dir = os.path.join(work, "run-" + name)
    run("train", "--config", cfg, "--run-dir", run_dir, "--set", "train.max_steps=150",
        "--set", f"data.train={work}/data/train_*.bin", "--set", f"data.val={work}/data/val_*.bin",
        "--set", "checkpoint.every=150", "--set", "train.eval_every=0", "--set", "train.log_every=100")
    dirs = {k: os.path.join(work, f"{k}-{name}") for k in ("onnx", "nocache", "fp16", "ext", "hf")}
    run("export", "--checkpoint", run_dir, "--output", dirs["onnx"], "--format", "onnx")
    run("export", "--checkpoint", run_dir, "--output", dirs["nocache"], "--format", "onnx", "--no-cache")
    run("export", "--checkpoint", run_dir, "--output", dirs["fp16"], "--format", "onnx", "--dtype", "fp16")
    run("export", "--checkpoint", run_dir, "--output", dirs["ext"], "--format", "onnx", "--external-data")
    run("export", "--checkpoint", run_dir, "--output", dirs["hf"], "--format", "hf")

    for k in ("onnx", "nocache", "fp16"):
        onnx.checker.check_model(os.path.join(dirs[k], "model.onnx"), full_check=True)
    check(True, f"{name}: onnx.checker.check_model(full_check=True) passes (cache, --no-cache, fp16)")
    check(os.path.exists(os.path.join(dirs["onnx"], "tokenizer.json")) and
          json.load(open(os.path.join(dirs["onnx"], "config.json")))["vocab_size"] == 256,
          f"{name}: config.json and tokenizer.json beside model.onnx")

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(os.path.join(dirs["onnx"], "model.onnx"), opts, providers=["CPUExecutionProvider"])
    nocache = ort.InferenceSession(os.path.join(dirs["nocache"], "model.onnx"), opts,
                                   providers=["CPUExecutionProvider"])

    # 2. and 3. llmtrain eval on its first batch of validation samples (in order): its val_loss,
    # and its logits (--dump-logits, (B, T, V) of the first micro-batch).
    c = json.load(open(cfg))
    T, G = c["model"]["context_length"], c["train"]["global_batch_size"]
    dump = os.path.join(work, f"eval-logits-{name}.npy")
    out = run("eval", "--checkpoint", run_dir, "--batches", "1", "--dump-logits", dump).decode()
    eval_loss = float(out.split("val_loss")[1].split()[0])
    eval_logits = np.load(dump)
    check(eval_logits.shape == (c["train"]["micro_batch_size"], T, 256) and eval_logits.dtype == np.float32,
          f"{name}: eval --dump-logits writes (B, T, V) float32 ({eval_logits.shape})")
    val = np.fromfile(os.path.join(work, "data", "val_000000.bin"), dtype="<u2", offset=1024).astype(np.int64)
    batch = np.stack([val[i * T:i * T + T + 1] for i in range(G)])

    # A batch of 2 sequences of different lengths: the first 23 and 11 tokens of validation samples
    # 0 and 1, right- and left-padded, with attention_mask. The model is causal, so eval's logits
    # of the whole samples hold those of the prefixes in their first positions.
    seqs = [batch[0, :23], batch[1, :11]]
    S = max(len(s) for s in seqs)
    hf = load_transformers(dirs["hf"])
    for padding in ("right", "left"):
        ids = np.zeros((2, S), dtype=np.int64)
        mask = np.zeros((2, S), dtype=np.int64)
        spans = []
        for b, s in enumerate(seqs):
            a = 0 if padding == "right" else S - len(s)
            ids[b, a:a + len(s)], mask[b, a:a + len(s)] = s, 1
            spans.append((a, a + len(s)))
        positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
        results = {"--no-cache": nocache.run(["logits"], {"input_ids": ids, "attention_mask": mask})[0]}
        results["cache"] = cached_forward(sess, ids, mask, positions, empty_past(sess, 2))[0]
        hf_logits = hf(ids, mask, positions) if hf else None
        for graph, logits in results.items():
            diff = max(np.abs(logits[b, a:e] - eval_logits[b, :e - a]).max() for b, (a, e) in enumerate(spans))
            check(diff < TOL, f"{name}: {graph} graph, {padding}-padded batch (lengths 23, 11): "
                  f"max |ONNX Runtime logits - llmtrain eval logits| = {diff:.2e} < {TOL}")
            if hf_logits is not None:
                diff = max(np.abs(logits[b, a:e] - hf_logits[b, a:e]).max() for b, (a, e) in enumerate(spans))
                check(diff < TOL, f"{name}: {graph} graph, {padding}-padded batch: max |ONNX Runtime logits - "
                      f"transformers logits of the HF export| = {diff:.2e} < {TOL}")

    logits = nocache.run(["logits"], {"input_ids": batch[:, :-1],
                                      "attention_mask": np.ones((G, T), dtype=np.int64)})[0].astype(np.float64)
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    onnx_loss = float((lse - np.take_along_axis(logits, batch[:, 1:, None], -1)[..., 0]).mean())
    check(abs(onnx_loss - eval_loss) < 1e-4,
          f"{name}: ONNX Runtime loss {onnx_loss:.6f} vs llmtrain eval val_loss {eval_loss:.4f} (printed to 4 places)")

    # 4. Greedy decoding through the cache vs llmtrain generate --temperature 0 (byte tokenizer: id = byte).
    prompt = "the quick "
    text = run("generate", "--checkpoint", run_dir, "--prompt", prompt, "--max-new-tokens", "32",
               "--temperature", "0")
    expected = list(text[len(prompt):len(prompt) + 32])
    got = greedy(sess, list(prompt.encode()), 32)
    same = sum(a == b for a, b in zip(got, expected))
    check(got == expected, f"{name}: greedy 32 tokens with past_key_values/present equal llmtrain generate "
          f"--temperature 0 ({same}/32 equal): {bytes(got)!r}")

    # 6. A checkpoint written by 4 ranks (tensor 2 x data 2, ZeRO 1: each rank its ranges, no
    # rank the whole model), exported tensor by tensor into Hugging Face shards: transformers
    # loads them and its loss on the first validation batch is llmtrain eval's of that checkpoint.
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        print(f"SKIPPED: {name}: the 4-rank export needs mpiexec")
    elif hf is not None:
        run4 = os.path.join(work, "run4-" + name)
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
        r = subprocess.run([mpiexec, "--allow-run-as-root", "--oversubscribe", "-np", "4", LLMTRAIN, "train",
                            "--config", cfg, "--run-dir", run4, "--set", "train.max_steps=20",
                            "--set", f"data.train={work}/data/train_*.bin", "--set", f"data.val={work}/data/val_*.bin",
                            "--set", "checkpoint.every=20", "--set", "train.eval_every=0", "--set", "dist.zero_stage=1",
                            "--set", "dist.tensor_parallel=2"], capture_output=True, env=env)
        if r.returncode != 0:
            sys.exit(f"FAILED: 4-rank run: {r.stderr.decode(errors='replace')[-2000:]}")
        step = os.path.join(run4, "checkpoints", "step_00000020")
        written = sorted(f for f in os.listdir(step) if f.startswith("model"))
        check(written == [f"model-{k:05d}.safetensors" for k in range(4)],
              f"{name}: the 4-rank checkpoint's weights are each rank's ranges (ZeRO 1 over data 2): {written}")
        sharded = os.path.join(work, f"hf4-{name}")
        run("export", "--checkpoint", run4, "--output", sharded, "--format", "hf", "--shard-gb", "0.00003")
        index = json.load(open(os.path.join(sharded, "model.safetensors.index.json")))
        shards = sorted(set(index["weight_map"].values()))
        check(len(shards) > 2 and all(os.path.exists(os.path.join(sharded, f)) for f in shards),
              f"{name}: export --shard-gb writes {len(shards)} shards and model.safetensors.index.json")
        loss4 = float(run("eval", "--checkpoint", run4, "--batches", "1").decode().split("val_loss")[1].split()[0])
        hf4 = load_transformers(sharded)
        logits4 = hf4(batch[:, :-1], np.ones((G, T), dtype=np.int64),
                      np.tile(np.arange(T, dtype=np.int64), (G, 1))).astype(np.float64)
        lse4 = np.log(np.exp(logits4 - logits4.max(-1, keepdims=True)).sum(-1)) + logits4.max(-1)
        hf_loss4 = float((lse4 - np.take_along_axis(logits4, batch[:, 1:, None], -1)[..., 0]).mean())
        check(abs(hf_loss4 - loss4) < 1e-4,
              f"{name}: transformers on the sharded export of the 4-rank checkpoint: loss {hf_loss4:.6f} vs "
              f"llmtrain eval {loss4:.4f}")
        run("export", "--checkpoint", run4, "--output", sharded + "-bf16", "--format", "hf", "--dtype", "bf16")
        hf16 = load_transformers(sharded + "-bf16")
        d = np.abs(hf16(batch[:2, :-1], np.ones((2, T), dtype=np.int64),
                        np.tile(np.arange(T, dtype=np.int64), (2, 1))) - logits4[:2]).max()
        check(d < 0.1, f"{name}: --dtype bf16 export: logits within {d:.1e} of fp32's")

    # 5. fp16 weights and external data.
    fp16 = ort.InferenceSession(os.path.join(dirs["fp16"], "model.onnx"), opts, providers=["CPUExecutionProvider"])
    ext = ort.InferenceSession(os.path.join(dirs["ext"], "model.onnx"), opts, providers=["CPUExecutionProvider"])
    one = {"input_ids": np.array([seqs[0]], dtype=np.int64), "attention_mask": np.ones((1, 23), dtype=np.int64),
           "position_ids": np.arange(23, dtype=np.int64)[None], **empty_past(sess, 1)}
    base = sess.run(["logits"], one)[0]
    d16 = np.abs(fp16.run(["logits"], one)[0] - base).max()
    dext = np.abs(ext.run(["logits"], one)[0] - base).max()
    check(d16 < 2e-2 and os.path.getsize(os.path.join(dirs["fp16"], "model.onnx")) <
          0.6 * os.path.getsize(os.path.join(dirs["onnx"], "model.onnx")),
          f"{name}: --dtype fp16: half the file, logits within {d16:.1e} of fp32")
    check(dext == 0 and os.path.exists(os.path.join(dirs["ext"], "model.onnx.data")),
          f"{name}: --external-data: model.onnx.data, logits identical ({dext})")


def main():
    with tempfile.TemporaryDirectory() as work:
        words = "the quick brown fox jumps over a lazy dog while the cat runs far away".split()
        rng = np.random.default_rng(1)
        with open(os.path.join(work, "text.txt"), "w") as f:
            f.write(" ".join(words[i] for i in rng.integers(0, len(words), size=12000)))
        run("tokenize", "--input", os.path.join(work, "text.txt"), "--output", os.path.join(work, "data"))
        one_model(work, "gpt2", "tiny.json")
        one_model(work, "llama", "tiny-llama.json")
    if failures:
        print(f"{len(failures)} check(s) FAILED")
        sys.exit(1)
    print("all ONNX export checks passed")


if __name__ == "__main__":
    main()
