#!/usr/bin/python3
"""Training against Hugging Face transformers 5 itself: a tiny model made and saved by
transformers (its own class, its own initialisation, its norms' weights perturbed so that they
matter) is trained by llmtrain from model.init_from, and by PyTorch on the transformers model with
the same batches, the same loss and the same optimizer: torch.optim.AdamW with llmtrain's
learning-rate schedule (linear warmup, cosine decay to min_lr), betas, eps, weight decay on the
2-D parameters only, and gradient clipping by the global norm, all in fp32. Then

  - the loss of every step (metrics.jsonl's "loss", the mean over the batch before the update)
    equals PyTorch's within 1e-4 relative;
  - every weight's update (final minus initial), read back through `export --format hf`, equals
    PyTorch's within 2e-3 relative (the norm of the difference over the norm of PyTorch's);
  - transformers loads the export as the same class, and its logits equal the PyTorch-trained
    model's.

The model kinds are a table (MODEL_KINDS): each names its transformers config class and model
class, its llmtrain model keys, and a loss hook (`extra_loss`) where a kind with a router would
add its auxiliary loss from the router logits (Mixtral, Qwen3-MoE). Needs transformers 5 and
PyTorch (scripts/setup.sh --with-transformers5, into the virtual environment .venv-torch, which
this script then uses); SKIPPED without them.

Usage: hf_training_reference_test.py LLMTRAIN_BINARY [KIND...]
"""
import json
import os
import subprocess
import sys
import tempfile

from reference_venv import use_reference_venv

use_reference_venv()
try:
    import numpy as np
    import torch
    import transformers
    from safetensors.numpy import load_file, save_file
except ImportError as e:
    print(f"SKIPPED: needs PyTorch and transformers 5 ({e}); install them with scripts/setup.sh --with-transformers5")
    sys.exit(0)
if int(transformers.__version__.split(".")[0]) < 5:
    print(f"SKIPPED: transformers {transformers.__version__} is older than 5; "
          "install 5.x with scripts/setup.sh --with-transformers5")
    sys.exit(0)

BINARY = os.path.abspath(sys.argv[1])
failures = []


def check(ok, what):
    print(("ok: " if ok else "FAILED: ") + what, flush=True)
    if not ok:
        failures.append(what)


def no_extra_loss(outputs):
    """A dense model's loss is the cross-entropy alone."""
    return 0.0


SPREADS = []  # each step's mean over tokens of the first router's largest minus smallest logit
AUX_LOSSES = []  # each training step's mean over MoE layers and micro-batches of aux_l (metrics' aux_loss)


def switch_aux_loss(router_logits, top_k):
    """docs/moe.md's load-balancing loss of one layer over one micro-batch's N tokens:
    (E / k) sum_e (c_e / N) Pbar_e, c_e the tokens that chose e (a count, no gradient), Pbar_e the
    mean over the N tokens of the router's softmax probability of e. (transformers'
    load_balancing_loss_func is E sum_e (c_e / N) Pbar_e over all layers' tokens at once: not it.)"""
    probs = torch.softmax(router_logits.float(), dim=-1)
    N, E = probs.shape
    chosen = torch.topk(probs, top_k, dim=-1).indices
    counts = torch.zeros(E).index_add_(0, chosen.reshape(-1), torch.ones(chosen.numel()))
    return (E / top_k) * (counts / N * probs.mean(dim=0)).sum()


def moe_extra_loss(coef, top_k):
    """aux_loss_coef x sum over layers of aux_l, each micro-batch counting as its share of the update."""
    def extra(outputs):
        micro_rows = TRAIN["micro_batch_size"] * (outputs.logits.shape[1])
        micro = TRAIN["global_batch_size"] // TRAIN["micro_batch_size"]
        per_layer = [torch.stack([switch_aux_loss(logits[m * micro_rows:(m + 1) * micro_rows], top_k)
                                  for m in range(micro)]).mean() for logits in outputs.router_logits]
        AUX_LOSSES.append(float(torch.stack(per_layer).mean()))
        first = outputs.router_logits[0].detach()
        SPREADS.append(float((first.max(-1).values - first.min(-1).values).mean()))
        return coef * torch.stack(per_layer).sum()
    return extra


def fused_experts(tensors, layers, experts):
    """transformers 5's in-memory MoE names: per layer mlp.gate.weight, mlp.experts.gate_up_proj
    (E, 2I, C), each expert's gate rows then its up rows, and mlp.experts.down_proj (E, C, I)."""
    out = dict(tensors)
    for l in range(layers):
        for old, new in ((f"model.layers.{l}.block_sparse_moe.gate.weight", f"model.layers.{l}.mlp.gate.weight"),):
            if old in out:
                out[new] = out.pop(old)
        for prefix, (g, u, d) in ((f"model.layers.{l}.block_sparse_moe.experts", ("w1", "w3", "w2")),
                                  (f"model.layers.{l}.mlp.experts", ("gate_proj", "up_proj", "down_proj"))):
            if f"{prefix}.0.{g}.weight" not in out:
                continue
            out[f"model.layers.{l}.mlp.experts.gate_up_proj"] = np.stack(
                [np.concatenate([out.pop(f"{prefix}.{e}.{g}.weight"), out.pop(f"{prefix}.{e}.{u}.weight")])
                 for e in range(experts)])
            out[f"model.layers.{l}.mlp.experts.down_proj"] = np.stack(
                [out.pop(f"{prefix}.{e}.{d}.weight") for e in range(experts)])
    return out


# One row per model kind. `hf` builds the transformers config; `model` is llmtrain's model section
# for the same shapes; `extra_loss(outputs)` is added to the cross-entropy (a router's aux loss).
MODEL_KINDS = {
    "qwen3": {
        "config_class": "Qwen3Config",
        "model_class": "Qwen3ForCausalLM",
        "hf": dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, max_position_embeddings=16, rms_norm_eps=1e-6,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
                   attention_bias=False, use_sliding_window=False),
        "model": {"arch": "llama", "vocab_size": 96, "context_length": 16, "n_layer": 2, "n_head": 4, "n_kv_head": 2,
                  "d_model": 32, "ffn_hidden": 48, "norm_eps": 1e-6, "rope_theta": 10000.0, "tie_embeddings": False,
                  "qk_norm": True},
        "extra_loss": no_extra_loss,
    },
    # Mixture of Experts: the routers' weights scaled up so that routing is decided, not a coin toss.
    "mixtral": {
        "config_class": "MixtralConfig",
        "model_class": "MixtralForCausalLM",
        "hf": dict(vocab_size=96, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, max_position_embeddings=16, rms_norm_eps=1e-5,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
                   num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0, sliding_window=None,
                   output_router_logits=True, router_aux_loss_coef=0.02),
        "model": {"arch": "llama", "vocab_size": 96, "context_length": 16, "n_layer": 2, "n_head": 4, "n_kv_head": 2,
                  "d_model": 32, "ffn_hidden": 48, "norm_eps": 1e-5, "rope_theta": 10000.0, "tie_embeddings": False,
                  "moe": {"experts": 4, "top_k": 2, "ffn_hidden": 24, "normalize_top_k": True,
                          "aux_loss_coef": 0.02}},
        "extra_loss": moe_extra_loss(0.02, 2),
        "router_scale": 20.0,
        "grad_clip": 1.0,
    },
    "qwen3moe": {
        "config_class": "Qwen3MoeConfig",
        "model_class": "Qwen3MoeForCausalLM",
        "hf": dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=16,
                   rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                   tie_word_embeddings=False, attention_bias=False, use_sliding_window=False, num_experts=4,
                   num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[],
                   output_router_logits=True, router_aux_loss_coef=0.02),
        "model": {"arch": "llama", "vocab_size": 96, "context_length": 16, "n_layer": 2, "n_head": 4, "n_kv_head": 2,
                  "d_model": 32, "ffn_hidden": 48, "norm_eps": 1e-6, "rope_theta": 10000.0, "tie_embeddings": False,
                  "qk_norm": True,
                  "moe": {"experts": 4, "top_k": 2, "ffn_hidden": 24, "normalize_top_k": False,
                          "aux_loss_coef": 0.02}},
        "extra_loss": moe_extra_loss(0.02, 2),
        "router_scale": 20.0,
    },
}

TRAIN = {"micro_batch_size": 2, "global_batch_size": 4, "max_steps": 6, "grad_clip": 1.2, "seed": 1,
         "log_every": 1, "eval_every": 0, "precision": "fp32"}
OPTIM = {"name": "adamw", "lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2, "schedule": "cosine", "weight_decay": 0.1,
         "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}


def learning_rate(step):
    """llmtrain's schedule (docs/training.md): linear warmup to lr, then cosine to min_lr."""
    o, n = OPTIM, TRAIN["max_steps"]
    if step <= o["warmup_steps"]:
        return o["lr"] * step / o["warmup_steps"]
    progress = min(max((step - o["warmup_steps"]) / (n - o["warmup_steps"]), 0.0), 1.0)
    return o["min_lr"] + 0.5 * (o["lr"] - o["min_lr"]) * (1 + np.cos(np.pi * progress))


def write_shard(path, tokens):
    header = np.zeros(256, dtype="<i4")
    header[:3] = [20240520, 1, len(tokens)]
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype="<u2").tobytes())


def run(*args):
    r = subprocess.run([BINARY, *args], capture_output=True, text=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1"))
    if r.returncode != 0:
        sys.exit(f"FAILED: llmtrain {' '.join(args)}: exit {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r


def torch_training(model, batches, kind):
    """The same steps by PyTorch on the transformers model: AdamW with decay on the 2-D weights."""
    o = OPTIM
    decay = [p for p in model.parameters() if p.dim() >= 2]
    plain = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o["weight_decay"]},
                             {"params": plain, "weight_decay": 0.0}],
                            lr=o["lr"], betas=(o["beta1"], o["beta2"]), eps=o["eps"])
    clip = kind.get("grad_clip", TRAIN["grad_clip"])
    losses, norms = [], []
    for step, batch in enumerate(batches, start=1):
        inputs, targets = torch.tensor(batch[:, :-1]), torch.tensor(batch[:, 1:])
        opt.zero_grad()
        outputs = model(input_ids=inputs, **({"output_router_logits": True} if "router_scale" in kind else {}))
        logits = outputs.logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        (loss + kind["extra_loss"](outputs)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        for group in opt.param_groups:
            group["lr"] = learning_rate(step)
        opt.step()
        losses.append(loss.item())
    return losses, norms


def compare(name, kind):
    torch.manual_seed(0)
    config = getattr(transformers, kind["config_class"])(**kind["hf"])
    model = getattr(transformers, kind["model_class"])._from_config(config, attn_implementation="eager",
                                                                    dtype=torch.float32)
    with torch.no_grad():  # norms away from 1, so that a mistake in any of them shows
        for pname, p in model.named_parameters():
            if p.dim() == 1:
                p.mul_(1 + 0.2 * torch.randn_like(p))
            if pname.endswith("mlp.gate.weight"):
                p.mul_(kind.get("router_scale", 1.0))
    T, G, V = kind["model"]["context_length"], TRAIN["global_batch_size"], kind["model"]["vocab_size"]
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, V, size=G * TRAIN["max_steps"] * T + 1)
    batches = [np.stack([tokens[i * T:i * T + T + 1] for i in range(k * G, (k + 1) * G)]).astype(np.int64)
               for k in range(TRAIN["max_steps"])]
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = os.path.join(tmp, "hf")
        model.save_pretrained(hf_dir)
        initial = load_file(os.path.join(hf_dir, "model.safetensors"))
        write_shard(os.path.join(tmp, "train.bin"), tokens)
        cfg = {"model": dict(kind["model"], init_from=hf_dir),
               "data": {"train": os.path.join(tmp, "train.bin"), "shuffle": False},
               "train": dict(TRAIN, grad_clip=kind.get("grad_clip", TRAIN["grad_clip"])), "optim": OPTIM, "checkpoint": {"every": TRAIN["max_steps"]}}
        cfg_path = os.path.join(tmp, "config.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        run_dir = os.path.join(tmp, "run")
        run("train", "--config", cfg_path, "--run-dir", run_dir, "--device", "cpu")
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            metrics = [m for m in map(json.loads, f) if "loss" in m]
        if "router_scale" in kind:  # the same weights in transformers' fused in-memory form
            fused_dir = os.path.join(tmp, "fused")
            os.makedirs(fused_dir)
            save_file(fused_experts(initial, kind["hf"]["num_hidden_layers"], kind["model"]["moe"]["experts"]),
                      os.path.join(fused_dir, "model.safetensors"), metadata={"format": "pt"})
            with open(os.path.join(fused_dir, "config.json"), "w") as f:
                json.dump(json.load(open(os.path.join(hf_dir, "config.json"))), f)
            fused_cfg = os.path.join(tmp, "fused_config.json")
            with open(fused_cfg, "w") as f:
                json.dump(dict(cfg, model=dict(kind["model"], init_from=fused_dir)), f)
            run("train", "--config", fused_cfg, "--run-dir", os.path.join(tmp, "fused_run"), "--device", "cpu")
            with open(os.path.join(tmp, "fused_run", "metrics.jsonl")) as f:
                fused_losses = [m["loss"] for m in map(json.loads, f) if "loss" in m]
            check(fused_losses == [m["loss"] for m in metrics],
                  f"{name}: init_from the fused experts.gate_up_proj/down_proj form trains to the same losses, "
                  "bit for bit")
        export_dir = os.path.join(tmp, "export")
        run("export", "--checkpoint", os.path.join(run_dir, "checkpoints"), "--output", export_dir, "--format", "hf")
        final = load_file(os.path.join(export_dir, "model.safetensors"))

        AUX_LOSSES.clear()
        SPREADS.clear()
        want_losses, want_norms = torch_training(model, batches, kind)
        trained_dir = os.path.join(tmp, "trained")  # transformers' own file layout of the trained model
        model.save_pretrained(trained_dir)
        trained = load_file(os.path.join(trained_dir, "model.safetensors"))
        if "router_scale" in kind:
            got_aux = [m["aux_loss"] for m in metrics]
            check(len(got_aux) == len(AUX_LOSSES), f"{name}: aux_loss logged at {len(got_aux)} steps")
            for step, (got, want) in enumerate(zip(got_aux, AUX_LOSSES), start=1):
                rel = abs(got - want) / abs(want)
                check(rel < 1e-4, f"{name}: step {step} aux_loss {got:.6f} vs PyTorch's {want:.6f}: relative "
                                  f"difference {rel:.2e} (< 1e-4)")
            check(SPREADS[0] > 2.0, f"{name}: the first router's logits spread {SPREADS[0]:.2f} on average over "
                                    "tokens (> 2: routing is decided)")
        got_losses = [m["loss"] for m in metrics]
        check(len(got_losses) == len(want_losses), f"{name}: {len(got_losses)} logged steps")
        for step, (got, want) in enumerate(zip(got_losses, want_losses), start=1):
            rel = abs(got - want) / abs(want)
            check(rel < 1e-4, f"{name}: step {step} loss {got:.6f} vs PyTorch's {want:.6f}: relative difference "
                              f"{rel:.2e} (< 1e-4)")
        clipped = sum(n > kind.get("grad_clip", TRAIN["grad_clip"]) for n in want_norms)
        check(clipped > 0, f"{name}: the clipping acted at {clipped} of {len(want_norms)} steps "
                           f"(grad norms {', '.join(f'{n:.3f}' for n in want_norms)})")
        got_norms = [m["grad_norm"] for m in metrics]
        worst_norm = max(abs(g - w) / w for g, w in zip(got_norms, want_norms))
        check(worst_norm < 1e-3, f"{name}: grad norms equal PyTorch's within {worst_norm:.2e} relative (< 1e-3)")

        check(set(final) == set(initial), f"{name}: the export holds the {len(initial)} tensors transformers saved")
        worst, worst_name = 0.0, ""
        for tname in sorted(initial):
            want_update = trained[tname].astype(np.float64) - initial[tname]
            got_update = final[tname].astype(np.float64) - initial[tname]
            scale = np.linalg.norm(want_update)
            rel = np.linalg.norm(got_update - want_update) / scale if scale > 0 else np.linalg.norm(got_update)
            if rel > worst:
                worst, worst_name = rel, tname
        check(worst < 2e-3, f"{name}: every weight update equals PyTorch's within {worst:.2e} relative "
                            f"(< 2e-3; largest at {worst_name})")
        moved = min(np.linalg.norm(trained[t] - initial[t]) / max(np.linalg.norm(initial[t]), 1e-12)
                    for t in initial if t.endswith("norm.weight"))
        check(moved > 1e-4, f"{name}: every norm weight moved (at least {moved:.2e} relative)")

        loaded = getattr(transformers, kind["model_class"]).from_pretrained(export_dir, dtype=torch.float32,
                                                                            attn_implementation="eager")
        check(type(loaded).__name__ == kind["model_class"], f"{name}: transformers loads the export as "
                                                             f"{type(loaded).__name__}")
        inputs = torch.tensor(batches[0][:, :-1])
        with torch.no_grad():
            a, b = loaded(input_ids=inputs).logits, model(input_ids=inputs).logits
        diff = float((a - b).abs().max() / b.abs().max())
        check(diff < 1e-3, f"{name}: the export's logits equal the PyTorch-trained model's within {diff:.2e} "
                           "of the largest (< 1e-3)")


print(f"transformers {transformers.__version__}, torch {torch.__version__}")
for kind_name in sys.argv[2:] or MODEL_KINDS:
    compare(kind_name, MODEL_KINDS[kind_name])
if failures:
    sys.exit(f"{len(failures)} check(s) failed")
print("all checks passed")
