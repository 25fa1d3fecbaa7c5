#!/usr/bin/python3
"""Muon (src/optim/muon.cpp) against independent references, on the inputs and results that
test_muon's hidden case "[.muon_dump]" writes (random matrices; four updates of a tiny GPT-2's and
a tiny Llama's parameters on random gradients, clipped and not, the learning rate changing):

  numpy: Newton-Schulz in float64 NumPy on every matrix (fp32 results within 2e-5 of the largest
         entry; the bf16 case within bf16's precision), and the four updates of every parameter
         by a float64 NumPy implementation of torch.optim.Muon's algorithm (torch/optim/_muon.py:
         buf.lerp_(g, 1 - mu); u = g.lerp(buf, mu) or buf; Newton-Schulz; param.mul_(1 - lr wd);
         param.add_(O, alpha=-adjusted lr)) for the hidden matrices and of torch.optim.AdamW's
         for the rest: weights and momentum within 1e-6.
  torch: the same four updates by torch.optim.Muon and torch.optim.AdamW themselves (PyTorch >= 2.9;
         torch.optim.Muon orthogonalises in bf16: its Newton-Schulz is patched to float32 here, as
         llmtrain's fp32 runs compute it, and the weights agree within 1e-4 of the update's size). SKIPPED where torch is missing or older; install
         one with scripts/setup.sh --with-torch-muon (a virtual environment .venv-torch, which this
         script then uses).

Usage: muon_reference_test.py TEST_MUON_BINARY numpy|torch
"""
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BINARY, MODE = sys.argv[1], sys.argv[2]
failures = []


def check(ok, what):
    print(("ok: " if ok else "FAILED: ") + what, flush=True)
    if not ok:
        failures.append(what)


if MODE == "torch":
    venv_python = os.path.join(ROOT, ".venv-torch", "bin", "python")
    if os.path.exists(venv_python) and os.path.realpath(sys.executable) != os.path.realpath(venv_python) \
            and not os.environ.get("LLMTRAIN_MUON_REEXEC"):
        os.environ["LLMTRAIN_MUON_REEXEC"] = "1"
        os.execv(venv_python, [venv_python, *sys.argv])
    try:
        import torch
    except ImportError as e:
        print(f"SKIPPED: torch.optim.Muon needs PyTorch >= 2.9 ({e}); install it with scripts/setup.sh --with-torch-muon")
        sys.exit(0)
    if not hasattr(torch.optim, "Muon"):
        print(f"SKIPPED: torch {torch.__version__} has no torch.optim.Muon (PyTorch >= 2.9); "
              "install one with scripts/setup.sh --with-torch-muon")
        sys.exit(0)

import numpy as np  # noqa: E402  (after the re-exec, so that the venv's NumPy is the one used)


def dump():
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "muon.json")
        env = dict(os.environ, LLMTRAIN_MUON_DUMP=path, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
        r = subprocess.run([BINARY, "[.muon_dump]"], env=env, capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"FAILED: {BINARY} [.muon_dump]: exit {r.returncode}\n{r.stdout}\n{r.stderr}")
        with open(path) as f:
            return json.load(f)


def newton_schulz(u, steps, coefficients, eps):
    """torch.optim.Muon's _zeropower_via_newtonschulz, in float64."""
    a, b, c = coefficients
    x = np.array(u, dtype=np.float64)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / max(np.linalg.norm(x), eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def adjusted_lr(lr, how, rows, cols):
    if how == "original":
        return lr * np.sqrt(max(1.0, rows / cols))
    return lr * 0.2 * np.sqrt(max(rows, cols))


def clip_scale(step):
    return step["grad_clip"] / (step["grad_norm"] + 1e-6) if 0 < step["grad_clip"] < step["grad_norm"] else 1.0


def numpy_run(run):
    """The four updates by NumPy (float64): Muon on the matrices, AdamW on the rest."""
    o = run["optim"]
    mo = o["muon"]
    muon_lr, muon_wd = mo.get("lr", o["lr"]), mo.get("weight_decay", o["weight_decay"])
    w = np.array(run["initial"], dtype=np.float64)
    in_matrix = np.zeros(len(w), dtype=bool)
    for mat in run["matrices"]:
        in_matrix[mat["offset"]:mat["offset"] + mat["rows"] * mat["cols"]] = True
    decay = np.zeros(len(w), dtype=bool)
    for p in run["params"]:
        decay[p["offset"]:p["offset"] + int(np.prod(p["shape"]))] = p["decay"]
    buf = np.zeros(len(w))
    m = np.zeros(len(w))
    v = np.zeros(len(w))
    out = []
    for t, step in enumerate(run["steps"], start=1):
        g = np.array(step["grad"], dtype=np.float64) * clip_scale(step)
        lr = step["lr"]
        new = w.copy()
        # AdamW (torch.optim.AdamW, weight decay on the 2-D parameters only) outside the matrices.
        a = ~in_matrix
        m[a] = o["beta1"] * m[a] + (1 - o["beta1"]) * g[a]
        v[a] = o["beta2"] * v[a] + (1 - o["beta2"]) * g[a] ** 2
        wd = np.where(decay[a], o["weight_decay"], 0.0)
        new[a] = w[a] * (1 - lr * wd) - lr * (m[a] / (1 - o["beta1"] ** t)) / (
            np.sqrt(v[a] / (1 - o["beta2"] ** t)) + o["eps"])
        # Muon, its lr scaled by the schedule as optim.lr is.
        lr_muon = muon_lr * lr / o["lr"]
        mu = mo["momentum"]
        for mat in run["matrices"]:
            s = slice(mat["offset"], mat["offset"] + mat["rows"] * mat["cols"])
            buf[s] = buf[s] + (1 - mu) * (g[s] - buf[s])
            u = g[s] + mu * (buf[s] - g[s]) if mo["nesterov"] else buf[s]
            ortho = newton_schulz(u.reshape(mat["rows"], mat["cols"]), mo["ns_steps"], mo["ns_coefficients"], mo["eps"])
            new[s] = w[s] * (1 - lr_muon * muon_wd) - adjusted_lr(lr_muon, mo["adjust_lr"], mat["rows"], mat["cols"]) * ortho.ravel()
        w = new
        out.append(w.copy())
    return out, buf


def newton_schulz_fp32(grad, ns_coefficients, ns_steps, eps):
    """torch.optim.Muon's _zeropower_via_newtonschulz step for step, in float32 instead of bfloat16
    (the comparison's patch: llmtrain's fp32 runs orthogonalise in fp32)."""
    a, b, c = ns_coefficients
    x = grad.to(dtype=torch.float32, copy=True)
    if grad.size(0) > grad.size(1):
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if grad.size(0) > grad.size(1) else x


def torch_run(run):
    """The four updates by torch.optim.Muon (each matrix a parameter of its own, GPT-2's c_attn
    blocks apart; its Newton-Schulz patched to float32) and torch.optim.AdamW (decay and no-decay
    groups), in float32."""
    import torch.optim._muon as torch_muon
    torch_muon._zeropower_via_newtonschulz = newton_schulz_fp32
    o = run["optim"]
    mo = o["muon"]
    muon_lr, muon_wd = mo.get("lr", o["lr"]), mo.get("weight_decay", o["weight_decay"])
    initial = torch.tensor(run["initial"], dtype=torch.float32)
    matrices = [(mat["offset"], mat["rows"], mat["cols"]) for mat in run["matrices"]]
    taken = torch.zeros(len(initial), dtype=torch.bool)
    for off, r, c in matrices:
        taken[off:off + r * c] = True
    muon_params = [torch.nn.Parameter(initial[off:off + r * c].reshape(r, c).clone()) for off, r, c in matrices]
    others = []  # (offset of each element, parameter) for the AdamW runs
    decay_params, plain_params = [], []
    for p in run["params"]:
        n = int(np.prod(p["shape"]))
        idx = torch.arange(p["offset"], p["offset"] + n)
        idx = idx[~taken[idx]]
        if len(idx) == 0:
            continue
        param = torch.nn.Parameter(initial[idx].clone())
        others.append((idx, param))
        (decay_params if p["decay"] else plain_params).append(param)
    muon = torch.optim.Muon(muon_params, lr=muon_lr, weight_decay=muon_wd, momentum=mo["momentum"],
                            nesterov=mo["nesterov"], ns_coefficients=tuple(mo["ns_coefficients"]), eps=mo["eps"],
                            ns_steps=mo["ns_steps"], adjust_lr_fn=mo["adjust_lr"])
    adamw = torch.optim.AdamW([{"params": decay_params, "weight_decay": o["weight_decay"]},
                               {"params": plain_params, "weight_decay": 0.0}],
                              lr=o["lr"], betas=(o["beta1"], o["beta2"]), eps=o["eps"])
    out = []
    for step in run["steps"]:
        g = torch.tensor(step["grad"], dtype=torch.float32) * clip_scale(step)
        for (off, r, c), param in zip(matrices, muon_params):
            param.grad = g[off:off + r * c].reshape(r, c).clone()
        for idx, param in others:
            param.grad = g[idx].clone()
        for group in muon.param_groups:
            group["lr"] = muon_lr * step["lr"] / o["lr"]
        for group in adamw.param_groups:
            group["lr"] = step["lr"]
        muon.step()
        adamw.step()
        w = initial.clone()
        for (off, r, c), param in zip(matrices, muon_params):
            w[off:off + r * c] = param.detach().reshape(-1)
        for idx, param in others:
            w[idx] = param.detach()
        out.append(w.double().numpy())
    return out


data = dump()
if MODE == "numpy":
    for case in data["newton_schulz"]:
        r, c = case["rows"], case["cols"]
        want = newton_schulz(np.array(case["u"]).reshape(r, c), case["steps"], case["coefficients"], case["eps"])
        got = np.array(case["o"], dtype=np.float64).reshape(r, c)  # a NaN or inf was written as null: nan
        err = np.abs(got - want).max() / np.abs(want).max()
        tol = 3e-2 if case["bf16"] else 2e-5
        check(err < tol and np.abs(got).max() > 0.1,
              f"Newton-Schulz {r}x{c}{' in bf16' if case['bf16'] else ''}: error {err:.2e} of the largest entry (< {tol:g})")
    # Sabotage guard: the reference must tell apart a wrong step count.
    case = data["newton_schulz"][2]
    wrong = newton_schulz(np.array(case["u"]).reshape(16, 16), case["steps"] - 1, case["coefficients"], case["eps"])
    check(np.abs(np.array(case["o"], dtype=np.float64).reshape(16, 16) - wrong).max() > 1e-3, "one step fewer gives a different matrix")

for run in data["runs"]:
    arch = "gpt2" if run["params"][0]["name"].startswith("transformer.") else "llama"
    got = [np.array(s["weights"], dtype=np.float64) for s in run["steps"]]
    moved = np.abs(got[-1] - np.array(run["initial"])).max()
    if MODE == "numpy":
        want, buf = numpy_run(run)
        for t, (g_, w_) in enumerate(zip(got, want), start=1):
            err = np.abs(g_ - w_).max()
            check(err < 1e-6, f"{arch}: weights after update {t} within {err:.2e} of NumPy's (< 1e-6)")
        err = np.abs(np.array(run["momentum"], dtype=np.float64) - buf).max()
        check(err < 1e-6, f"{arch}: muon.momentum within {err:.2e} of NumPy's (< 1e-6)")
    else:
        want = torch_run(run)
        for t, (g_, w_) in enumerate(zip(got, want), start=1):
            err = np.abs(g_ - w_).max()
            check(err < 1e-4 * moved, f"{arch}: weights after update {t} within {err:.2e} of torch.optim.Muon's "
                                      f"(< 1e-4 x the largest change, {moved:.2e})")
    check(moved > 1e-3, f"{arch}: the updates moved the weights ({moved:.2e})")

if failures:
    sys.exit(f"{len(failures)} check(s) failed")
print("all checks passed")
