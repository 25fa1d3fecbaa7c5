#!/usr/bin/python3
"""A tiny Mixture-of-Experts Llama trained by llmtrain against an independent pure-PyTorch model.

llmtrain trains a 3-layer Llama (layer 0 dense, layers 1-2 MoE: 4 experts, top 2, one shared
expert; softmax router renormalised, aux_loss_coef 0.05, z_loss_coef 0.01) in fp32 for 6 AdamW
updates of 2 micro-steps each, saving a checkpoint after every update. The PyTorch model here is
written from the documented maths (docs/moe.md), not from llmtrain's code: it starts from
llmtrain's step-1 checkpoint (its weights and AdamW moments, read from the safetensors files by
hand) and makes updates 2 to 6 on the same batches with torch.optim.AdamW. Checked: each update's
cross-entropy loss (metrics.jsonl "loss") within 1e-5, its aux_loss and z_loss within 1e-5, and
every weight after the last update within 1e-4 of llmtrain's step-6 checkpoint. A second run with
the sigmoid router (a route_scale of 2) is held to the same.

Usage: moe_reference_test.py LLMTRAIN_BINARY
"""
import json
import math
import os
import struct
import subprocess
import sys
import tempfile

try:
    import torch
except ImportError as e:
    print(f"SKIPPED: needs PyTorch in /usr/bin/python3 ({e})")
    sys.exit(0)
import numpy as np

BINARY = sys.argv[1]
failures = []
V, T, L, NH, NKV, C, F = 64, 16, 3, 2, 1, 16, 24
B, G, STEPS = 2, 4, 6
torch.set_default_dtype(torch.float64)


def check(ok, what):
    print(("ok: " if ok else "FAILED: ") + what, flush=True)
    if not ok:
        failures.append(what)


def read_safetensors(path):
    with open(path, "rb") as f:
        blob = f.read()
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        lo, hi = info["data_offsets"]
        dtype = {"F32": np.float32, "I64": np.int64}[info["dtype"]]
        out[name] = (lo, np.frombuffer(blob[8 + n + lo:8 + n + hi], dtype=dtype).reshape(info["shape"]).copy())
    return out


def load_checkpoint(folder):
    model = read_safetensors(os.path.join(folder, "model.safetensors"))
    names = sorted(model, key=lambda k: model[k][0])  # the flat buffer's order
    weights = {k: model[k][1] for k in names}
    optim = read_safetensors(os.path.join(folder, "optim-00000.safetensors"))
    m, v = optim["adamw.m"][1], optim["adamw.v"][1]
    moments, at = {}, 0
    for k in names:
        size = weights[k].size
        moments[k] = (m[at:at + size].reshape(weights[k].shape), v[at:at + size].reshape(weights[k].shape))
        at += size
    return weights, moments


# ---- the PyTorch model, from the maths ----------------------------------------------------------

def rms_norm(x, w):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-5) * w


def rope(x):  # x (B, H, T, hs), rotate_half layout
    hs = x.shape[-1]
    inv = 10000.0 ** (-torch.arange(0, hs // 2, dtype=torch.float64) * 2 / hs)
    ang = torch.arange(x.shape[2], dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    x1, x2 = x[..., :hs // 2], x[..., hs // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def swiglu(x, gate, up, down):
    return (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T


def moe_mlp(x, p, h, moe):
    """x (N, C) -> (out (N, C), aux, z) for one MoE layer."""
    E, k = moe["experts"], moe["top_k"]
    N = x.shape[0]
    logits = x @ p[h + "mlp.gate.weight"].T
    z = (torch.logsumexp(logits, -1) ** 2).mean()
    if moe.get("router", "softmax") == "sigmoid":
        scores = torch.sigmoid(logits)
        _, chosen = torch.topk(scores, k, dim=-1)
        picked = scores.gather(1, chosen)
        weights = picked / picked.sum(-1, keepdim=True) * moe.get("route_scale", 1.0)
        pbar = (scores / scores.sum(-1, keepdim=True)).mean(0)
    else:
        probs = torch.softmax(logits, -1)
        _, chosen = torch.topk(probs, k, dim=-1)
        weights = probs.gather(1, chosen)
        if moe.get("normalize_top_k", True):
            weights = weights / weights.sum(-1, keepdim=True)
        pbar = probs.mean(0)
    counts = torch.zeros(E)
    for e in range(E):
        counts[e] = (chosen == e).sum()
    aux = E / k * ((counts / N) * pbar).sum()
    out = torch.zeros_like(x)
    for e in range(E):
        rows, slot = (chosen == e).nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue
        y = swiglu(x[rows], p[h + "mlp.experts.gate_proj"][e], p[h + "mlp.experts.up_proj"][e],
                   p[h + "mlp.experts.down_proj"][e])
        out = out.index_add(0, rows, weights[rows, slot][:, None] * y)
    if h + "mlp.shared_experts.gate_proj.weight" in p:
        out = out + swiglu(x, p[h + "mlp.shared_experts.gate_proj.weight"], p[h + "mlp.shared_experts.up_proj.weight"],
                           p[h + "mlp.shared_experts.down_proj.weight"])
    return out, aux, z


def forward(p, tokens, targets, moe):
    """Mean cross-entropy, and the sums over MoE layers of aux and z (the training loss adds them)."""
    Bn, Tn = tokens.shape
    x = p["model.embed_tokens.weight"][tokens]
    hs = C // NH
    aux_sum, z_sum = 0.0, 0.0
    for l in range(L):
        h = f"model.layers.{l}."
        a = rms_norm(x, p[h + "input_layernorm.weight"])
        q = (a @ p[h + "self_attn.q_proj.weight"].T).view(Bn, Tn, NH, hs).transpose(1, 2)
        kk = (a @ p[h + "self_attn.k_proj.weight"].T).view(Bn, Tn, NKV, hs).transpose(1, 2)
        vv = (a @ p[h + "self_attn.v_proj.weight"].T).view(Bn, Tn, NKV, hs).transpose(1, 2)
        q, kk = rope(q), rope(kk)
        kk, vv = kk.repeat_interleave(NH // NKV, 1), vv.repeat_interleave(NH // NKV, 1)
        att = (q @ kk.transpose(-1, -2)) / math.sqrt(hs)
        att = att.masked_fill(torch.triu(torch.ones(Tn, Tn, dtype=torch.bool), 1), float("-inf")).softmax(-1)
        y = (att @ vv).transpose(1, 2).reshape(Bn, Tn, C)
        x = x + y @ p[h + "self_attn.o_proj.weight"].T
        m = rms_norm(x, p[h + "post_attention_layernorm.weight"])
        if l < moe.get("first_dense_layers", 0):
            x = x + swiglu(m, p[h + "mlp.gate_proj.weight"], p[h + "mlp.up_proj.weight"], p[h + "mlp.down_proj.weight"])
        else:
            out, aux, z = moe_mlp(m.reshape(Bn * Tn, C), p, h, moe)
            x = x + out.view(Bn, Tn, C)
            aux_sum, z_sum = aux_sum + aux, z_sum + z
    logits = rms_norm(x, p["model.norm.weight"]) @ p["lm_head.weight"].T
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))
    return ce, aux_sum, z_sum


def run_case(name, moe, tmp):
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, V, size=G * STEPS * T + 1).astype(np.uint16)
    data = os.path.join(tmp, "train_000000.bin")
    header = np.zeros(256, dtype=np.int32)
    header[:3] = [20240520, 1, tokens.size]
    with open(data, "wb") as f:
        f.write(header.tobytes() + tokens.tobytes())
    config = {
        "model": {"arch": "llama", "vocab_size": V, "context_length": T, "n_layer": L, "n_head": NH, "n_kv_head": NKV,
                  "d_model": C, "ffn_hidden": F, "tie_embeddings": False, "moe": moe},
        "data": {"train": data, "shuffle": False},
        "train": {"micro_batch_size": B, "global_batch_size": G, "max_steps": STEPS, "log_every": 1, "grad_clip": 0,
                  "precision": "fp32", "eval_every": 0},
        "optim": {"lr": 1e-2, "min_lr": 1e-2, "warmup_steps": 0, "schedule": "constant", "weight_decay": 0.1,
                  "beta1": 0.9, "beta2": 0.95, "eps": 1e-8},
        "checkpoint": {"every": 1, "keep_last": 10, "async": False},
    }
    cfg = os.path.join(tmp, f"{name}.json")
    with open(cfg, "w") as f:
        json.dump(config, f)
    run_dir = os.path.join(tmp, name)
    r = subprocess.run([BINARY, "train", "--config", cfg, "--run-dir", run_dir, "--device", "cpu"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        check(False, f"{name}: llmtrain train exited {r.returncode}: {r.stderr.strip()[-500:]}")
        return
    metrics = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl")) if '"loss"' in x]
    weights, moments = load_checkpoint(os.path.join(run_dir, "checkpoints", "step_00000001"))
    params = {k: torch.tensor(w.astype(np.float64), requires_grad=True) for k, w in weights.items()}
    decay = [p for p in params.values() if p.dim() >= 2]
    no_decay = [p for p in params.values() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    for k, p in params.items():
        opt.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.tensor(moments[k][0].astype(np.float64)),
                        "exp_avg_sq": torch.tensor(moments[k][1].astype(np.float64))}
    n_moe = L - moe.get("first_dense_layers", 0)
    worst = {"loss": 0.0, "aux": 0.0, "z": 0.0}
    for step in range(2, STEPS + 1):
        opt.zero_grad()
        ce_sum, aux_mean, z_mean = 0.0, 0.0, 0.0
        micro = G // B
        for j in range(micro):
            first = (step - 1) * G + j * B
            seq = np.stack([tokens[(first + b) * T:(first + b) * T + T + 1].astype(np.int64) for b in range(B)])
            ce, aux, z = forward(params, torch.tensor(seq[:, :-1]), torch.tensor(seq[:, 1:]), moe)
            total = (ce + moe.get("aux_loss_coef", 0.01) * aux + moe.get("z_loss_coef", 0.0) * z) / micro
            total.backward()
            ce_sum += ce.item() / micro
            aux_mean += aux.item() / n_moe / micro
            z_mean += z.item() / n_moe / micro
        got = metrics[step - 1]
        worst["loss"] = max(worst["loss"], abs(got["loss"] - ce_sum))
        worst["aux"] = max(worst["aux"], abs(got["aux_loss"] - aux_mean))
        worst["z"] = max(worst["z"], abs(got["z_loss"] - z_mean))
        print(f"  {name} step {step}: loss {got['loss']:.7f} vs {ce_sum:.7f}, aux_loss {got['aux_loss']:.7f} vs "
              f"{aux_mean:.7f}, z_loss {got['z_loss']:.6f} vs {z_mean:.6f}")
        opt.step()
    final, _ = load_checkpoint(os.path.join(run_dir, "checkpoints", f"step_{STEPS:08d}"))
    weight_gap = max(float(np.abs(final[k] - params[k].detach().numpy()).max()) for k in final)
    moved = max(float(np.abs(final[k] - weights[k]).max()) for k in final)
    check(worst["loss"] < 1e-5, f"{name}: losses of updates 2-{STEPS} within 1e-5 of PyTorch's (worst {worst['loss']:.2e})")
    check(worst["aux"] < 1e-5, f"{name}: aux_loss within 1e-5 (worst {worst['aux']:.2e})")
    check(worst["z"] < 1e-5 * max(1.0, z_mean), f"{name}: z_loss within 1e-5 (worst {worst['z']:.2e})")
    check(weight_gap < 1e-4 and moved > 1e-3,
          f"{name}: weights after update {STEPS} within 1e-4 of PyTorch's (worst {weight_gap:.2e}; they moved {moved:.2e})")


with tempfile.TemporaryDirectory() as tmp:
    base = {"experts": 4, "top_k": 2, "ffn_hidden": 8, "shared_experts": 1, "shared_ffn_hidden": 6,
            "first_dense_layers": 1, "aux_loss_coef": 0.05, "z_loss_coef": 0.01}
    run_case("softmax", base, tmp)
    run_case("sigmoid", dict(base, router="sigmoid", route_scale=2.0, shared_experts=0), tmp)
print(f"{len(failures)} failure(s)")
sys.exit(1 if failures else 0)
