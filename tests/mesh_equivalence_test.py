#!/usr/bin/python3
"""Every parallel layout trains as one rank does: one table of layouts on CPU ranks under mpirun.

Each row of ROWS trains one layout (a number of ranks and --set overrides on a base config) and
compares it with a reference run:
  - losses: every logged "loss" and "val_loss" of metrics.jsonl, step by step (absolute);
  - weights: the final checkpoint read back whole through `llmtrain export` (largest absolute
    difference of any weight); with both tolerances 0 the final checkpoints' safetensors files
    (weights and optimizer state) must be the same bytes and the losses the same numbers.
The reference is the one-rank run of the row's base config (shared by every row of that config),
or another row named in `against`. A row with `resume = (WRITER, K)` starts from the checkpoint
WRITER wrote at step K (another row, a one-rank reference, or an earlier version's checkpoint
from tests/data/legacy_checkpoints) and continues WRITER's run: steps K+1 on, against WRITER
unless `against` says otherwise. A row with `interrupt` is killed (SIGKILL, at random moments)
or stopped (SIGTERM, exit 75) and resumed with --resume auto until it ends, and must end bit for
bit as the same layout run without interruption. `checks` are further checks of the row's own
run (its collectives of an update against the algorithms' counts and ring volumes, its log).
CHECKS holds what is not a layout compared with another: memory per rank, eval under mpirun,
refused configs, damaged checkpoints, a full disk, a stopped pipeline stage.

Usage: mesh_equivalence_test.py LLMTRAIN MPIEXEC [--work DIR] [GROUP...]
  GROUP: references, zero, tensor, context, pipeline, checkpoint, muon, moe (default: all of them).
  --work DIR keeps the runs in DIR: the group "references" writes the one-rank references there
  and the other groups reuse them (ctest runs it first, as a fixture); without it, everything
  runs in a temporary folder, removed at the end.
"""
import argparse
import json
import os
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
LEGACY = os.path.join(HERE, "data", "legacy_checkpoints")
ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
GROUPS = ("references", "zero", "tensor", "context", "pipeline", "checkpoint", "muon", "moe")


# ----- base configs: the models rows train, and their one-rank references -----

GPT2 = {"vocab_size": 251, "context_length": 32, "n_layer": 4, "n_head": 4, "d_model": 32}  # vocab uneven over 2, 4
LLAMA = {"arch": "llama", "vocab_size": 251, "context_length": 32, "n_layer": 4, "n_head": 4, "n_kv_head": 2,
         "d_model": 32, "ffn_hidden": 40}  # grouped-query attention; kv heads replicated at tensor parallel 4
SMALL = {"vocab_size": 256, "context_length": 32, "n_layer": 2, "n_head": 2, "d_model": 32}


def base_config(name, data):
    """The config a row of base config NAME trains (data: the corpus' folder)."""
    if name == "legacy":  # the config the earlier version's checkpoints were written with
        with open(f"{LEGACY}/config.json") as f:
            config = json.load(f)
        config["data"] = {"train": f"{data}/train_*.bin", "val": f"{data}/val_*.bin"}
        return config
    config = {"model": dict(GPT2),
              "data": {"train": f"{data}/train_*.bin", "val": f"{data}/val_*.bin"},
              "train": {"micro_batch_size": 2, "global_batch_size": 8, "max_steps": 20, "log_every": 100000,
                        "eval_every": 5, "eval_batches": 2},
              "optim": {"warmup_steps": 2, "lr": 0.003},
              "checkpoint": {"every": 10, "keep_last": 5}}
    if name.startswith("llama"):
        config["model"] = dict(LLAMA)
    if name.startswith("llama-qk"):  # Qwen3's per-head query and key norms (replicated over a tensor group)
        config["model"]["qk_norm"] = True
        config["train"]["max_steps"] = 10
    if name.startswith("llama-bf16"):  # the whole layer recomputed in backward; 10 smaller updates keep bf16's drift small
        config["train"].update(precision="bf16", recompute="full", max_steps=10)
        config["optim"] = {"warmup_steps": 1}
    if name.endswith("docs"):  # packed documents: attention within each, positions from each one's start
        config["model"]["vocab_size"] = 300  # the documents corpus' trained tokenizer
        config["data"] = {"train": f"{data}_docs/train_*.bin", "val": f"{data}_docs/val_*.bin",
                          "document_mask": True, "reset_positions": True}
        config["train"]["max_steps"] = 10
    if name.startswith("moe"):  # Mixture of Experts: layer 0 dense, 3 MoE layers with a shared expert
        config["model"] = dict(LLAMA, moe={"experts": 4, "top_k": 2, "ffn_hidden": 16, "shared_experts": 1,
                                           "first_dense_layers": 1, "aux_loss_coef": 0.01, "z_loss_coef": 0.001})
        if name == "moe-every":  # every token to every expert: the rows each rank sends are known by hand
            config["model"]["moe"].update(top_k=4)
        if name == "moe-cap":  # capacity 0.75: each expert takes at most 3/4 of an even share, the rest dropped
            config["model"]["moe"]["capacity_factor"] = 0.75
        if name == "moe-bias":  # aux-loss-free balancing: the expert bias is state
            config["model"]["moe"].update(router="sigmoid", bias_update_rate=0.01, aux_loss_coef=0.0)
    if name.endswith("muon"):  # Muon on the hidden matrices, AdamW on the rest
        config["optim"].update(name="muon", muon={"lr": 0.02})
    if name.startswith("widevocab"):  # the embedding outweighs a layer: ZeRO 3's ends keep slots of their own
        config["model"]["vocab_size"] = 2000
        if name == "widevocab-llama":
            config["model"] = dict(LLAMA, vocab_size=2000)
    if name in ("long", "term"):  # runs to interrupt: long enough that every interruption comes before the end
        config["model"] = dict(SMALL)
        config["train"].update(max_steps=3000 if name == "long" else 1200, eval_every=0)
        config["optim"] = {"warmup_steps": 10}
        config["checkpoint"] = {"every": 3, "keep_last": 2} if name == "long" else {"every": 1000, "keep_last": 2}
    return config


# ----- the checks a row can carry, on its own run -----

def update_2(run, key):
    """The counts and bytes (calls, bytes this rank sent) of metrics.jsonl's KEY at step 2."""
    step = [m for m in run.metrics() if m.get("step") == 2 and "loss" in m][0]
    return {kind: (v[0], v[1]) for kind, v in step[key].items()}


def same_traffic(got, expect, what):
    print(f"  {what}: {got} expected {expect}")
    assert set(got) == set(expect), (got, expect)
    for kind, (calls, sent) in expect.items():
        assert got[kind][0] == calls and abs(got[kind][1] - sent) <= 1e-6 * max(sent, 1), (kind, got, expect)


def zero3_ends_keep_slots(layer, roots, W, reshard):
    """Whether ZeRO 3's units outside the layers keep weight and gradient slots of their own
    (parallel/zero3_slots.h): the ends' slots are apart from the layers' when that takes less
    memory than one pool of slots of the largest unit, and each root unit then has one.
    roots: (size, read by the embedding, read by the head)."""
    ceil = lambda n: -(-n // W)
    L, R = ceil(layer), max(ceil(r) for r, _, _ in roots)
    head = sorted((ceil(r) for r, e, h in roots if h), reverse=True)
    emb = sorted((ceil(r) for r, e, h in roots if e), reverse=True)
    ends = [max(head[i] if i < len(head) else 0, emb[i] if i < len(emb) else 0)
            for i in range(max(len(head), len(emb)))]
    homes = len(roots) <= len(ends) and all(c >= u for c, u in zip(ends, sorted((ceil(r) for r, _, _ in roots), reverse=True)))
    apart_weights = 2 * L + sum(ends) <= max(2, len(head), len(emb) + 1) * max(L, R) if reshard else True
    apart_grads = 2 * L + sum(ends) <= max(2, len(head), len(emb)) * max(L, R)
    return homes and apart_weights, homes and apart_grads


def zero_traffic(run):
    """The data group's collectives of an update under ZeRO 0, 1 and 3, from the model's shapes: per
    micro-step and layer one all-gather in forward, one in backward (none when the layers stay
    gathered, none in forward for the first layer after the first micro-step: it stays gathered)
    and one reduce-scatter; each unit outside the layers gathered and reduced once per micro-step
    for each end of the model that reads it (the embedding; the final norm and head, which read
    the token table too when tied), or, where they keep slots of their own, gathered once per
    update and reduced once per micro-step; ring volumes (n-1)/n S and 2 (n-1)/n S."""
    m, t, d = run.config["model"], run.config["train"], run.config["dist"]
    W, zero, reshard = run.ranks, d["zero_stage"], d["reshard_after_forward"]
    V, T, L, C, F = m["vocab_size"], m["context_length"], m["n_layer"], m["d_model"], m["ffn_hidden"]
    # roots: (size, read by the embedding, read by the head)
    if m["arch"] == "gpt2":  # units: ln_f (head) | each layer | wpe, wte (embedding and tied head)
        layer = 2 * C + (3 * C * C + 3 * C) + (C * C + C) + 2 * C + (F * C + F) + (C * F + C)
        roots = [(2 * C, False, True), (T * C + V * C, True, True)]
    else:  # norm, untied head (head) | each layer | embed (embedding)
        NH, NKV, HS = m["n_head"], m["n_kv_head"], C // m["n_head"]
        layer = C + NH * HS * C + 2 * NKV * HS * C + C * NH * HS + C + 3 * F * C
        roots = [(V * C + C, False, True), (V * C, True, False)]
    P = L * layer + sum(r for r, _, _ in roots)
    micro = t["global_batch_size"] // (t["micro_batch_size"] * W)
    share = (W - 1) / W
    ceil = lambda n: -(-n // W)
    expect = {}
    if zero == 3:
        stay_gathered, keep_gradients = zero3_ends_keep_slots(layer, roots, W, reshard)
        print(f"  ZeRO 3 ends: {'gathered once per update' if stay_gathered else 'gathered per use'}, "
              f"{'reduced once per micro-step' if keep_gradients else 'reduced per use'}")
        layer_gathers = micro * L * (2 if reshard else 1) - (micro - 1)
        uses = [int(e) + int(h) for _, e, h in roots]
        root_gathers = len(roots) if stay_gathered else micro * sum(uses)
        root_gathered = (1 if stay_gathered else micro) * sum((1 if stay_gathered else n) * ceil(r)
                                                               for (r, _, _), n in zip(roots, uses))
        root_reduces = [1 if keep_gradients else n for n in uses]
        expect["all-gather"] = (layer_gathers + root_gathers, share * W * 4 * (layer_gathers * ceil(layer) + root_gathered))
        expect["reduce-scatter"] = (micro * (L + sum(root_reduces)),
                                    micro * share * W * 4 * (L * ceil(layer) + sum(n * ceil(r) for (r, _, _), n in zip(roots, root_reduces))))
        expect["all-reduce"] = (1, 2 * share * 16)  # the loss and the squared norm, two doubles
    elif zero == 0:
        expect["all-reduce"] = (2, 2 * share * (4 * P + 8))  # one gradient bucket (dist.bucket_mb), then the loss
    else:
        expect["reduce-scatter"] = (1, share * W * 4 * ceil(P))
        expect["all-gather"] = (1, share * W * 4 * ceil(P))
        expect["all-reduce"] = (1, 2 * share * 16)
    same_traffic(update_2(run, "collectives"), expect, "data group")


zero_traffic.what = "the data group's collectives and bytes of an update as the algorithm needs"


def tensor_traffic(run):
    """The tensor group's collectives of an update against Megatron's: per layer and micro-step two
    all-reduces of the (B T, C) activations in forward and two in backward; the embedding's one;
    the vocabulary-parallel cross-entropy's max (N) and sums (2 N) and the head's input gradient;
    the gradient norm's one (a double); with key/value heads replicated (Llama, size above
    n_kv_head), one more per layer in backward for their gradients. Sequence parallelism:
    all-gathers before the split matmuls (in backward also of the output gradients and, again, of
    their inputs), reduce-scatters after them, the norms' weight gradients all-reduced. Ring
    volumes: 2 (n-1)/n S, (n-1)/n S."""
    m, t, d = run.config["model"], run.config["train"], run.config["dist"]
    W, n, sp = run.ranks, d["tensor_parallel"], d["sequence_parallel"]
    L, C, B, T = m["n_layer"], m["d_model"], t["micro_batch_size"], m["context_length"]
    NKV, HS = m["n_kv_head"], C // m["n_head"]
    micro = t["global_batch_size"] // (B * (W // n))
    tokens = B * T
    # A Mixture-of-Experts layer's experts run whole on every tensor rank: no sums after them (its
    # input gathered once, its output gradient once, under sequence parallelism).
    Lm = L - m["moe"]["first_dense_layers"] if m.get("moe") else 0
    ring, share = 2 * (n - 1) / n, (n - 1) / n
    norm = 2 * C if m["arch"] == "gpt2" else C  # a norm's weight (and bias)
    act = tokens * C * 4
    # train.recompute "full": each layer's forward again (a dense layer's 2 sums, a MoE layer's 1, and
    # the gathers of both norms' outputs); "mlp": a dense layer's MLP input gathered again (a MoE
    # layer's is kept).
    full, mlp = t.get("recompute") == "full", t.get("recompute") == "mlp"
    sums = 4 * L - 2 * Lm + (2 * L - Lm if full else 0)
    if not sp:
        per_micro = {"all-reduce": [1 + sums + 3, ring * (act * (1 + sums + 1) + 4 * tokens + 4 * 2 * tokens)]}
    else:
        gathers = 6 * L - Lm + (2 * L if full else L - Lm if mlp else 0)
        per_micro = {"all-gather": [gathers + 2, share * act * (gathers + 2)],
                     "reduce-scatter": [sums + 2, share * act * (sums + 2)],
                     "all-reduce": [2 + 2 * L + 1, ring * (4 * tokens + 4 * 2 * tokens + 4 * norm * (2 * L + 1))]}
    if m["arch"] == "llama" and n > NKV:  # replicated key/value heads: their k and v gradients
        per_micro["all-reduce"][0] += L
        per_micro["all-reduce"][1] += ring * 4 * L * NKV * 2 * HS * C
    if m.get("qk_norm"):  # each rank's heads add to the replicated q_norm and k_norm: summed per layer
        per_micro["all-reduce"][0] += L
        per_micro["all-reduce"][1] += ring * 4 * L * 2 * HS
    expect = {k: (micro * c, micro * b) for k, (c, b) in per_micro.items()}
    calls, sent = expect["all-reduce"]
    expect["all-reduce"] = (calls + 1, sent + ring * 8)  # + the gradient norm per update
    same_traffic(update_2(run, "tensor_collectives"), expect, "tensor group")


tensor_traffic.what = "the tensor group's collectives and bytes of an update as Megatron's"


def context_traffic(run):
    """What each rank sends its context group in an update: per micro-step and layer, forward CP-1
    key/value blocks of B T/CP 2 NKV HS elements, backward CP-1 blocks again and CP-1 f32 blocks of
    their gradients (ring); an all-gather of the blocks in forward and in backward and a
    reduce-scatter of their gradients (all-gather variant, ring volumes (n-1)/n S). A MoE layer's
    router statistics (E counts, E mean probabilities, the z-loss and the dropped fraction, doubles)
    are all-reduced once per micro-step (ring volume 2 (n-1)/n S)."""
    m, t, d = run.config["model"], run.config["train"], run.config["dist"]
    n, mode = d["context_parallel"], d["context_parallel_mode"]
    L, B, T = m["n_layer"], t["micro_batch_size"], m["context_length"]
    NKV, HS = m["n_kv_head"], m["d_model"] // m["n_head"]
    micro = t["global_batch_size"] // B  # one data-parallel rank: the whole batch in micro-steps of B
    block = B * (T // n) * 2 * NKV * HS  # one rank's keys and values of one layer (elements)
    if mode == "ring":
        sends = micro * L * 3 * (n - 1)
        expect = {"send": (sends, micro * L * (n - 1) * block * (4 + 4 + 4)), "recv": (sends, 0.0)}
    else:
        share = (n - 1) / n
        expect = {"all-gather": (micro * L * 2, micro * L * 2 * share * n * block * 4),
                  "reduce-scatter": (micro * L, micro * L * share * n * block * 4)}
    if m.get("moe"):
        Lm, E = L - m["moe"]["first_dense_layers"], m["moe"]["experts"]
        expect["all-reduce"] = (micro * Lm, micro * Lm * 2 * (n - 1) / n * 8 * (2 * E + 2))
    same_traffic(update_2(run, "context_collectives"), expect, "context group")


context_traffic.what = "the context group's bytes per layer as the formula"


def gpt2_muon_matrices(m):
    """GPT-2's Muon matrices in flat order (c_attn as its q, k, v blocks) as (offset, elements) in
    the one-rank flat buffer, and that buffer's size P."""
    V, T, L, C, F = m["vocab_size"], m["context_length"], m["n_layer"], m["d_model"], m["ffn_hidden"]
    at, matrices = 2 * C, []  # ln_f first, then the layers from the last, then wpe and wte
    for _ in range(L):
        at += 2 * C  # ln_1
        matrices += [(at + k * C * C, C * C) for k in range(3)]  # c_attn's q, k, v
        at += 3 * C * C + 3 * C
        matrices.append((at, C * C))  # attn.c_proj
        at += C * C + C + 2 * C  # and ln_2
        matrices.append((at, F * C))  # c_fc
        at += F * C + F
        matrices.append((at, C * F))  # mlp.c_proj
        at += C * F + C
    return matrices, at + T * C + V * C


def muon_traffic(run):
    """Muon's gathers under ZeRO, as the data axis' sends and receives of an update (rank 0's):
    matrix j (flat order; GPT-2's c_attn as its q, k and v blocks) is owned by rank j mod W, which
    receives the other ranks' parts of u and sends their parts of O back, one transfer each way per
    part; a rank that holds part of a matrix it does not own sends that part and receives it back.
    Under ZeRO 1 and 2 (GPT-2) rank r holds [r S, (r + 1) S) of the flat buffer, S = ceil(P / W):
    counts and bytes exact. Under ZeRO 3 (shards of each layer unit): some of each."""
    got = update_2(run, "collectives")
    print(f"  data group: {got}")
    m, d = run.config["model"], run.config["dist"]
    W = run.ranks // d["tensor_parallel"]
    if d["zero_stage"] == 3 or m["arch"] != "gpt2" or d["tensor_parallel"] > 1:
        assert got.get("send", (0, 0))[0] > 0 and got.get("recv", (0, 0))[0] > 0, f"no Muon transfers: {got}"
        return
    matrices, P = gpt2_muon_matrices(m)
    S = -(-P // W)
    parts = lambda off, n: [(r, min(off + n, (r + 1) * S) - max(off, r * S)) for r in range(W)
                            if min(off + n, (r + 1) * S) > max(off, r * S)]
    calls, sent = 0, 0
    for j, (off, n) in enumerate(matrices):
        for r, length in parts(off, n):
            if (j % W == 0) != (r == 0):  # rank 0 owns j and r is another rank, or r == 0 and another owns j
                calls += 1
                sent += 4 * length
    expect = {"send": (calls, sent), "recv": (calls, 0.0)}
    same_traffic({k: got.get(k, (0, 0.0)) for k in expect}, expect, "data group, Muon's transfers")


muon_traffic.what = "Muon's owner gathers and scatters counted as the data axis' sends and receives"


def muon_tensor_traffic(run):
    """Muon's gathers under tensor parallel 2 (GPT-2), as the tensor axis' sends and receives of an
    update (rank 0's): every matrix is split in halves over the two ranks; its tensor owner (matrix
    j of those whose data owner this rank is, j mod W_data for ZeRO, every one without: owners
    round-robin over them) receives the other half of u and sends that half of O back, the other
    rank sends its half and receives it back: one send and one receive of half the matrix each."""
    got = update_2(run, "tensor_collectives")
    m, d = run.config["model"], run.config["dist"]
    assert m["arch"] == "gpt2" and d["tensor_parallel"] == 2, "the check counts GPT-2 at tensor parallel 2"
    W = run.ranks // 2 if d["zero_stage"] > 0 else 1  # the ranks ZeRO shards over
    mine = [n for j, (_, n) in enumerate(gpt2_muon_matrices(m)[0]) if j % W == 0]
    expect = {"send": (len(mine), 4 * sum(mine) / 2), "recv": (len(mine), 0.0)}
    same_traffic({k: got.get(k, (0, 0.0)) for k in expect}, expect, "tensor group, Muon's transfers")


muon_tensor_traffic.what = "Muon's tensor-parallel gathers and scatters counted as the tensor axis' sends and receives"


def pipeline_transfers(per_micro):
    """Stage 0's transfers of an update: PER_MICRO tensors of (B T, C) f32 per micro-batch (1 under
    1F1B: its activation; 3 interleaved with 2 chunks: both chunks' activations and the second
    chunk's input gradient), as many receives; with a tied embedding (GPT-2) one more of each,
    its (V, C) f32 gradients exchanged with the last stage. No all-reduce of the embedding."""
    def check(run):
        m, t = run.config["model"], run.config["train"]
        B, T, C = t["micro_batch_size"], m["context_length"], m["d_model"]
        micro = t["global_batch_size"] // B
        tied = m["vocab_size"] * C * 4 if m["tie_embeddings"] else 0
        sent = update_2(run, "pipeline_collectives")
        print(f"  stage 0: {sent}")
        n = micro * per_micro + (1 if tied else 0)
        assert sent["send"] == (n, micro * per_micro * B * T * C * 4 + tied), sent
        assert sent["recv"][0] == n, sent
        assert "all-reduce" not in sent or sent["all-reduce"][1] < 64, sent  # the loss only
    check.what = f"stage 0 sends {per_micro} (B T, C) tensor(s) per micro-batch and receives as many"
    return check


def expert_traffic(run):
    """The expert group's collectives of an update (rank 0's), by hand, for a model whose tokens
    each choose all E experts (top_k = E): per MoE layer and micro-step 5 all-to-alls (the counts,
    E / EP i32 to each rank; in forward the N k slots' rows to their experts and the outputs back;
    in backward their gradients both ways; the forward's 3 again with train.recompute "full"), each sending the other ranks (EP - 1) / EP of N k rows
    of d_model f32 values; at ZeRO 0 all-reduces (ring: 2 (EP-1)/EP of the bytes) of each run of
    the gradients every expert rank holds alike (all but the experts') and of the loss, the norm,
    the router statistics (4 doubles, a float max) and the loads (MoE layers x E doubles)."""
    m, d, t = run.config["model"], run.config["dist"], run.config["train"]
    e, EP = m["moe"], d["expert_parallel"]
    E, k, L = e["experts"], e["top_k"], m["n_layer"] - e["first_dense_layers"]
    assert k == E, "the hand count needs every token to choose every expert"
    N, C = t["micro_batch_size"] * m["context_length"], m["d_model"]
    steps = t["global_batch_size"] // (t["micro_batch_size"] * run.ranks)
    others = (EP - 1) / EP
    # train.recompute "full": each layer's forward exchange (the counts, the rows both ways) again in backward.
    full = t.get("recompute") == "full"
    expect = {"all-to-all": (steps * L * (8 if full else 5),
                             steps * L * ((6 if full else 4) * N * k * others * C * 4 +
                                          (2 if full else 1) * (EP - 1) * (E // EP) * 4))}
    if d.get("zero_stage", 0) == 0:
        H, I, S, Ff, V = C // m["n_head"], e["ffn_hidden"], e["shared_experts"] * e["ffn_hidden"], m["ffn_hidden"], m["vocab_size"]
        attention = 2 * C + C * (m["n_head"] + 2 * m["n_kv_head"]) * H + C * C
        # The flat buffer in backward order (the head and final norm, layers n-1 .. 0, the embedding)
        # as (elements, an expert's?), and the runs of the others between the experts.
        parts = [(0 if m.get("tie_embeddings", True) else V * C, False), (C, False)]
        for layer in range(m["n_layer"] - 1, -1, -1):
            if layer >= e["first_dense_layers"]:
                parts += [(attention + E * C, False), (3 * E * I * C, True), (3 * S * C, False)]
            else:
                parts += [(attention + 3 * Ff * C, False)]
        parts.append((V * C, False))
        runs = [0]
        for n, expert in parts:
            if expert:
                runs.append(0)
            else:
                runs[-1] += n
        shared = sum(runs)
        expect["all-reduce"] = (len(runs) + 5, 2 * others * (4 * shared + 8 + 8 + 32 + 4 + 8 * L * E))
    got = update_2(run, "expert_collectives")
    same_traffic({kind: got.get(kind, (0, 0.0)) for kind in expect}, expect, "expert group")
expert_traffic.what = "the expert group's all-to-alls and all-reduces counted by hand"


def log_says(pattern):
    def check(run):
        assert re.search(pattern, run.log()), f"the log does not say '{pattern}'"
    check.what = f"the log says '{pattern}'"
    return check


# ----- the table -----

@dataclass
class Row:
    group: str
    name: str
    ranks: int
    sets: str = ""          # --set overrides, "KEY=VALUE KEY=VALUE"
    base: str = "gpt2"      # base config (and one-rank reference)
    resume: tuple = None    # (WRITER, STEP): start from WRITER's checkpoint at STEP
    against: str = None     # the run compared with (default: the writer, else the one-rank reference)
    loss_tol: float = 1e-5  # absolute, every loss and validation loss
    weight_tol: float = 1e-4  # absolute, the final weights (None: not compared)
    interrupt: tuple = None  # ("SIGKILL", TIMES, AT_LEAST, (LOW, HIGH) s) or ("SIGTERM",): bit for bit as uninterrupted
    checks: tuple = ()


ONE = "one rank"  # the one-rank reference of the row's base config
EXACT = dict(loss_tol=0, weight_tol=0)
Z3 = "dist.zero_stage=3"
ROWS = [
    # ZeRO: data parallel over 2 and 4 ranks, stages 0, 1 and 3, layers resharded after forward or kept.
    Row("zero", "zero0-w2", 2, "dist.zero_stage=0", checks=(zero_traffic,)),
    Row("zero", "zero1-w2", 2, "dist.zero_stage=1", checks=(zero_traffic,)),
    Row("zero", "zero1-w2@10>w1", 1, "dist.zero_stage=1", resume=("zero1-w2", 10)),
    Row("zero", "zero1-w2@10>w4", 4, "dist.zero_stage=1", resume=("zero1-w2", 10)),
    Row("zero", "zero1-w2@10>w4-zero3", 4, Z3, resume=("zero1-w2", 10)),
    Row("zero", "zero1-w2@10>tp2", 2, "dist.tensor_parallel=2", resume=("zero1-w2", 10)),
    Row("zero", "zero3-w2", 2, Z3, checks=(zero_traffic,)),
    Row("zero", "zero3-w2-gathered", 2, Z3 + " dist.reshard_after_forward=false", checks=(zero_traffic,)),
    Row("zero", "zero3-w4", 4, Z3, checks=(zero_traffic,)),
    Row("zero", "zero3-w4@10>w1", 1, resume=("zero3-w4", 10)),
    Row("zero", "zero3-w4@10>w2-zero1", 2, "dist.zero_stage=1", resume=("zero3-w4", 10)),
    Row("zero", "zero3-w4@10>w2-gathered", 2, Z3 + " dist.reshard_after_forward=false", resume=("zero3-w4", 10)),
    Row("zero", "llama-zero3-w2", 2, Z3, base="llama", checks=(zero_traffic,)),
    Row("zero", "llama-qk-zero3-w2", 2, Z3, base="llama-qk"),
    # An embedding larger than a layer (2,000 x 32 against 12,704): the ends' units keep slots of
    # their own, gathered once per update and (GPT-2's tied table) reduced once per micro-step.
    Row("zero", "widevocab-zero3-w2", 2, Z3, base="widevocab", checks=(zero_traffic,)),
    Row("zero", "widevocab-zero3-w4", 4, Z3, base="widevocab", checks=(zero_traffic,)),
    Row("zero", "widevocab-llama-zero3-w2", 2, Z3, base="widevocab-llama", checks=(zero_traffic,)),

    # Tensor parallelism (Megatron), with and without sequence parallelism, alone and with data 2.
    Row("tensor", "tp2", 2, "dist.tensor_parallel=2", checks=(tensor_traffic,)),
    Row("tensor", "tp4", 4, "dist.tensor_parallel=4", checks=(tensor_traffic,)),
    Row("tensor", "tp2-dp2-zero1", 4, "dist.tensor_parallel=2 dist.zero_stage=1", checks=(tensor_traffic,)),
    Row("tensor", "tp2-dp2-zero1@10>w1", 1, resume=("tp2-dp2-zero1", 10)),
    Row("tensor", "tp2-dp2-zero1@10>tp4", 4, "dist.tensor_parallel=4", resume=("tp2-dp2-zero1", 10)),
    Row("tensor", "tp2-dp2-zero1@10>tp2-dp2-zero3", 4, "dist.tensor_parallel=2 " + Z3, resume=("tp2-dp2-zero1", 10)),
    Row("tensor", "tp2-sp", 2, "dist.tensor_parallel=2 dist.sequence_parallel=true", checks=(tensor_traffic,)),
    Row("tensor", "tp2-sp-dp2", 4, "dist.tensor_parallel=2 dist.sequence_parallel=true", checks=(tensor_traffic,)),
    Row("tensor", "llama-tp2", 2, "dist.tensor_parallel=2", base="llama", checks=(tensor_traffic,)),
    Row("tensor", "llama-tp2-dp2", 4, "dist.tensor_parallel=2", base="llama", checks=(tensor_traffic,)),
    Row("tensor", "llama-tp4", 4, "dist.tensor_parallel=4", base="llama", checks=(tensor_traffic,)),
    Row("tensor", "llama-tp4-sp", 4, "dist.tensor_parallel=4 dist.sequence_parallel=true", base="llama",
        checks=(tensor_traffic,)),
    # model.qk_norm: the norms' weight gradients summed over the group; key/value heads replicated at 4.
    Row("tensor", "llama-qk-tp2", 2, "dist.tensor_parallel=2", base="llama-qk", checks=(tensor_traffic,)),
    Row("tensor", "llama-qk-tp4-sp", 4, "dist.tensor_parallel=4 dist.sequence_parallel=true", base="llama-qk",
        checks=(tensor_traffic,)),

    # Context parallelism: ring and all-gather, alone and with tensor, data (ZeRO 3) and pipeline.
    Row("context", "cp2", 2, "dist.context_parallel=2", checks=(context_traffic,)),
    Row("context", "cp4", 4, "dist.context_parallel=4", checks=(context_traffic,)),
    Row("context", "cp4-allgather", 4, "dist.context_parallel=4 dist.context_parallel_mode=allgather",
        against="cp4", loss_tol=1e-6, weight_tol=1e-5, checks=(context_traffic,)),  # the ring's to rounding
    Row("context", "cp2-tp2", 4, "dist.context_parallel=2 dist.tensor_parallel=2"),
    Row("context", "cp2-dp2-zero3", 4, "dist.context_parallel=2 " + Z3),
    Row("context", "cp2-pp2", 4, "dist.context_parallel=2 dist.pipeline_parallel=2"),
    Row("context", "llama-cp2", 2, "dist.context_parallel=2", base="llama", checks=(context_traffic,)),
    Row("context", "llama-cp4", 4, "dist.context_parallel=4", base="llama", checks=(context_traffic,)),
    Row("context", "llama-cp4-allgather", 4, "dist.context_parallel=4 dist.context_parallel_mode=allgather",
        base="llama", against="llama-cp4", loss_tol=1e-6, weight_tol=1e-5, checks=(context_traffic,)),
    Row("context", "llama-cp2-tp2-sp", 4, "dist.context_parallel=2 dist.tensor_parallel=2 dist.sequence_parallel=true",
        base="llama"),
    Row("context", "llama-cp2-dp2-zero3", 4, "dist.context_parallel=2 " + Z3, base="llama"),
    Row("context", "llama-cp2-pp2", 4, "dist.context_parallel=2 dist.pipeline_parallel=2", base="llama"),
    Row("context", "llama-qk-cp2", 2, "dist.context_parallel=2", base="llama-qk"),
    Row("context", "llama-cp4@10>w1", 1, base="llama", resume=("llama-cp4", 10), against=ONE),
    Row("context", "llama-w1@10>cp4", 4, "dist.context_parallel=4", base="llama", resume=(ONE, 10)),
    # Packed documents (data.document_mask, data.reset_positions): the mask over the ranks' chunks.
    Row("context", "docs-cp2", 2, "dist.context_parallel=2", base="docs"),
    Row("context", "docs-cp4-allgather", 4, "dist.context_parallel=4 dist.context_parallel_mode=allgather", base="docs"),
    Row("context", "llama-docs-cp2-allgather", 2, "dist.context_parallel=2 dist.context_parallel_mode=allgather",
        base="llama-docs"),
    Row("context", "llama-docs-cp4", 4, "dist.context_parallel=4", base="llama-docs"),
    Row("context", "docs-cp2-tp2-sp", 4, "dist.context_parallel=2 dist.tensor_parallel=2 dist.sequence_parallel=true",
        base="docs"),  # learned positions added once over the tensor group
    Row("context", "docs-pp2", 2, "dist.pipeline_parallel=2", base="docs"),  # each stage's slots keep their documents
    Row("context", "llama-bf16-cp2", 2, "dist.context_parallel=2", base="llama-bf16",
        loss_tol=2e-4, weight_tol=2e-3),  # bf16 rounding

    # Pipeline parallelism: 1F1B over 2 and 4 stages, interleaved (2 stages x 2 chunks of one layer).
    Row("pipeline", "pp2", 2, "dist.pipeline_parallel=2",
        checks=(log_says("pipeline: 2 stages"), pipeline_transfers(1))),
    Row("pipeline", "pp2@10>w1", 1, resume=("pp2", 10)),
    Row("pipeline", "llama-qk-pp2", 2, "dist.pipeline_parallel=2", base="llama-qk"),
    Row("pipeline", "w1@10>pp2", 2, "dist.pipeline_parallel=2", resume=(ONE, 10)),
    Row("pipeline", "w1@10>pp2-tp2", 4, "dist.pipeline_parallel=2 dist.tensor_parallel=2", resume=(ONE, 10)),
    Row("pipeline", "pp4", 4, "dist.pipeline_parallel=4", checks=(pipeline_transfers(1),)),
    Row("pipeline", "pp2-interleaved", 2, "dist.pipeline_parallel=2 dist.pipeline_schedule=interleaved dist.virtual_stages=2",
        checks=(log_says("interleaved"), pipeline_transfers(3))),
    Row("pipeline", "pp2-interleaved@10>w1", 1, resume=("pp2-interleaved", 10), against=ONE),
    # zb1p (ZB-H1): each backward split into its input gradients and, deferred, its weight
    # gradients, summed in the backwards' order: 1F1B's bits (pp4-zb1p against pp4: the same
    # checkpoint files), its transfers 1F1B's; with data 2 under ZeRO 1, Llama, and a MoE model
    # (its router's and experts' weight gradients deferred too).
    Row("pipeline", "pp2-zb1p", 2, "dist.pipeline_parallel=2 dist.pipeline_schedule=zb1p",
        checks=(log_says("zb1p schedule"), pipeline_transfers(1))),
    Row("pipeline", "pp4-zb1p", 4, "dist.pipeline_parallel=4 dist.pipeline_schedule=zb1p", against="pp4", **EXACT),
    Row("pipeline", "pp2-dp2-zero1-zb1p", 4, "dist.pipeline_parallel=2 dist.zero_stage=1 dist.pipeline_schedule=zb1p"),
    Row("pipeline", "llama-pp2-zb1p", 2, "dist.pipeline_parallel=2 dist.pipeline_schedule=zb1p", base="llama"),
    Row("pipeline", "moe-pp2-zb1p", 2, "dist.pipeline_parallel=2 dist.pipeline_schedule=zb1p", base="moe"),
    Row("pipeline", "pp2-zb1p@10>w1", 1, resume=("pp2-zb1p", 10), against=ONE),
    Row("pipeline", "w1@10>pp2-interleaved", 2,
        "dist.pipeline_parallel=2 dist.pipeline_schedule=interleaved dist.virtual_stages=2", resume=(ONE, 10)),

    # Muon: layouts that keep each hidden matrix whole on its rank (data, context, pipeline),
    # ZeRO's, whose matrices each owner gathers (the sends and receives counted on the data axis);
    # runs resumed on another layout continue the one-rank curve.
    Row("muon", "muon-zero1-w2", 2, "dist.zero_stage=1", base="muon", checks=(muon_traffic,)),
    Row("muon", "muon-zero1-w4", 4, "dist.zero_stage=1", base="muon", checks=(muon_traffic,)),
    Row("muon", "muon-zero3-w2", 2, Z3, base="muon", checks=(muon_traffic,)),
    Row("muon", "muon-zero3-w4", 4, Z3, base="muon", checks=(muon_traffic,)),
    Row("muon", "muon-zero3-w4@10>w1", 1, base="muon", resume=("muon-zero3-w4", 10)),
    Row("muon", "muon-zero1-w2@10>pp2", 2, "dist.pipeline_parallel=2", base="muon", resume=("muon-zero1-w2", 10)),
    Row("muon", "llama-muon-zero3-w2", 2, Z3, base="llama-muon", checks=(muon_traffic,)),
    Row("muon", "llama-muon-pp2-dp2-zero1", 4, "dist.pipeline_parallel=2 dist.zero_stage=1", base="llama-muon"),
    # bf16: Newton-Schulz's products are rounded to bf16, a step function: gradients that differ
    # in the last bits (another summation order; AdamW's weights then agree to 1e-8) round some
    # entries the other way, and O differs at bf16's precision. Muon's steps here (0.02 x 0.2
    # sqrt(40) x O) are some 7 times AdamW's (6e-4): the weights' tolerance is 7 times the AdamW
    # rows' 2e-3 (measured: 3.4e-4 at data 2, 5.3e-3 under ZeRO 3).
    Row("muon", "llama-bf16-muon-w2", 2, base="llama-bf16-muon", loss_tol=5e-4, weight_tol=1.5e-2),
    Row("muon", "llama-bf16-muon-zero3-w2", 2, Z3, base="llama-bf16-muon", loss_tol=5e-4, weight_tol=1.5e-2),
    Row("muon", "muon-w2", 2, base="muon"),
    Row("muon", "muon-pp2", 2, "dist.pipeline_parallel=2", base="muon"),
    Row("muon", "muon-pp2@10>w2", 2, base="muon", resume=("muon-pp2", 10), against=ONE),
    Row("muon", "muon-w1@10>pp2-dp2", 4, "dist.pipeline_parallel=2", base="muon", resume=(ONE, 10)),
    Row("muon", "llama-muon-cp2", 2, "dist.context_parallel=2", base="llama-muon"),
    Row("muon", "llama-muon-pp2-dp2", 4, "dist.pipeline_parallel=2", base="llama-muon"),
    # Tensor parallelism: each split matrix gathered whole by its tensor owner (the sends and
    # receives counted on the tensor axis), alone, under ZeRO 3 and with replicated key/value
    # heads (Llama at tensor parallel 4); resumed across tensor layouts.
    Row("muon", "muon-tp2", 2, "dist.tensor_parallel=2", base="muon", checks=(muon_tensor_traffic,)),
    Row("muon", "muon-tp2-dp2-zero3", 4, "dist.tensor_parallel=2 " + Z3, base="muon",
        checks=(muon_traffic, muon_tensor_traffic)),
    Row("muon", "llama-muon-tp4", 4, "dist.tensor_parallel=4", base="llama-muon"),
    Row("muon", "muon-tp2@10>w1", 1, base="muon", resume=("muon-tp2", 10)),
    Row("muon", "muon-w1@10>tp2-dp2-zero3", 4, "dist.tensor_parallel=2 " + Z3, base="muon", resume=(ONE, 10)),
    # Mixture of Experts: each expert's matrices orthogonalised on their own (by their owners under
    # ZeRO), the routers AdamW's; resumed on one rank.
    Row("muon", "moe-muon-zero1-w2", 2, "dist.zero_stage=1", base="moe-muon", checks=(muon_traffic,)),
    Row("muon", "moe-muon-zero3-w4", 4, Z3, base="moe-muon", checks=(muon_traffic,)),
    Row("muon", "moe-muon-zero3-w4@10>w1", 1, base="moe-muon", resume=("moe-muon-zero3-w4", 10)),
    Row("muon", "moe-muon-ep2", 2, "dist.expert_parallel=2", base="moe-muon"),
    Row("muon", "moe-muon-ep2-dp2-zero1", 4, "dist.expert_parallel=2 dist.zero_stage=1", base="moe-muon",
        checks=(muon_traffic,)),

    # Mixture of Experts: the router's losses are per micro-batch (train.micro_batch_size sequences of
    # one rank), so data parallelism and ZeRO match one rank at the same micro_batch_size; runs
    # resumed on another layout continue the curve.
    Row("moe", "moe-w2", 2, base="moe"),
    Row("moe", "moe-zero1-w2", 2, "dist.zero_stage=1", base="moe"),
    Row("moe", "moe-zero2-w2", 2, "dist.zero_stage=2", base="moe"),
    Row("moe", "moe-zero3-w2", 2, Z3, base="moe"),
    Row("moe", "moe-zero3-w4", 4, Z3, base="moe"),
    Row("moe", "moe-w2@10>w1", 1, base="moe", resume=("moe-w2", 10)),
    Row("moe", "moe-zero3-w2@10>w1", 1, base="moe", resume=("moe-zero3-w2", 10), against=ONE),
    # Expert parallelism: each rank of an expert group holds 2 of the 4 experts of every MoE layer
    # and reads batches of its own; the tokens' rows travel to their experts by all-to-all.
    Row("moe", "moe-ep2", 2, "dist.expert_parallel=2", base="moe"),
    Row("moe", "moe-ep4", 4, "dist.expert_parallel=4", base="moe"),
    Row("moe", "moe-ep2-dp2-zero1", 4, "dist.expert_parallel=2 dist.zero_stage=1", base="moe"),
    Row("moe", "moe-ep2-zero3", 2, "dist.expert_parallel=2 " + Z3, base="moe"),
    Row("moe", "moe-ep2-dp2-zero3", 4, "dist.expert_parallel=2 " + Z3, base="moe"),
    Row("moe", "moe-ep2@10>w1", 1, base="moe", resume=("moe-ep2", 10)),
    Row("moe", "moe-ep2@10>ep4", 4, "dist.expert_parallel=4", base="moe", resume=("moe-ep2", 10)),
    Row("moe", "moe-w1@10>ep2-dp2-zero3", 4, "dist.expert_parallel=2 " + Z3, base="moe", resume=(ONE, 10)),
    Row("moe", "moe-bias-ep2", 2, "dist.expert_parallel=2", base="moe-bias"),
    # Tensor parallelism splits attention and the dense layer; each tensor rank runs the MoE MLP
    # whole on the micro-batch. A pipeline's stages hold MoE layers as any other (the router
    # statistics and expert loads summed over the stages). Both with expert parallelism.
    Row("moe", "moe-tp2", 2, "dist.tensor_parallel=2", base="moe", checks=(tensor_traffic,)),
    Row("moe", "moe-tp2-sp", 2, "dist.tensor_parallel=2 dist.sequence_parallel=true", base="moe",
        checks=(tensor_traffic,)),
    Row("moe", "moe-ep2-tp2-sp", 4, "dist.expert_parallel=2 dist.tensor_parallel=2 dist.sequence_parallel=true",
        base="moe"),
    Row("moe", "moe-cp2", 2, "dist.context_parallel=2", base="moe", checks=(context_traffic,)),
    Row("moe", "moe-cp2-allgather", 2, "dist.context_parallel=2 dist.context_parallel_mode=allgather", base="moe"),
    Row("moe", "moe-ep2-cp2", 4, "dist.expert_parallel=2 dist.context_parallel=2", base="moe"),
    Row("moe", "moe-ep2-cp2-zero3", 4, "dist.expert_parallel=2 dist.context_parallel=2 " + Z3, base="moe"),
    Row("moe", "moe-cp2-pp2", 4, "dist.context_parallel=2 dist.pipeline_parallel=2", base="moe"),
    Row("moe", "moe-bias-ep2-cp2", 4, "dist.expert_parallel=2 dist.context_parallel=2", base="moe-bias"),
    Row("moe", "moe-ep2-cp2@10>ep2-tp2-sp", 4,
        "dist.expert_parallel=2 dist.tensor_parallel=2 dist.sequence_parallel=true", base="moe",
        resume=("moe-ep2-cp2", 10)),
    Row("moe", "moe-ep2-tp2", 4, "dist.expert_parallel=2 dist.tensor_parallel=2", base="moe"),
    Row("moe", "moe-ep2-tp2-zero3", 4, "dist.expert_parallel=2 dist.tensor_parallel=2 " + Z3, base="moe"),
    Row("moe", "moe-pp2", 2, "dist.pipeline_parallel=2", base="moe"),
    Row("moe", "moe-ep2-pp2", 4, "dist.expert_parallel=2 dist.pipeline_parallel=2", base="moe"),
    Row("moe", "moe-ep2-pp2-zero1", 4, "dist.expert_parallel=2 dist.pipeline_parallel=2 dist.zero_stage=1", base="moe"),
    Row("moe", "moe-pp2-interleaved", 2,
        "dist.pipeline_parallel=2 dist.pipeline_schedule=interleaved dist.virtual_stages=2", base="moe"),
    Row("moe", "moe-bias-ep2-pp2", 4, "dist.expert_parallel=2 dist.pipeline_parallel=2", base="moe-bias"),
    Row("moe", "moe-ep2-pp2@10>ep2-tp2", 4, "dist.expert_parallel=2 dist.tensor_parallel=2", base="moe",
        resume=("moe-ep2-pp2", 10)),
    Row("moe", "moe-cap-ep2", 2, "dist.expert_parallel=2", base="moe-cap"),
    Row("moe", "moe-every-ep2", 2, "dist.expert_parallel=2", base="moe-every", checks=(expert_traffic,)),
    Row("moe", "moe-every-ep4", 4, "dist.expert_parallel=4", base="moe-every", checks=(expert_traffic,)),
    Row("moe", "moe-every-ep2-dp2-zero1", 4, "dist.expert_parallel=2 dist.zero_stage=1", base="moe-every",
        checks=(expert_traffic,)),
    Row("moe", "moe-every-ep2-zero3", 2, "dist.expert_parallel=2 " + Z3, base="moe-every", checks=(expert_traffic,)),
    Row("moe", "moe-cap-ep2-dp2-zero1", 4, "dist.expert_parallel=2 dist.zero_stage=1", base="moe-cap"),
    # train.recompute: "mlp" keeps each MoE layer's routing and dispatch plan and recomputes the
    # experts' and shared experts' activations; "full" runs the whole layer again (its all-to-alls
    # too). Both equal no recompute, on one rank and at expert 2 x data 2.
    Row("moe", "moe-recompute-mlp", 1, "train.recompute=mlp", base="moe", loss_tol=1e-6, weight_tol=1e-5),
    Row("moe", "moe-recompute-full", 1, "train.recompute=full", base="moe", loss_tol=1e-6, weight_tol=1e-5),
    Row("moe", "moe-ep2-dp2-zero1-recompute-mlp", 4, "dist.expert_parallel=2 dist.zero_stage=1 train.recompute=mlp",
        base="moe", against="moe-ep2-dp2-zero1", loss_tol=1e-6, weight_tol=1e-5),
    Row("moe", "moe-ep2-dp2-zero1-recompute-full", 4,
        "dist.expert_parallel=2 dist.zero_stage=1 train.recompute=full", base="moe", against="moe-ep2-dp2-zero1",
        loss_tol=1e-6, weight_tol=1e-5),
    Row("moe", "moe-every-ep2-recompute-full", 2, "dist.expert_parallel=2 train.recompute=full", base="moe-every",
        against="moe-every-ep2", loss_tol=1e-6, weight_tol=1e-5, checks=(expert_traffic,)),
    Row("moe", "moe-tp2-sp-recompute-full", 2, "dist.tensor_parallel=2 dist.sequence_parallel=true train.recompute=full",
        base="moe", against="moe-tp2-sp", loss_tol=1e-6, weight_tol=1e-5, checks=(tensor_traffic,)),
    Row("moe", "moe-tp2-sp-recompute-mlp", 2, "dist.tensor_parallel=2 dist.sequence_parallel=true train.recompute=mlp",
        base="moe", against="moe-tp2-sp", loss_tol=1e-6, weight_tol=1e-5, checks=(tensor_traffic,)),
    Row("moe", "moe-tp2-recompute-full", 2, "dist.tensor_parallel=2 train.recompute=full", base="moe",
        against="moe-tp2", loss_tol=1e-6, weight_tol=1e-5, checks=(tensor_traffic,)),
    # The expert bias is state: a run resumed at its step-10 checkpoint on its own layout ends with
    # the same files (the bias, the weights and AdamW's moments) as the uninterrupted one.
    Row("moe", "moe-bias-zero3-w2", 2, Z3, base="moe-bias"),
    Row("moe", "moe-bias-zero3-w2@10>zero3-w2", 2, Z3, base="moe-bias", resume=("moe-bias-zero3-w2", 10), **EXACT),
    Row("moe", "moe-bias-zero3-w2@10>w1", 1, base="moe-bias", resume=("moe-bias-zero3-w2", 10)),

    # Interrupted runs end bit for bit as uninterrupted ones; an earlier version's checkpoints resume.
    Row("checkpoint", "w1-zero1-sigkill", 1, "dist.zero_stage=1", base="long", interrupt=("SIGKILL", 12, 10, (0.05, 0.35)), **EXACT),
    Row("checkpoint", "w2-zero1-sigkill", 2, "dist.zero_stage=1", base="long", interrupt=("SIGKILL", 12, 10, (0.05, 0.35)), **EXACT),
    Row("checkpoint", "w2-zero3-sigkill", 2, Z3, base="long", interrupt=("SIGKILL", 8, 6, (0.2, 0.6)), **EXACT),
    Row("checkpoint", "w1-sigterm", 1, base="term", interrupt=("SIGTERM",), **EXACT),
    Row("checkpoint", "legacy-w2-zero1@10>w1", 1, base="legacy", resume=("legacy:world2_zero1", 10), weight_tol=None),
    Row("checkpoint", "legacy-w2-zero1@10>w4-zero3", 4, Z3, base="legacy", resume=("legacy:world2_zero1", 10),
        weight_tol=None),
    Row("checkpoint", "legacy-tp2-dp2-zero1@10>tp2-zero3", 2, "dist.tensor_parallel=2 " + Z3, base="legacy",
        resume=("legacy:tensor2_data2_zero1", 10), weight_tol=None),
    Row("checkpoint", "legacy-tp2-dp2-zero1@10>w1", 1, base="legacy", resume=("legacy:tensor2_data2_zero1", 10),
        weight_tol=None),
    # Written before the optimizer interface: each rank's weights and adamw.m/adamw.v as ranges.
    Row("checkpoint", "legacy-w2-zero3@10>w1", 1, base="legacy", resume=("legacy:world2_zero3", 10), weight_tol=None),
    Row("checkpoint", "legacy-w2-zero3@10>w2-zero1", 2, "dist.zero_stage=1", base="legacy",
        resume=("legacy:world2_zero3", 10), weight_tol=None),
]
REFERENCES = ("gpt2", "llama", "llama-bf16", "llama-qk")  # base configs whose one-rank run the group "references" shares


# ----- running -----

class Run:
    """One finished training run: its folder, ranks and resolved config."""

    earlier_version = False  # an earlier version's run: its metrics have no final validation

    def __init__(self, path, ranks):
        self.dir, self.ranks = path, ranks
        self.config = json.load(open(f"{path}/config.json")) if os.path.exists(f"{path}/config.json") else None

    def metrics(self):
        with open(f"{self.dir}/metrics.jsonl") as f:
            return [json.loads(line) for line in f]

    def log(self):
        with open(f"{self.dir}.log", errors="replace") as f:
            return f.read()

    def losses(self):
        # MoE runs: the router's statistics per update too (each micro-batch's, whoever ran it)
        keys = ("loss", "val_loss", "aux_loss", "z_loss", "load_imbalance", "dropped_frac")
        return {(m["step"], k): m[k] for m in self.metrics() for k in keys if k in m}

    def final_checkpoint(self):
        with open(f"{self.dir}/checkpoints/latest") as f:
            return f"{self.dir}/checkpoints/{f.read().strip()}"


class Harness:
    def __init__(self, llmtrain, mpiexec, work, groups):
        self.llmtrain, self.mpiexec, self.work = llmtrain, mpiexec, work
        self.out = os.path.join(work, "+".join(groups))
        shutil.rmtree(self.out, ignore_errors=True)
        os.makedirs(self.out)
        self.data = os.path.join(work, "data")
        self.runs, self.failed = {}, {}
        self.passed, self.failures = 0, []
        self.by_name = {row.name: row for row in ROWS}
        self.mounts = []

    # processes
    def command(self, ranks, *args):
        command = [self.llmtrain, *args]
        if ranks > 1:
            command = [self.mpiexec, "--allow-run-as-root", "--oversubscribe", "-np", str(ranks), *command]
        return command

    def call(self, ranks, *args, log=None, cwd=None):
        """Runs llmtrain (under mpirun past one rank); returns (exit status, output)."""
        r = subprocess.run(self.command(ranks, *args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=ENV,
                           cwd=cwd or self.work)
        out = r.stdout.decode(errors="replace")
        if log:
            with open(log, "a") as f:
                f.write(out)
        return r.returncode, out

    def start(self, ranks, *args, log):
        with open(log, "a") as f:
            return subprocess.Popen(self.command(ranks, *args), stdout=f, stderr=subprocess.STDOUT, env=ENV,
                                    cwd=self.work, start_new_session=True)

    def kill_all(self, marker, sig=signal.SIGKILL):
        """Sends SIG to every process whose command line names MARKER (a run folder of ours)."""
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or int(pid) == os.getpid():
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        os.kill(int(pid), sig)
            except (OSError, ProcessLookupError):
                pass

    def pass_(self, what):
        print(f"ok: {what}", flush=True)
        self.passed += 1

    def fail(self, what):
        print(f"FAILED: {what}", flush=True)
        self.failures.append(what)

    def prepare_data(self):
        if not os.path.exists(f"{self.data}_docs.ok"):  # short documents, several to a sequence, with end-of-text
            rng = random.Random(7)
            words = "the a of and to in is was for on with as by at from it that this be".split()
            with open(f"{self.work}/docs.jsonl", "w") as f:
                for i in range(400):
                    text = f"doc {i}: " + " ".join(rng.choice(words) for _ in range(rng.randint(2, 30))) + "."
                    f.write(json.dumps({"text": text}) + "\n")
            status, out = self.call(1, "tokenize", "--input", f"{self.work}/docs.jsonl", "--output", f"{self.data}_docs",
                                    "--tokenizer", "bpe:300", "--force")
            if status != 0:
                sys.exit(f"FAILED: tokenize: {out}")
            open(f"{self.data}_docs.ok", "w").close()
        if os.path.exists(f"{self.data}.ok"):
            return
        with open(f"{self.work}/text.txt", "w") as f:
            f.writelines(f"line {i} of the resume test corpus, with some words\n" for i in range(1, 601))
        status, out = self.call(1, "tokenize", "--input", f"{self.work}/text.txt", "--output", self.data)
        if status != 0:
            sys.exit(f"FAILED: tokenize: {out}")
        open(f"{self.data}.ok", "w").close()

    def config_file(self, base):
        path = f"{self.out}/{base}.json"
        if not os.path.exists(path):
            with open(path, "w") as f:
                json.dump(base_config(base, self.data), f)
        return path

    def train(self, path, ranks, base, sets, *extra):
        overrides = [arg for s in sets.split() for arg in ("--set", s)]
        status, out = self.call(ranks, "train", "--config", self.config_file(base), "--run-dir", path, *overrides, *extra,
                                log=f"{path}.log")
        if status != 0:
            raise RuntimeError(f"exit {status}: {out.strip().splitlines()[-3:] if out.strip() else ''}")
        return Run(path, ranks)

    # references and rows
    def reference(self, base):
        """The one-rank run of BASE: the shared one when the group "references" wrote it."""
        key = f"{ONE} {base}"
        if key not in self.runs:
            shared = f"{self.work}/references/{base}"
            if os.path.exists(f"{shared}.ok"):
                self.runs[key] = Run(shared, 1)
            else:
                self.runs[key] = self.train(f"{self.out}/one-rank-{base}", 1, base, "")
        return self.runs[key]

    def writer(self, name, row):
        if name == ONE:
            return self.reference(row.base)
        if name.startswith("legacy:"):  # an earlier version's step-10 checkpoint and its run's metrics
            fixture = name.split(":", 1)[1]
            path = f"{self.out}/{fixture}"
            if not os.path.exists(path):
                shutil.copytree(f"{LEGACY}/{fixture}", f"{path}/checkpoints/step_00000010")
                shutil.copy(f"{LEGACY}/{fixture}/metrics.jsonl", f"{path}/metrics.jsonl")
            run = Run(path, 0)
            run.earlier_version = True
            return run
        return self.row_run(self.by_name[name])

    def row_run(self, row):
        """ROW's run, trained once (and checked when it is first trained)."""
        if row.name in self.failed:
            raise RuntimeError(f"row {row.name} failed")
        if row.name not in self.runs:
            try:
                self.runs[row.name] = self.check_row(row)
            except Exception as e:
                self.failed[row.name] = e
                self.fail(f"{self.describe(row)}: {e}")
                raise RuntimeError(f"row {row.name} failed")
        return self.runs[row.name]

    def describe(self, row):
        where = f"{row.ranks} rank{'s' if row.ranks > 1 else ''}" + (f" {row.sets}" if row.sets else "")
        if row.resume:
            where += f", from {row.resume[0]}'s step {row.resume[1]}"
        return f"{row.name} ({row.base}, {where})"

    def check_row(self, row):
        path = f"{self.out}/{row.name}"
        if row.interrupt:
            ref = self.train(f"{path}.uninterrupted", row.ranks, row.base, row.sets)
            run = self.interrupted(path, row)
            start = 0
        elif row.resume:
            writer, start = row.resume
            source = self.writer(writer, row)
            run = self.train(path, row.ranks, row.base, row.sets, "--resume",
                             f"{source.dir}/checkpoints/step_{start:08d}")
            ref = self.writer(row.against or writer, row)
        else:
            run = self.train(path, row.ranks, row.base, row.sets)
            ref = self.writer(row.against or ONE, row)
            start = 0
        summary = self.compare(row, run, ref, start)
        for check in row.checks:
            check(run)
        against = "uninterrupted" if row.interrupt else (row.against or (row.resume[0] if row.resume else ONE))
        checks = "".join(f"; {c.what}" for c in row.checks)
        self.pass_(f"{self.describe(row)} against {against}: {summary}{checks}")
        return run

    def compare(self, row, run, ref, start):
        want = {k: v for k, v in ref.losses().items() if k[0] > start}
        got = run.losses()
        if ref.earlier_version:
            got = {k: v for k, v in got.items() if k[1] == "loss"}
        steps = sorted(s for s, k in got if k == "loss")
        assert steps == list(range(start + 1, run.config["train"]["max_steps"] + 1)), f"steps logged: {steps}"
        assert sorted(got) == sorted(want), f"logged {sorted(got)}, reference {sorted(want)}"
        worst = max(abs(got[k] - want[k]) for k in got)
        assert worst <= row.loss_tol, f"largest loss difference {worst:.2e} > {row.loss_tol}"
        if row.loss_tol == 0:  # bit for bit: also no step logged twice, nothing out of order
            lines = lambda r: [(m["step"], m["loss"]) for m in r.metrics() if "loss" in m and m["step"] > start]
            assert lines(run) == lines(ref), "metrics.jsonl's loss lines differ"
        summary = f"{len(got)} losses within {row.loss_tol} (largest difference {worst:.1e})"
        if row.weight_tol is None:
            return summary
        if row.weight_tol == 0:  # bit for bit: the same files (weights and optimizer state)
            a, b = ref.final_checkpoint(), run.final_checkpoint()
            assert os.path.basename(a) == os.path.basename(b), f"final checkpoints {a} and {b}"
            files = sorted(f for f in os.listdir(a) if f.endswith(".safetensors"))
            assert files == sorted(f for f in os.listdir(b) if f.endswith(".safetensors")), "checkpoint files differ"
            for name in files:
                with open(f"{a}/{name}", "rb") as fa, open(f"{b}/{name}", "rb") as fb:
                    assert fa.read() == fb.read(), f"{name} differs"
            return summary + f"; final checkpoint's {len(files)} safetensors files identical"
        wa, wb = self.weights(ref), self.weights(run)
        assert sorted(wa) == sorted(wb), f"tensors {sorted(wa)} and {sorted(wb)}"
        worst = max(float(np.max(np.abs(wa[k] - wb[k]))) for k in wa)
        assert worst <= row.weight_tol, f"largest weight difference {worst:.2e} > {row.weight_tol}"
        return summary + f"; weights within {row.weight_tol} (largest difference {worst:.1e})"

    @staticmethod
    def flat_weights(checkpoint):
        """A checkpoint's whole flat parameter buffer from its model*.safetensors: one file of named
        tensors (in flat order), or one file per writing rank of "ranges" (begin, end) and
        "weights". For MoE models, which `export` does not write yet."""
        pieces = []
        for name in sorted(f for f in os.listdir(checkpoint) if f.startswith("model") and f.endswith(".safetensors")):
            with open(f"{checkpoint}/{name}", "rb") as f:
                raw = f.read()
            n = struct.unpack("<Q", raw[:8])[0]
            header = json.loads(raw[8:8 + n])
            data = lambda info, dtype: np.frombuffer(raw[8 + n + info["data_offsets"][0]:8 + n + info["data_offsets"][1]],
                                                     dtype=dtype)
            if "ranges" in header:
                ranges, weights, at = data(header["ranges"], np.int64).reshape(-1, 2), data(header["weights"], np.float32), 0
                for begin, end in ranges:
                    pieces.append((int(begin), weights[at:at + end - begin]))
                    at += end - begin
            else:
                at = 0
                for key, info in sorted(((k, v) for k, v in header.items() if k != "__metadata__"),
                                        key=lambda kv: kv[1]["data_offsets"][0]):
                    values = data(info, np.float32)
                    pieces.append((at, values))
                    at += values.size
        flat = np.full(max(o + v.size for o, v in pieces), np.nan, dtype=np.float32)
        for offset, values in pieces:
            flat[offset:offset + values.size] = values
        assert not np.isnan(flat).any(), f"{checkpoint}: parts of the flat buffer missing"
        return {"flat": flat}

    def weights(self, run):
        """The final model as one file, whichever ranks wrote which ranges of it (llmtrain export)."""
        if run.config["model"].get("moe"):
            return self.flat_weights(run.final_checkpoint())
        folder = f"{run.dir}.weights"
        if not os.path.exists(f"{folder}/model.safetensors"):
            status, out = self.call(1, "export", "--checkpoint", run.dir, "--output", folder)
            assert status == 0, f"export: {out}"
        with open(f"{folder}/model.safetensors", "rb") as f:
            raw = f.read()
        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8:8 + n])
        out = {}
        for name, info in header.items():
            if name != "__metadata__":
                assert info["dtype"] == "F32", info
                lo, hi = info["data_offsets"]
                out[name] = np.frombuffer(raw[8 + n + lo:8 + n + hi], dtype=np.float32)
        return out

    def interrupted(self, path, row):
        """Runs ROW's layout, interrupting it as ROW says and resuming (--resume auto) until it ends."""
        overrides = [arg for s in row.sets.split() for arg in ("--set", s)]
        args = ("train", "--config", self.config_file(row.base), "--run-dir", path, *overrides)
        if row.interrupt[0] == "SIGTERM":  # a checkpoint at the stop, exit 75; the resubmitted run goes on
            job = self.start(row.ranks, *args, log=f"{path}.log")
            # Signalled once it trains (a signal during start-up is not what this row checks).
            if not wait_for_metrics(job, path):
                self.kill_all(f"--run-dir\0{path}\0")
                job.wait()
                log = open(f"{path}.log", errors="replace").read()
                raise AssertionError(f"SIGTERM: the run logged no step: {log[-500:]}")
            job.send_signal(signal.SIGTERM)
            status = job.wait()
            assert status == 75, f"SIGTERM: exit status {status}, expected 75"
            print(f"  SIGTERM: exit 75 after {os.path.basename(Run(path, 1).final_checkpoint())}")
            status, out = self.call(row.ranks, *args, log=f"{path}.log")
            assert status == 0, f"resubmitted run: exit {status}: {out[-500:]}"
            return Run(path, row.ranks)
        _, times, at_least, (low, high) = row.interrupt
        rng, kills = random.Random(row.name), 0
        while True:
            job = self.start(row.ranks, *args, log=f"{path}.log")
            if kills < times:
                time.sleep(rng.uniform(low, high))
                if job.poll() is None:
                    self.kill_all(f"--run-dir\0{path}\0")
                    job.wait()
                    kills += 1
                    continue
            status = job.wait()
            assert status == 0, f"resumed run: exit {status}: {open(f'{path}.log', errors='replace').read()[-500:]}"
            break
        assert kills >= at_least, f"only {kills} kills before the run finished"
        print(f"  killed {kills} times")
        return Run(path, row.ranks)

    def run_rows(self, groups):
        for row in ROWS:
            if row.group in groups:
                try:
                    self.row_run(row)
                except RuntimeError:
                    pass  # reported

    def run_checks(self, groups):
        for group, what, check in CHECKS:
            if group in groups:
                try:
                    check(self)
                    self.pass_(what)
                except Exception as e:
                    self.fail(f"{what}: {e}")


# ----- checks that are not a layout against another -----

def zero3_memory(h):
    """ZeRO 3 state per rank (weights, gradients, optimizer state, gathered layers: state_bytes) at
    data-parallel sizes 1, 2 and 4 as `plan` says (0.5%); its sharded part falls as 1/size."""
    model = {"vocab_size": 256, "context_length": 32, "n_layer": 6, "n_head": 4, "d_model": 64}
    config = base_config("gpt2", h.data)
    config.update(model=model, checkpoint={"every": 0})
    config["train"].update(max_steps=1, eval_every=0)
    config["optim"]["warmup_steps"] = 1
    config["dist"] = {"zero_stage": 3}
    path = f"{h.out}/mem-zero3.json"
    with open(path, "w") as f:
        json.dump(config, f)
    units = {"B": 1, "KiB": 1024, "MiB": 1024 ** 2, "GiB": 1024 ** 3}
    measured = {}
    for ranks in (1, 2, 4):
        run = f"{h.out}/mem-zero3-w{ranks}"
        status, out = h.call(ranks, "train", "--config", path, "--run-dir", run, log=f"{run}.log")
        assert status == 0, f"world size {ranks}: {out[-300:]}"
        status, plan = h.call(1, "plan", "--config", path, "--world-size", str(ranks))
        assert status == 0, f"plan: {plan}"
        row = [line for line in plan.splitlines() if line.startswith("fp32 ZeRO 3")][0]
        planned = sum(float(v) * units[u] for v, u in re.findall(r"([0-9.]+) (B|KiB|MiB|GiB)", row)[:4])
        measured[ranks] = [m for m in Run(run, ranks).metrics() if "state_bytes" in m][0]["state_bytes"]
        print(f"  data-parallel size {ranks}: state {measured[ranks]} bytes, plan {planned:.0f}")
        assert abs(measured[ranks] - planned) <= 0.005 * planned, (ranks, measured[ranks], planned)
    C, L = 64, 6
    P = L * (12 * C * C + 13 * C) + 2 * C + 32 * C + 256 * C
    for a, b in ((1, 2), (2, 4)):
        saved = measured[a] - measured[b]
        print(f"  {a} -> {b} ranks: {saved} bytes fewer, 16 P (1/{a} - 1/{b}) = {16 * P * (1 / a - 1 / b):.0f}")
        assert saved >= 0.8 * 16 * P * (1 / a - 1 / b), saved


def tensor_memory(h):
    """State per rank at tensor parallel 1, 2, 4: the split parameters' weights, gradients and
    optimizer state fall as 1/size (the norms, GPT-2's position embedding and the row-parallel
    projections' biases stay whole)."""
    C, L, V, T, F = 64, 4, 256, 32, 256
    config = base_config("gpt2", h.data)
    config.update(model={"vocab_size": V, "context_length": T, "n_layer": L, "n_head": 4, "d_model": C},
                  checkpoint={"every": 0})
    config["train"].update(max_steps=1, eval_every=0)
    config["optim"]["warmup_steps"] = 1
    path = f"{h.out}/mem-tensor.json"
    with open(path, "w") as f:
        json.dump(config, f)
    whole_per_layer = 2 * C + 2 * C + C + C  # ln_1, ln_2 (weight, bias); the two row-parallel biases
    split_per_layer = 3 * C * C + 3 * C + C * C + F * C + F + C * F
    replicated = whole_per_layer * L + 2 * C + T * C  # ... ln_f, wpe
    split = split_per_layer * L + V * C  # ... wte
    for n in (1, 2, 4):
        run = f"{h.out}/mem-tp{n}"
        status, out = h.call(n, "train", "--config", path, "--run-dir", run, "--set", f"dist.tensor_parallel={n}",
                             log=f"{run}.log")
        assert status == 0, f"tensor parallel {n}: {out[-300:]}"
        state = [m for m in Run(run, n).metrics() if "state_bytes" in m][0]["state_bytes"]
        expected = 16 * (replicated + split // n)  # weights, gradients, m and v in fp32 (ZeRO 0)
        print(f"  tensor parallel {n}: state {state} bytes, 16 x (replicated + split / {n}) = {expected}")
        assert state == expected, (n, state, expected)


def eval_as_one_rank(row, flag, layouts):
    """eval of ROW's checkpoint (a row, or "one rank BASE") under mpirun at LAYOUTS (ranks, FLAG's
    value) prints the one-rank validation line, character for character."""
    def check(h):
        run = h.reference(row.split()[-1]) if row.startswith(ONE) else h.row_run(h.by_name[row])
        status, one = h.call(1, "eval", "--checkpoint", run.dir)
        one = one.strip().splitlines()[-1]
        assert status == 0 and "val_loss" in one, one
        for ranks, size in layouts:
            status, got = h.call(ranks, "eval", "--checkpoint", run.dir, flag, str(size))
            got = got.strip().splitlines()[-1] if got.strip() else ""
            assert status == 0 and got == one, f"world size {ranks}, {flag} {size}: '{got}', one rank: '{one}'"
    return check


def eval_tensor_size_refused(h):
    run = h.row_run(h.by_name["tp2-dp2-zero1"])
    status, out = h.call(1, "eval", "--checkpoint", run.dir, "--tensor-parallel", "2")
    assert status == 2 and out.count("llmtrain: error: --tensor-parallel 2: must divide") == 1, f"exit {status}: {out}"


def context_length_refused(h):
    path = f"{h.out}/bad-cp3"
    status, out = h.call(1, "train", "--config", h.config_file("gpt2"), "--run-dir", path,
                         "--set", "dist.context_parallel=3", "--set", "train.max_steps=1")
    assert status == 2 and "dist.context_parallel" in out and "model.context_length" in out, f"exit {status}: {out}"
    assert not os.path.exists(f"{path}/metrics.jsonl"), "the refused run wrote metrics"


def document_mask_refused(h):
    path = f"{h.out}/bad-docs"
    status, out = h.call(1, "train", "--config", h.config_file("gpt2"), "--run-dir", path,
                         "--set", "data.document_mask=true")
    lines = [l for l in out.splitlines() if l.startswith("llmtrain: error:")]
    assert status == 2 and len(lines) == 1 and "data.document_mask" in lines[0] and "end-of-text" in lines[0], \
        f"exit {status}: {out}"
    assert not os.path.exists(f"{path}/metrics.jsonl"), "the refused run wrote metrics"


def moe_refused(h):
    """MoE layers with what is not built for them (a capacity with sequences split over a context
    group): exit 2 before any training, one error line naming both keys."""
    for sets in (["model.moe.capacity_factor=1.5", "dist.context_parallel=2"],):
        key = " ".join(sets)
        path = f"{h.out}/moe-refused-{sets[0]}"
        args = [a for s in sets for a in ("--set", s)]
        status, out = h.call(1, "train", "--config", h.config_file("moe"), "--run-dir", path, *args,
                             "--set", "train.max_steps=1")
        errors = [line for line in out.splitlines() if "error:" in line]
        named = ["model.moe"] + [s.split("=")[0] for s in sets]
        assert status == 2 and len(errors) == 1 and all(n in errors[0] for n in named), f"{key}: exit {status}: {out}"
        assert not os.path.exists(f"{path}/metrics.jsonl"), f"{key}: the refused run wrote metrics"
        print(f"  {key}: {errors[0]}")


def moe_bias_balances(h):
    """Aux-loss-free balancing on a skewed router (sigmoid, 4 experts, top 1, no aux loss, the
    weights almost frozen at lr 1e-6, so the initial router's skew stays): with bias_update_rate
    0.002 at data 2 under ZeRO 3 (the bias's master copy in shards) the load imbalance of the last
    20 of 60 updates falls below 0.8 of the run without it; without it the optimizer leaves the
    bias at exactly 0 (no gradient, no weight decay)."""
    config = base_config("moe", h.data)
    config["model"]["moe"].update(experts=4, top_k=1, shared_experts=0, router="sigmoid", aux_loss_coef=0.0)
    config["train"].update(max_steps=60, eval_every=0)
    config["optim"] = {"lr": 1e-6, "min_lr": 1e-6, "warmup_steps": 0}
    config["checkpoint"] = {"every": 0}
    imbalance = {}
    for rate, ranks, sets in ((0.0, 1, []), (0.002, 2, ["--set", Z3])):
        config["model"]["moe"]["bias_update_rate"] = rate
        path = f"{h.out}/moe-bias-{rate}"
        with open(f"{path}.json", "w") as f:
            json.dump(config, f)
        status, out = h.call(ranks, "train", "--config", f"{path}.json", "--run-dir", path, *sets, log=f"{path}.log")
        assert status == 0, f"rate {rate}: exit {status}: {out[-500:]}"
        run = Run(path, ranks)
        steps = [m["load_imbalance"] for m in run.metrics() if "load_imbalance" in m]
        imbalance[rate] = (steps[0], sum(steps[-20:]) / 20)
        print(f"  bias_update_rate {rate}: load_imbalance {steps[0]:.2f} at update 1, {imbalance[rate][1]:.2f} "
              f"over updates 41-60")
        if rate == 0.0:
            flat = h.flat_weights(run.final_checkpoint())["flat"]
            with open(f"{run.final_checkpoint()}/model.safetensors", "rb") as f:
                raw = f.read()
            header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
            biases = [v for k, v in header.items() if k.endswith("e_score_correction_bias")]
            assert len(biases) == 3, sorted(header)
            for info in biases:
                lo = info["data_offsets"][0] // 4
                assert np.all(flat[lo:lo + 4] == 0.0), f"the optimizer moved the expert bias: {flat[lo:lo + 4]}"
    assert imbalance[0.002][1] < 0.8 * imbalance[0.0][1], imbalance


def damaged_checkpoints(h):
    """A corrupted checkpoint: explicit resume exits 2 naming the file, auto falls back to the
    previous one; truncated and partial ones: explicit resume exits 2 naming what is wrong."""
    config = base_config("long", h.data)
    config["train"]["max_steps"] = 12
    config["checkpoint"] = {"every": 4, "keep_last": 3}
    path, run = f"{h.out}/damage.json", f"{h.out}/damage"
    with open(path, "w") as f:
        json.dump(config, f)
    train = lambda *extra: h.call(1, "train", "--config", path, "--run-dir", run, *extra)
    assert train()[0] == 0, "damage run"
    last = f"{run}/checkpoints/step_00000012"
    with open(f"{last}/model.safetensors", "r+b") as f:  # corrupted
        f.seek(100)
        f.write(b"x")
    status, out = train("--resume", last)
    assert status == 2 and "model.safetensors: checksum mismatch" in out, f"explicit resume of a corrupted one: {status} {out}"
    config["train"]["max_steps"] = 13
    with open(path, "w") as f:
        json.dump(config, f)
    status, out = train()
    assert status == 0, f"auto-resume past a corrupted checkpoint: {out}"
    assert re.search(r"skipping damaged checkpoint: .*step_00000012/model.safetensors: checksum mismatch", out) and \
        re.search(r"resuming from .*step_00000008", out), f"auto-resume did not fall back to step 8: {out}"
    os.truncate(f"{run}/checkpoints/step_00000008/optim-00000.safetensors", 500)  # truncated
    status, out = train("--resume", f"{run}/checkpoints/step_00000008")
    assert status == 2 and "optim-00000.safetensors" in out, f"truncated checkpoint: {status} {out}"
    os.remove(f"{run}/checkpoints/step_00000013/COMPLETE")  # partial
    status, out = train("--resume", f"{run}/checkpoints/step_00000013")
    assert status == 2 and "incomplete checkpoint (no COMPLETE file)" in out, f"partial checkpoint: {status} {out}"


def full_disk(h):
    """A full disk while saving: exit 1 with a clear message; the previous checkpoint loads. (A
    small tmpfs for the checkpoints: needs root and mount, skipped visibly otherwise.)"""
    full = f"{h.out}/full"
    os.makedirs(full)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=700k", "tmpfs", full], capture_output=True).returncode != 0:
        print("SKIPPED: full-disk case needs root to mount a small tmpfs")
        return
    h.mounts.append(full)
    config = base_config("long", h.data)
    config["train"]["max_steps"] = 40
    config["checkpoint"] = {"every": 1, "keep_last": 100, "dir": full}
    path = f"{h.out}/full.json"
    with open(path, "w") as f:
        json.dump(config, f)
    status, out = h.call(1, "train", "--config", path, "--run-dir", f"{h.out}/full-run")
    assert status == 1 and re.search(r"llmtrain: error: .*No space left on device", out), f"{status} {out[-300:]}"
    with open(f"{full}/latest") as f:
        latest = f.read().strip()
    status, out = h.call(1, "eval", "--checkpoint", f"{full}/{latest}")
    assert status == 0, f"the previous checkpoint {latest} does not load: {out}"
    print(f"  the previous checkpoint ({latest}) loads")


def wait_for_metrics(job, run, guard_s=120):
    """Waits until RUN's job has logged a step (metrics.jsonl not empty): True, or False when the job
    ended first or after `guard_s` seconds, which only guards against a hang."""
    guard = time.monotonic() + guard_s
    while time.monotonic() < guard and job.poll() is None:
        if os.path.exists(f"{run}/metrics.jsonl") and os.path.getsize(f"{run}/metrics.jsonl") > 0:
            return True
        time.sleep(0.02)
    return False


def stopped_stage(h):
    """A stage that stops answering mid-step (SIGSTOP) stops the whole job within dist.timeout_s,
    and the message names the stage and rank that never answered."""
    run = f"{h.out}/hang"
    job = h.start(2, "train", "--config", h.config_file("gpt2"), "--run-dir", run, "--set", "dist.pipeline_parallel=2",
                  "--set", "dist.timeout_s=3", "--set", "train.max_steps=100000", "--set", "checkpoint.every=0",
                  log=f"{run}.log")
    if not wait_for_metrics(job, run):  # stopped mid-step, not during start-up
        h.kill_all(f"--run-dir\0{run}\0")
        job.wait()
        log = open(f"{run}.log", errors="replace").read()
        raise AssertionError(f"the pipeline run logged no step: {log[-500:]}")
    victim = None
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if run.encode() in cmdline and b"train" in cmdline and b"OMPI_COMM_WORLD_RANK=1" in environ and \
                os.path.basename(cmdline[0]) == b"llmtrain":
            victim = int(pid)
    if victim is None:
        job.kill()
        raise AssertionError("no rank-1 process to stop")
    os.kill(victim, signal.SIGSTOP)
    start = time.time()
    try:
        status = job.wait(timeout=60)
    except subprocess.TimeoutExpired:
        status = None
    elapsed = time.time() - start
    os.kill(victim, signal.SIGCONT)
    h.kill_all(f"--run-dir\0{run}\0")
    assert status not in (None, 0), f"job with a stopped stage: exit {status} after {elapsed:.0f} s"
    log = open(f"{run}.log", errors="replace").read()
    # A transfer names the peer ("stage 1 (rank 1)"), a collective the missing rank ("rank(s) 1 (stage 1)").
    assert re.search(r"stage 1 \(rank 1\)|rank\(s\) 1 \(stage 1\)", log), f"the message does not name stage 1 and rank 1: {log[-500:]}"
    print(f"  the job ended in {elapsed:.0f} s")


CHECKS = [  # (group, what, check)
    ("zero", "ZeRO 3 state per rank at data-parallel sizes 1, 2, 4 as plan says (0.5%), its sharded part falling as 1/size",
     zero3_memory),
    ("tensor", "eval under mpirun (data 2, tensor 2 x data 2, tensor 2) prints the one-rank validation line",
     eval_as_one_rank("tp2-dp2-zero1", "--tensor-parallel", [(2, 1), (4, 2), (2, 2)])),
    ("tensor", "eval --tensor-parallel 2 on one rank: exit 2, one error line", eval_tensor_size_refused),
    ("tensor", "state per rank at tensor parallel 1, 2, 4: the split parameters' share falls as 1/size", tensor_memory),
    ("context", "eval at context parallel 2 (world size 2 and 4) prints the one-rank validation line",
     eval_as_one_rank(f"{ONE} llama", "--context-parallel", [(2, 2), (4, 2)])),
    ("context", "a context length that does not split into 2 x dist.context_parallel chunks: exit 2 naming both keys",
     context_length_refused),
    ("context", "data.document_mask with a tokenizer that has no end-of-text token (byte): exit 2, one line",
     document_mask_refused),
    ("pipeline", "a stopped stage ends the job within dist.timeout_s (3 s), the message naming stage 1 and rank 1",
     stopped_stage),
    ("moe", "MoE with a capacity under context parallelism: exit 2, one line naming model.moe and the key",
     moe_refused),
    ("moe", "aux-loss-free balancing: bias_update_rate lowers a skewed router's load imbalance (data 2, ZeRO 3); "
            "without it the expert bias stays exactly 0", moe_bias_balances),
    ("checkpoint", "damaged checkpoints: explicit resume exits 2 naming what is wrong; auto falls back to the previous one",
     damaged_checkpoints),
    ("checkpoint", "full disk while saving: exit 1 with a clear message; the previous checkpoint loads", full_disk),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("llmtrain")
    parser.add_argument("mpiexec")
    parser.add_argument("--work", help="keep the runs here (the references shared between invocations)")
    parser.add_argument("--rows", nargs="+", metavar="NAME", help="only these rows of the groups (and no CHECKS)")
    parser.add_argument("groups", nargs="*", metavar="GROUP", help=", ".join(GROUPS))
    args = parser.parse_intermixed_args()
    if args.rows:
        ROWS[:] = [row for row in ROWS if row.name in args.rows]
        CHECKS.clear()
    for group in args.groups:
        if group not in GROUPS:
            parser.error(f"unknown group '{group}' (groups: {', '.join(GROUPS)})")
    groups = args.groups or list(GROUPS)
    temporary = None if args.work else tempfile.mkdtemp()
    work = os.path.abspath(args.work or temporary)
    os.makedirs(work, exist_ok=True)
    h = Harness(os.path.abspath(args.llmtrain), args.mpiexec, work, groups)
    began = time.time()
    try:
        h.prepare_data()
        if "references" in groups:
            for base in REFERENCES:
                shared = f"{work}/references/{base}"
                shutil.rmtree(shared, ignore_errors=True)
                if os.path.exists(f"{shared}.ok"):
                    os.remove(f"{shared}.ok")
                os.makedirs(os.path.dirname(shared), exist_ok=True)
                try:
                    h.train(shared, 1, base, "")
                    open(f"{shared}.ok", "w").close()
                    h.pass_(f"one-rank reference of {base}")
                except RuntimeError as e:
                    h.fail(f"one-rank reference of {base}: {e}")
        h.run_rows(groups)
        h.run_checks(groups)
    finally:
        h.kill_all(f"{h.out}/")
        for mount in h.mounts:
            subprocess.run(["umount", mount])
        if temporary:
            shutil.rmtree(temporary, ignore_errors=True)
    print(f"{h.passed} passed, {len(h.failures)} failed ({time.time() - began:.0f} s)")
    for what in h.failures:
        print(f"  failed: {what}")
    sys.exit(1 if h.failures else 0)


if __name__ == "__main__":
    main()
