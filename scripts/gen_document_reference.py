#!/usr/bin/env python3
"""Generate the golden files of packed sequences (document masking) used by the C++ tests.

Usage:
    /usr/bin/python3 scripts/gen_document_reference.py [--arch gpt2|llama] [--out PATH]

The tiny GPT-2 or Llama of gen_reference.py (its sizes, parameters and float64 maths), at
T = 16 on two sequences packed with 3 and 4 documents. End-of-text id EOT = V - 1 precedes each
document, as `llmtrain tokenize` writes it; the first sequence starts inside a document. With
seg[t] the number of end-of-text tokens among the inputs before t, attention runs through
torch.nn.functional.scaled_dot_product_attention with the boolean block-causal mask
(s <= t and seg[s] == seg[t]), and, with reset positions, position ids t minus the first index of
seg[t] (GPT-2's learned positions, Llama's rotary angles). Two variants are written:

    mask/...    data.document_mask alone (positions 0 .. T-1)
    reset/...   data.document_mask and data.reset_positions

Tensors in tests/data/<arch>_documents_reference.safetensors:
    inputs, targets            I32 (B, T)
    param/<name>               F32 parameters
    <variant>/loss             F32 [1] mean cross-entropy
    <variant>/logits           F32 (B, T, V)
    <variant>/grad/<name>      F32 d(mean loss)/d(param)
"""

import argparse
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gen_reference as ref  # noqa: E402

T = 16
# Document starts (positions of the end-of-text tokens) of each sequence.
EOT_AT = [[5, 9], [0, 3, 9, 11]]


def packed_inputs():
    torch.manual_seed(1)
    eot = ref.V - 1
    inputs = torch.randint(0, eot, (ref.B, T), dtype=torch.int64)
    for b, starts in enumerate(EOT_AT):
        for t in starts:
            inputs[b, t] = eot
    targets = torch.randint(0, ref.V, (ref.B, T), dtype=torch.int64)
    return inputs, targets, eot


def segments(inputs, eot):
    """seg (B, T): end-of-text tokens among the inputs before t; pos (B, T): t minus its document's start."""
    is_eot = (inputs == eot).to(torch.int64)
    seg = torch.cumsum(is_eot, dim=1) - is_eot  # exclusive count
    pos = torch.zeros_like(seg)
    for b in range(seg.shape[0]):
        for t in range(seg.shape[1]):
            pos[b, t] = 0 if t == 0 or seg[b, t] != seg[b, t - 1] else pos[b, t - 1] + 1
    return seg, pos


def block_causal(seg):
    t = seg.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    same = seg[:, :, None] == seg[:, None, :]
    return (causal[None] & same)[:, None]  # (B, 1, T, T)


def sdpa(q, k, v, mask):
    """PyTorch's scaled_dot_product_attention (private, returning (out, weights), before 2.0),
    boolean mask True where a query attends; checked against the softmax written out."""
    if hasattr(F, "scaled_dot_product_attention"):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    else:
        out = F._scaled_dot_product_attention(q, k, v, attn_mask=mask)[0]
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    explicit = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v
    assert float((out - explicit).abs().max()) < 1e-12, "scaled_dot_product_attention's mask convention"
    return out


def rotary(x, pos):
    """x (B, H, T, hs) at positions pos (B, T), rotate_half layout."""
    hs = x.shape[3]
    inv_freq = ref.ROPE_THETA ** (-torch.arange(0, hs, 2, dtype=torch.float64) / hs)
    angles = pos.to(torch.float64)[:, None, :, None] * inv_freq  # (B, 1, T, hs/2)
    cos = torch.cat([angles, angles], dim=-1).cos()
    sin = torch.cat([angles, angles], dim=-1).sin()
    x1, x2 = x[..., :hs // 2], x[..., hs // 2:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def forward(p, inputs, targets, mask, pos):
    idx = inputs.long()
    bsz, t = idx.shape
    C, NH = ref.C, ref.NH
    hs = C // NH
    if ref.ARCH == "llama":
        NKV = ref.NKV
        x = p["model.embed_tokens.weight"][idx]
        for l in range(ref.L):
            h = "model.layers.%d." % l
            a = ref.rmsnorm(x, p[h + "input_layernorm.weight"])

            def heads(z, n):
                return z.reshape(bsz, t, n, hs).permute(0, 2, 1, 3)

            q = rotary(heads(a @ p[h + "self_attn.q_proj.weight"].t(), NH), pos)
            k = rotary(heads(a @ p[h + "self_attn.k_proj.weight"].t(), NKV), pos)
            v = heads(a @ p[h + "self_attn.v_proj.weight"].t(), NKV)
            k = k.repeat_interleave(NH // NKV, dim=1)
            v = v.repeat_interleave(NH // NKV, dim=1)
            y = sdpa(q, k, v, mask).permute(0, 2, 1, 3).reshape(bsz, t, C)
            x = x + y @ p[h + "self_attn.o_proj.weight"].t()
            m = ref.rmsnorm(x, p[h + "post_attention_layernorm.weight"])
            gate = m @ p[h + "mlp.gate_proj.weight"].t()
            up = m @ p[h + "mlp.up_proj.weight"].t()
            x = x + (gate * torch.sigmoid(gate) * up) @ p[h + "mlp.down_proj.weight"].t()
        logits = ref.rmsnorm(x, p["model.norm.weight"]) @ p["lm_head.weight"].t()
    else:
        x = p["transformer.wte.weight"][idx] + p["transformer.wpe.weight"][pos]
        for l in range(ref.L):
            h = "transformer.h.%d." % l
            a = ref.layernorm(x, p[h + "ln_1.weight"], p[h + "ln_1.bias"])
            qkv = ref.linear(a, p[h + "attn.c_attn.weight"], p[h + "attn.c_attn.bias"])

            def heads(z):
                return z.reshape(bsz, t, NH, hs).permute(0, 2, 1, 3)

            q, k, v = heads(qkv[..., :C]), heads(qkv[..., C:2 * C]), heads(qkv[..., 2 * C:])
            y = sdpa(q, k, v, mask).permute(0, 2, 1, 3).reshape(bsz, t, C)
            x = x + ref.linear(y, p[h + "attn.c_proj.weight"], p[h + "attn.c_proj.bias"])
            m = ref.layernorm(x, p[h + "ln_2.weight"], p[h + "ln_2.bias"])
            m = ref.gelu_tanh(ref.linear(m, p[h + "mlp.c_fc.weight"], p[h + "mlp.c_fc.bias"]))
            x = x + ref.linear(m, p[h + "mlp.c_proj.weight"], p[h + "mlp.c_proj.bias"])
        x = ref.layernorm(x, p["transformer.ln_f.weight"], p["transformer.ln_f.bias"])
        logits = x @ p["transformer.wte.weight"].t()
    logprobs = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    loss = -logprobs.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1).mean()
    return logits, loss


def loss_and_grads(p, inputs, targets, mask, pos):
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in p.items()}
    logits, loss = forward(leaves, inputs, targets, mask, pos)
    names = list(leaves)
    grads = torch.autograd.grad(loss, [leaves[n] for n in names])
    return logits.detach(), loss.detach(), dict(zip(names, (g.detach() for g in grads)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", choices=["gpt2", "llama"], default="gpt2")
    ap.add_argument("--out", help="output file (default tests/data/<arch>_documents_reference.safetensors)")
    args = ap.parse_args()
    ref.ARCH = args.arch
    metadata = dict(ref.METADATA, T=str(T))
    if ref.ARCH == "llama":
        metadata = dict(metadata, arch="llama", NKV=str(ref.NKV), F=str(ref.F_LLAMA), rope_theta=str(ref.ROPE_THETA),
                        norm_eps=str(ref.RMS_EPS))
    if not args.out:
        args.out = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data",
                                                 ref.ARCH + "_documents_reference.safetensors"))
    torch.set_num_threads(1)
    params32, _, _ = ref.init_params()
    p64 = {n: w.to(torch.float64) for n, w in params32.items()}
    inputs, targets, eot = packed_inputs()
    metadata["eot"] = str(eot)
    seg, reset = segments(inputs, eot)
    mask = block_causal(seg)
    plain = torch.arange(T)[None].expand(ref.B, T)
    # The mask is not trivial: it removes keys a causal row would see.
    causal_keys = T * (T + 1) // 2 * ref.B
    print("keys seen: %d of %d causal" % (int(mask.sum()), causal_keys))
    names = [n for n, _, _ in ref.param_specs()]
    tensors = [("inputs", "I32", inputs.to(torch.int32).numpy()), ("targets", "I32", targets.to(torch.int32).numpy())]
    tensors += [("param/" + n, "F32", params32[n].numpy()) for n in names]
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None, None].expand(ref.B, 1, T, T)
    _, causal_loss, _ = loss_and_grads(p64, inputs, targets, causal, plain)
    for variant, pos in (("mask", plain), ("reset", reset)):
        logits, loss, grads = loss_and_grads(p64, inputs, targets, mask, pos)
        print("%s: loss %.10f (causal %.10f)" % (variant, float(loss), float(causal_loss)))
        tensors += [(variant + "/loss", "F32", np.array([float(loss)], dtype=np.float32)),
                    (variant + "/logits", "F32", logits.numpy().astype(np.float32))]
        tensors += [(variant + "/grad/" + n, "F32", grads[n].numpy().astype(np.float32)) for n in names]
    ref.write_safetensors(args.out, tensors, metadata)
    print("wrote %s (%d bytes)" % (args.out, os.path.getsize(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
