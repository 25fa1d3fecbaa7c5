#!/usr/bin/env python3
"""Tokens per second of a plain PyTorch GPT-2 training step on the CPU.

Used by the benchmarks as "what a CPU training step consumes": a GPT-2 block stack (LayerNorm,
causal attention, GELU MLP, tied embeddings) with AdamW, fp32.
Usage: torch_step_rate.py [--layers 4] [--channels 256] [--heads 4] [--T 256] [--B 8] [--vocab 256]
                          [--threads 2] [--steps 5] [--best]
--best: PyTorch 2's fastest eager path (F.scaled_dot_product_attention, the fused AdamW); with
--compile, that model through torch.compile as well.
"""
import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


SDPA = False  # --best


class Block(nn.Module):
    def __init__(self, C, NH):
        super().__init__()
        self.NH = NH
        self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.qkv, self.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.fc, self.fc_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        heads = lambda t: t.view(B, T, self.NH, C // self.NH).transpose(1, 2)
        q, k, v = heads(q), heads(k), heads(v)
        if SDPA:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # written out: Debian's PyTorch predates F.scaled_dot_product_attention
            att = (q @ k.transpose(-2, -1)) / (C // self.NH) ** 0.5
            att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
            y = F.softmax(att, dim=-1) @ v
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, L, C, NH, T, V):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(T, C)
        self.blocks = nn.ModuleList(Block(C, NH) for _ in range(L))
        self.ln_f = nn.LayerNorm(C)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.T
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def main():
    p = argparse.ArgumentParser()
    for name, default in [("layers", 4), ("channels", 256), ("heads", 4), ("T", 256), ("B", 8), ("vocab", 256),
                          ("threads", 2), ("steps", 5)]:
        p.add_argument("--" + name, type=int, default=default)
    p.add_argument("--best", action="store_true")
    p.add_argument("--compile", action="store_true")
    a = p.parse_args()
    global SDPA
    SDPA = a.best
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = GPT(a.layers, a.channels, a.heads, a.T, a.vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **({"fused": True} if a.best else {}))
    if a.compile:
        model = torch.compile(model)
    idx = torch.randint(0, a.vocab, (a.B, a.T))
    tgt = torch.randint(0, a.vocab, (a.B, a.T))

    def step():
        opt.zero_grad(set_to_none=True)
        model(idx, tgt).backward()
        opt.step()

    step()  # warm-up (and, with --compile, the compilation)
    step()
    start = time.perf_counter()
    for _ in range(a.steps):
        step()
    elapsed = time.perf_counter() - start
    print(f"{a.B * a.T * a.steps / elapsed:.1f}")


if __name__ == "__main__":
    main()
