#!/usr/bin/env python3
"""Generate the golden reference files (GPT-2 and Llama) used by the C++ tests.

Usage:
    /usr/bin/python3 scripts/gen_reference.py [--arch gpt2|llama] [--out PATH]
    /usr/bin/python3 scripts/gen_reference.py --check FILE

Without --check, builds a tiny model from a fixed seed: GPT-2 (B=2, T=8, V=61,
C=32, NH=4, L=2, F=128, maxT=16) or Llama (the same sizes with NKV=2 key/value
heads, F=96, RMSNorm, rotary embeddings in the rotate_half layout, SwiGLU, no
biases, an untied output head), computes in float64 (from float32-rounded
parameters) the logits, the mean cross-entropy loss and the gradients of every
parameter, then runs 10 hand-written AdamW steps on the same batch (global
grad-norm clipping at 1.0, lr 1e-3, betas (0.9, 0.95), eps 1e-8, decoupled
weight decay 0.1 on 2-D params only). The hand-written AdamW is cross-checked
once against torch.optim.AdamW, and the Llama forward pass against
transformers' LlamaForCausalLM when transformers is installed. Everything is
written in the safetensors format (written by hand; no `safetensors` package
needed) to tests/data/<arch>_reference.safetensors by default.

Tensors in the file:
    inputs, targets            I32 (B, T)
    param/<name>               F32 initial parameters
    logits                     F32 (B, T, V) at the initial parameters
    loss                       F32 [1]
    grad/<name>                F32 d(mean loss)/d(param), unclipped
    adamw_losses               F32 [10] loss before each AdamW update
    adamw_final/<name>         F32 parameters after the 10 updates

With --check FILE, re-reads a safetensors file and prints its metadata and
every tensor's name, dtype and shape (plus a few values for small tensors).
"""

import argparse
import json
import math
import os
import struct
import sys

import numpy as np
import torch

# ----------------------------------------------------------------------------
# configuration

ARCH = "gpt2"  # set by --arch
B, T, V, C, NH, L, F, MAXT = 2, 8, 61, 32, 4, 2, 128, 16
NKV, F_LLAMA, ROPE_THETA, RMS_EPS = 2, 96, 10000.0, 1e-5
GRAD_CLIP = 1.0
LR = 1e-3
BETA1, BETA2 = 0.9, 0.95
EPS = 1e-8
WEIGHT_DECAY = 0.1
STEPS = 10
LN_EPS = 1e-5
SEED = 0

METADATA = {
    "B": str(B), "T": str(T), "V": str(V), "C": str(C), "NH": str(NH),
    "L": str(L), "F": str(F), "maxT": str(MAXT),
    "grad_clip": "1.0", "lr": "0.001", "beta1": "0.9", "beta2": "0.95",
    "eps": "1e-08", "weight_decay": "0.1",
}


def llama_param_specs():
    """LlamaForCausalLM's parameters (names and (out, in) shapes)."""
    hs = C // NH
    specs = [("model.embed_tokens.weight", (V, C), "matrix")]
    for l in range(L):
        p = "model.layers.%d." % l
        specs += [
            (p + "input_layernorm.weight", (C,), "ln_weight"),
            (p + "self_attn.q_proj.weight", (NH * hs, C), "matrix"),
            (p + "self_attn.k_proj.weight", (NKV * hs, C), "matrix"),
            (p + "self_attn.v_proj.weight", (NKV * hs, C), "matrix"),
            (p + "self_attn.o_proj.weight", (C, NH * hs), "matrix"),
            (p + "post_attention_layernorm.weight", (C,), "ln_weight"),
            (p + "mlp.gate_proj.weight", (F_LLAMA, C), "matrix"),
            (p + "mlp.up_proj.weight", (F_LLAMA, C), "matrix"),
            (p + "mlp.down_proj.weight", (C, F_LLAMA), "matrix"),
        ]
    specs += [("model.norm.weight", (C,), "ln_weight"), ("lm_head.weight", (V, C), "matrix")]
    return specs


def param_specs():
    """Ordered list of (name, shape, kind); kind picks the init distribution."""
    if ARCH == "llama":
        return llama_param_specs()
    specs = [
        ("transformer.wte.weight", (V, C), "matrix"),
        ("transformer.wpe.weight", (MAXT, C), "matrix"),
    ]
    for l in range(L):
        p = "transformer.h.%d." % l
        specs += [
            (p + "ln_1.weight", (C,), "ln_weight"),
            (p + "ln_1.bias", (C,), "bias"),
            (p + "attn.c_attn.weight", (3 * C, C), "matrix"),
            (p + "attn.c_attn.bias", (3 * C,), "bias"),
            (p + "attn.c_proj.weight", (C, C), "matrix"),
            (p + "attn.c_proj.bias", (C,), "bias"),
            (p + "ln_2.weight", (C,), "ln_weight"),
            (p + "ln_2.bias", (C,), "bias"),
            (p + "mlp.c_fc.weight", (F, C), "matrix"),
            (p + "mlp.c_fc.bias", (F,), "bias"),
            (p + "mlp.c_proj.weight", (C, F), "matrix"),
            (p + "mlp.c_proj.bias", (C,), "bias"),
        ]
    specs += [
        ("transformer.ln_f.weight", (C,), "ln_weight"),
        ("transformer.ln_f.bias", (C,), "bias"),
    ]
    return specs


def init_params():
    """Draw all parameters (fp32), plus inputs/targets, from a fixed seed."""
    torch.manual_seed(SEED)
    params = {}
    for name, shape, kind in param_specs():
        if kind == "matrix":
            t = torch.randn(shape, dtype=torch.float32) * 0.1
        elif kind == "bias":
            t = torch.randn(shape, dtype=torch.float32) * 0.05
        elif kind == "ln_weight":
            t = 1.0 + torch.randn(shape, dtype=torch.float32) * 0.1
        else:
            raise ValueError(kind)
        params[name] = t.to(torch.float32).contiguous()
    inputs = torch.randint(0, V, (B, T), dtype=torch.int64).to(torch.int32)
    targets = torch.randint(0, V, (B, T), dtype=torch.int64).to(torch.int32)
    return params, inputs, targets


# ----------------------------------------------------------------------------
# model (explicit float64 math, no nn.Module)

def layernorm(x, w, b):
    mean = x.mean(dim=-1, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)  # biased variance
    return (x - mean) / torch.sqrt(var + LN_EPS) * w + b


def linear(x, w, b):
    # w is (out, in), like torch.nn.Linear
    return x @ w.t() + b


def gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def attention(x, w_qkv, b_qkv, w_proj, b_proj):
    bsz, t, c = x.shape
    hs = c // NH
    qkv = linear(x, w_qkv, b_qkv)  # (B, T, 3C)
    q, k, v = qkv[..., 0:c], qkv[..., c:2 * c], qkv[..., 2 * c:3 * c]

    def heads(z):  # (B, T, C) -> (B, NH, T, hs), heads are contiguous slices
        return z.reshape(bsz, t, NH, hs).permute(0, 2, 1, 3)

    q, k, v = heads(q), heads(k), heads(v)
    att = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(hs))  # (B, NH, T, T)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    att = att.masked_fill(~causal, float("-inf"))
    att = torch.softmax(att, dim=-1)
    y = att @ v  # (B, NH, T, hs)
    y = y.permute(0, 2, 1, 3).reshape(bsz, t, c)
    return linear(y, w_proj, b_proj)


def rmsnorm(x, w):
    return x * torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + RMS_EPS) * w


def rotary(x):
    """x (B, H, T, hs): pairs (i, i + hs/2) turn by t * theta^(-2i/hs) (rotate_half layout)."""
    t, hs = x.shape[2], x.shape[3]
    inv_freq = ROPE_THETA ** (-torch.arange(0, hs, 2, dtype=torch.float64) / hs)
    angles = torch.arange(t, dtype=torch.float64)[:, None] * inv_freq[None, :]  # (T, hs/2)
    cos = torch.cat([angles, angles], dim=-1).cos()
    sin = torch.cat([angles, angles], dim=-1).sin()
    x1, x2 = x[..., :hs // 2], x[..., hs // 2:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def llama_attention(x, wq, wk, wv, wo):
    bsz, t, c = x.shape
    hs = c // NH

    def heads(z, n):  # (B, T, n hs) -> (B, n, T, hs)
        return z.reshape(bsz, t, n, hs).permute(0, 2, 1, 3)

    q = rotary(heads(x @ wq.t(), NH))
    k = rotary(heads(x @ wk.t(), NKV))
    v = heads(x @ wv.t(), NKV)
    k = k.repeat_interleave(NH // NKV, dim=1)  # query head h reads key/value head h // (NH/NKV)
    v = v.repeat_interleave(NH // NKV, dim=1)
    att = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(hs))
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    att = torch.softmax(att.masked_fill(~causal, float("-inf")), dim=-1)
    y = (att @ v).permute(0, 2, 1, 3).reshape(bsz, t, c)
    return y @ wo.t()


def llama_forward(p, inputs, targets):
    x = p["model.embed_tokens.weight"][inputs.long()]
    for l in range(L):
        h = "model.layers.%d." % l
        x = x + llama_attention(rmsnorm(x, p[h + "input_layernorm.weight"]),
                                p[h + "self_attn.q_proj.weight"], p[h + "self_attn.k_proj.weight"],
                                p[h + "self_attn.v_proj.weight"], p[h + "self_attn.o_proj.weight"])
        m = rmsnorm(x, p[h + "post_attention_layernorm.weight"])
        gate = m @ p[h + "mlp.gate_proj.weight"].t()
        up = m @ p[h + "mlp.up_proj.weight"].t()
        x = x + (gate * torch.sigmoid(gate) * up) @ p[h + "mlp.down_proj.weight"].t()
    logits = rmsnorm(x, p["model.norm.weight"]) @ p["lm_head.weight"].t()  # untied head
    logprobs = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    loss = -logprobs.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1).mean()
    return logits, loss


def cross_check_transformers(p64, inputs, logits):
    """The Llama logits against transformers' LlamaForCausalLM, when it is installed."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        print("transformers not installed: LlamaForCausalLM cross-check skipped")
        return True
    cfg = LlamaConfig(vocab_size=V, hidden_size=C, intermediate_size=F_LLAMA, num_hidden_layers=L,
                      num_attention_heads=NH, num_key_value_heads=NKV, max_position_embeddings=MAXT,
                      rms_norm_eps=RMS_EPS, rope_theta=ROPE_THETA, tie_word_embeddings=False,
                      attention_bias=False)
    model = LlamaForCausalLM(cfg).to(torch.float64).eval()
    missing, unexpected = model.load_state_dict(p64, strict=False)
    missing = [n for n in missing if not n.endswith("rotary_emb.inv_freq")]
    if missing or unexpected:
        print("ERROR: LlamaForCausalLM names differ: missing %s, unexpected %s" % (missing, unexpected),
              file=sys.stderr)
        return False
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # some versions build the causal mask in the default dtype
    try:
        with torch.no_grad():
            theirs = model(inputs.long()).logits
    finally:
        torch.set_default_dtype(previous)
    diff = float((theirs - logits).abs().max())
    print("transformers LlamaForCausalLM cross-check: max |logit diff| = %.3e" % diff)
    # transformers builds its rotary tables in float32, so agreement is at float32 rounding
    # (~1e-7); a wrong layout, head grouping or name would differ by ~1e-1.
    return diff < 1e-5


def forward(p, inputs, targets):
    """p: dict name -> float64 tensor. Returns (logits, loss)."""
    if ARCH == "llama":
        return llama_forward(p, inputs, targets)
    idx = inputs.long()
    t = idx.shape[1]
    pos = torch.arange(t)
    x = p["transformer.wte.weight"][idx] + p["transformer.wpe.weight"][pos]
    for l in range(L):
        h = "transformer.h.%d." % l
        a = layernorm(x, p[h + "ln_1.weight"], p[h + "ln_1.bias"])
        x = x + attention(a, p[h + "attn.c_attn.weight"], p[h + "attn.c_attn.bias"],
                          p[h + "attn.c_proj.weight"], p[h + "attn.c_proj.bias"])
        m = layernorm(x, p[h + "ln_2.weight"], p[h + "ln_2.bias"])
        m = gelu_tanh(linear(m, p[h + "mlp.c_fc.weight"], p[h + "mlp.c_fc.bias"]))
        x = x + linear(m, p[h + "mlp.c_proj.weight"], p[h + "mlp.c_proj.bias"])
    x = layernorm(x, p["transformer.ln_f.weight"], p["transformer.ln_f.bias"])
    logits = x @ p["transformer.wte.weight"].t()  # tied embedding
    # mean cross-entropy written out explicitly
    logprobs = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    nll = -logprobs.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    loss = nll.mean()
    return logits, loss


def loss_and_grads(p, inputs, targets):
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in p.items()}
    logits, loss = forward(leaves, inputs, targets)
    names = list(leaves.keys())
    grads = torch.autograd.grad(loss, [leaves[n] for n in names])
    return logits.detach(), loss.detach(), {n: g.detach() for n, g in zip(names, grads)}


# ----------------------------------------------------------------------------
# AdamW (hand-written)

def clip_grads(grads):
    norm = math.sqrt(sum(float((g * g).sum()) for g in grads.values()))
    scale = min(1.0, GRAD_CLIP / (norm + 1e-6))
    return {n: g * scale for n, g in grads.items()}, norm


def adamw_step(p, grads, m, v, step):
    bc1 = 1.0 - BETA1 ** step
    bc2 = 1.0 - BETA2 ** step
    out = {}
    for n, w in p.items():
        g = grads[n]
        m[n] = BETA1 * m[n] + (1.0 - BETA1) * g
        v[n] = BETA2 * v[n] + (1.0 - BETA2) * g * g
        m_hat = m[n] / bc1
        v_hat = v[n] / bc2
        wd = WEIGHT_DECAY if w.dim() == 2 else 0.0
        out[n] = w - LR * (m_hat / (torch.sqrt(v_hat) + EPS) + wd * w)
    return out


def train_hand(p0, inputs, targets):
    p = {n: w.clone() for n, w in p0.items()}
    m = {n: torch.zeros_like(w) for n, w in p.items()}
    v = {n: torch.zeros_like(w) for n, w in p.items()}
    losses, norms = [], []
    for step in range(1, STEPS + 1):
        _, loss, grads = loss_and_grads(p, inputs, targets)
        losses.append(float(loss))
        grads, norm = clip_grads(grads)
        norms.append(norm)
        p = adamw_step(p, grads, m, v, step)
    return p, losses, norms


def train_torch_optim(p0, inputs, targets):
    """Same loop using torch.optim.AdamW, for cross-checking only."""
    leaves = {n: w.clone().requires_grad_(True) for n, w in p0.items()}
    decay = [w for w in leaves.values() if w.dim() == 2]
    no_decay = [w for w in leaves.values() if w.dim() != 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=LR, betas=(BETA1, BETA2), eps=EPS)
    losses = []
    for _ in range(STEPS):
        _, loss, grads = loss_and_grads({n: w.detach() for n, w in leaves.items()},
                                        inputs, targets)
        losses.append(float(loss))
        grads, _ = clip_grads(grads)
        for n, w in leaves.items():
            w.grad = grads[n].clone()
        opt.step()
    return {n: w.detach() for n, w in leaves.items()}, losses


# ----------------------------------------------------------------------------
# safetensors I/O (by hand)

_DTYPES = {"F32": (np.dtype("<f4"), 4), "I32": (np.dtype("<i4"), 4),
           "F64": (np.dtype("<f8"), 8), "I64": (np.dtype("<i8"), 8)}


def write_safetensors(path, tensors, metadata):
    """tensors: list of (name, dtype_str, numpy array) in the desired order."""
    header = {"__metadata__": metadata}
    blobs = []
    offset = 0
    for name, dt, arr in tensors:
        np_dt, _ = _DTYPES[dt]
        data = np.ascontiguousarray(arr, dtype=np_dt).tobytes(order="C")
        header[name] = {"dtype": dt, "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    hjson = json.dumps(header, separators=(",", ":")).encode("utf-8")
    pad = (8 - (8 + len(hjson)) % 8) % 8
    hjson += b" " * pad
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hjson)))
        f.write(hjson)
        for b in blobs:
            f.write(b)


def read_safetensors(path):
    """Returns (metadata, dict name -> numpy array in header order)."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n].decode("utf-8"))
    buf = raw[8 + n:]
    metadata = header.pop("__metadata__", {})
    out = {}
    end_max = 0
    for name, info in header.items():
        np_dt, size = _DTYPES[info["dtype"]]
        begin, end = info["data_offsets"]
        count = int(np.prod(info["shape"])) if info["shape"] else 1
        if end - begin != count * size:
            raise ValueError("size mismatch for %s" % name)
        out[name] = np.frombuffer(buf[begin:end], dtype=np_dt).reshape(info["shape"])
        end_max = max(end_max, end)
    if end_max != len(buf):
        raise ValueError("data buffer length %d != %d" % (len(buf), end_max))
    return metadata, out


def check(path):
    meta, tensors = read_safetensors(path)
    print("file: %s (%d bytes)" % (path, os.path.getsize(path)))
    print("metadata:", json.dumps(meta))
    for name, arr in tensors.items():
        line = "  %-45s %-4s %s" % (name, str(arr.dtype), list(arr.shape))
        if arr.size <= 10:
            line += "  " + np.array2string(arr.reshape(-1), precision=6)
        print(line)
    print("%d tensors" % len(tensors))


# ----------------------------------------------------------------------------

def main():
    global ARCH, METADATA
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", choices=["gpt2", "llama"], default="gpt2")
    ap.add_argument("--out", help="output file (default tests/data/<arch>_reference.safetensors)")
    ap.add_argument("--check", metavar="FILE", help="read FILE and print its tensors")
    args = ap.parse_args()
    ARCH = args.arch
    if ARCH == "llama":
        METADATA = dict(METADATA, arch="llama", NKV=str(NKV), F=str(F_LLAMA), rope_theta=str(ROPE_THETA),
                        norm_eps=str(RMS_EPS))
    if not args.out:
        args.out = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                                 "data", ARCH + "_reference.safetensors"))

    if args.check:
        check(args.check)
        return 0

    torch.set_num_threads(1)
    params32, inputs, targets = init_params()
    p64 = {n: w.to(torch.float64) for n, w in params32.items()}

    logits, loss, grads = loss_and_grads(p64, inputs, targets)
    print("initial loss: %.10f (ln V = %.6f)" % (float(loss), math.log(V)))
    print("grad norms (unclipped):")
    total = 0.0
    for n, g in grads.items():
        total += float((g * g).sum())
    for n in list(grads)[:3] + list(grads)[-3:]:
        print("  %-40s %.6e" % (n, float(grads[n].norm())))
    print("  %-40s %.6e" % ("global", math.sqrt(total)))

    if ARCH == "llama" and not cross_check_transformers(p64, inputs, logits):
        print("ERROR: the Llama reference disagrees with transformers", file=sys.stderr)
        return 1

    final, losses, norms = train_hand(p64, inputs, targets)
    print("adamw losses:")
    for i, (l_, nm) in enumerate(zip(losses, norms), 1):
        print("  step %2d  loss %.10f  grad_norm %.6f" % (i, l_, nm))

    final_t, losses_t = train_torch_optim(p64, inputs, targets)
    pdiff = max(float((final[n] - final_t[n]).abs().max()) for n in final)
    ldiff = max(abs(a - b) for a, b in zip(losses, losses_t))
    print("torch.optim.AdamW cross-check: max |param diff| = %.3e, max |loss diff| = %.3e"
          % (pdiff, ldiff))
    if pdiff > 1e-10:
        print("ERROR: hand-written AdamW disagrees with torch.optim.AdamW", file=sys.stderr)
        return 1
    moved = max(float((final[n] - p64[n]).abs().max()) for n in final)
    print("max |final - initial| = %.3e" % moved)

    names = [n for n, _, _ in param_specs()]
    tensors = [("inputs", "I32", inputs.numpy()), ("targets", "I32", targets.numpy())]
    tensors += [("param/" + n, "F32", params32[n].numpy()) for n in names]
    tensors += [("logits", "F32", logits.numpy().astype(np.float32)),
                ("loss", "F32", np.array([float(loss)], dtype=np.float32))]
    tensors += [("grad/" + n, "F32", grads[n].numpy().astype(np.float32)) for n in names]
    tensors += [("adamw_losses", "F32", np.array(losses, dtype=np.float32))]
    tensors += [("adamw_final/" + n, "F32", final[n].numpy().astype(np.float32))
                for n in names]
    write_safetensors(args.out, tensors, METADATA)
    print("wrote %s (%d bytes)" % (args.out, os.path.getsize(args.out)))

    # round-trip sanity check
    _, back = read_safetensors(args.out)
    first = names[0]
    assert np.array_equal(back["param/" + first], params32[first].numpy())
    assert np.array_equal(back["inputs"], inputs.numpy())
    return 0


if __name__ == "__main__":
    sys.exit(main())
