#!/usr/bin/env python3
"""GPT-2 training throughput in PyTorch, and optionally llmtrain's on the same shapes and device.

The PyTorch side is what a careful PyTorch user would run: a plain nn.Module GPT-2 (tied
embeddings, GELU tanh), bf16 autocast, F.scaled_dot_product_attention(is_causal=True) (flash
attention on recent GPUs), fused AdamW and torch.compile, each used where the installed PyTorch
and the device have it (the output says which). Times --steps steps after --warmup steps and
prints tokens/s. With --llmtrain BINARY it then trains llmtrain on the same model, micro-batch,
T and precision (a synthetic token shard, as scripts/gpu_check.sh does) and prints both and the
ratio; the exit status is 1 when llmtrain's run fails.

  scripts/bench_vs_pytorch.py --batch 32 --llmtrain build-gpu/src/llmtrain      # GPU: GPT-2 124M, T=1024
  /usr/bin/python3 scripts/bench_vs_pytorch.py --device cpu --tiny --llmtrain build/src/llmtrain
"""
import argparse
import inspect
import json
import math
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib"))
import gpu_bench  # noqa: E402  (scripts/lib/gpu_bench.py: synthetic shard, llmtrain runs, MFU)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {"V": 256, "T": 64, "L": 2, "H": 4, "C": 64, "F": 256}


def torch_version():
    return tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2] if p.isdigit())


class Block(nn.Module):
    def __init__(self, C, H, F_):
        super().__init__()
        self.H = H
        self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.c_attn, self.c_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.c_fc, self.mlp_proj = nn.Linear(C, F_), nn.Linear(F_, C)
        self.sdpa = hasattr(F, "scaled_dot_product_attention")

    def attention(self, q, k, v):
        if self.sdpa:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        T = q.shape[-2]  # PyTorch < 2.0: written out
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
        att = att.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        return F.softmax(att, dim=-1) @ v

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        heads = lambda t: t.view(B, T, self.H, C // self.H).transpose(1, 2)  # noqa: E731
        y = self.attention(heads(q), heads(k), heads(v))
        x = x + self.c_proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT2(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(d["V"], d["C"]), nn.Embedding(d["T"], d["C"])
        self.blocks = nn.ModuleList(Block(d["C"], d["H"], d["F"]) for _ in range(d["L"]))
        self.ln_f = nn.LayerNorm(d["C"])
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.T  # tied head
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def pytorch_rate(d, batch, steps, warmup, device, precision, compile_wanted):
    """tokens/s of PyTorch training steps, and the features that were used."""
    torch.manual_seed(0)
    model = GPT2(d).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    features = []
    features.append("flash SDPA" if hasattr(F, "scaled_dot_product_attention") else "attention written out (no SDPA)")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    kwargs = {"lr": 6e-4, "betas": (0.9, 0.95), "eps": 1e-8}
    if device == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters:
        kwargs["fused"] = True
        features.append("fused AdamW")
    else:
        features.append("AdamW (not fused)")
    opt = torch.optim.AdamW(groups, **kwargs)
    step_model = model
    if compile_wanted and hasattr(torch, "compile") and device == "cuda":
        step_model = torch.compile(model)
        features.append("torch.compile")
    else:
        features.append("eager (no torch.compile)")
    use_autocast = precision == "bf16"
    features.append("bf16 autocast" if use_autocast else "fp32")
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = precision != "fp32"  # fp32: plain fp32, as llmtrain's
        torch.backends.cudnn.allow_tf32 = precision != "fp32"
    g = torch.Generator(device="cpu").manual_seed(1)
    idx = torch.randint(0, d["V"], (batch, d["T"]), generator=g).to(device)
    tgt = torch.randint(0, d["V"], (batch, d["T"]), generator=g).to(device)

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=use_autocast):
            loss = step_model(idx, tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(warmup):
        step()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        loss = step()
    sync()
    elapsed = time.perf_counter() - start
    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    return {"tokens_per_s": batch * d["T"] * steps / elapsed, "params": n_params, "features": features,
            "loss": float(loss), "peak_gib": peak_gib}


def llmtrain_config(d):
    """A llmtrain config of the same model: configs/gpt2-124m.json's keys with these dimensions."""
    with open(os.path.join(REPO, "configs", "gpt2-124m.json")) as f:
        config = json.load(f)
    config["model"].update({"vocab_size": d["V"], "context_length": d["T"], "n_layer": d["L"], "n_head": d["H"],
                            "d_model": d["C"], "ffn_hidden": d["F"]})
    return config


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help=f"a tiny model instead of GPT-2 124M: {TINY}")
    p.add_argument("--batch", type=int, default=None, help="micro-batch (default 16; 4 with --tiny)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 20; 5 with --tiny)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 5 with compile, else 2)")
    p.add_argument("--precision", choices=["bf16", "fp32"], default=None,
                   help="default bf16 on cuda, fp32 on the cpu")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (torch and llmtrain's OpenMP)")
    p.add_argument("--llmtrain", metavar="BINARY", help="also train llmtrain on the same shapes")
    p.add_argument("--json", metavar="FILE", help="write PyTorch's result here (gpu_check.sh's suite reads it)")
    a = p.parse_args()

    d = dict(TINY) if a.tiny else {"V": 50257, "T": 1024, "L": 12, "H": 12, "C": 768, "F": 3072}
    batch = a.batch or (4 if a.tiny else 16)
    steps = a.steps or (5 if a.tiny else 20)
    precision = a.precision or ("bf16" if a.device == "cuda" else "fp32")
    compile_wanted = not a.no_compile and not a.tiny
    warmup = a.warmup if a.warmup is not None else (5 if compile_wanted else 2)
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_vs_pytorch.py: --device cuda but PyTorch sees no GPU (--device cpu runs on the CPU)")
    if a.threads:
        torch.set_num_threads(a.threads)
        os.environ["OMP_NUM_THREADS"] = str(a.threads)
    device_name = torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu"
    n_params = gpu_bench.gpt2_parameters(d)
    flops = gpu_bench.flops_per_token(d, n_params)
    peak, peak_text = gpu_bench.peak_tflops(device_name, precision, os.environ.get("PEAK_TFLOPS")) \
        if a.device == "cuda" else (None, "no peak for CPUs")

    print(f"model: GPT-2 L={d['L']} H={d['H']} C={d['C']} V={d['V']}, {n_params:,} parameters; micro-batch {batch}, "
          f"T={d['T']}, {precision}, {steps} timed steps after {warmup}; device: {device_name}; "
          f"PyTorch {torch.__version__}")
    try:
        mine = pytorch_rate(d, batch, steps, warmup, a.device, precision, compile_wanted)
    except torch.cuda.OutOfMemoryError as e:
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"error": f"out of memory at micro-batch {batch}: {str(e).splitlines()[0]}", "oom": True}, f)
        print(f"pytorch : out of memory at micro-batch {batch}")
        return 1
    if a.json:
        with open(a.json, "w") as f:
            json.dump({**mine, "batch": batch, "steps": steps, "warmup": warmup, "torch": torch.__version__,
                       "precision": precision}, f, indent=1)
    assert mine["params"] == n_params, (mine["params"], n_params)  # the same model as llmtrain's count

    def mfu_text(rate):
        return f", MFU {100 * rate * flops / (peak * 1e12):.1f}% of {peak_text}" if peak else ""

    memory = f", peak {mine['peak_gib']:.1f} GiB allocated" if mine["peak_gib"] is not None else ""
    print(f"pytorch : {mine['tokens_per_s']:12,.0f} tokens/s{mfu_text(mine['tokens_per_s'])}{memory} "
          f"({', '.join(mine['features'])})")
    if not a.llmtrain:
        return 0

    workdir = tempfile.mkdtemp(prefix="bench-vs-pytorch-")
    try:
        data = os.path.join(workdir, "data")
        tokens = max(batch * (d["T"] + 1) * 4, 1 << 16)
        gpu_bench.write_shard(os.path.join(data, "train_000000.bin"), tokens, d["V"])
        config = gpu_bench.deep_merge(llmtrain_config(d), {"data": {"train": [os.path.join(data, "train_*.bin")]}})
        # Timed steps after warm-up, as for PyTorch: summarize_metrics skips the first third (at most 5).
        r = gpu_bench.run_llmtrain(a.llmtrain, config, workdir, a.device, steps + min(5, warmup + 1), batch,
                                   precision, peak=peak, timeout_s=900)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if not r["ok"]:
        print(f"llmtrain: FAILED: {r.get('error')}\n  command: {r['command']}")
        return 1
    ours = r["metrics"]["tokens_per_s"]
    print(f"llmtrain: {ours:12,.0f} tokens/s{mfu_text(ours)} (median of steps {r['metrics']['timed_steps'][0]}-"
          f"{r['metrics']['timed_steps'][1]})")
    print(f"ratio   : {ours / mine['tokens_per_s']:12.2f}x (llmtrain / pytorch)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
