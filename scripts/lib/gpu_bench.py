#!/usr/bin/env python3
"""Training benchmark helpers shared by scripts/gpu_check.sh and scripts/bench_vs_pytorch.py.

Standard library only (a GPU node may have nothing else). Subcommands:
  shard DIR [--tokens N] [--vocab V] [--seed S]      synthetic token shard DIR/train_000000.bin
  bench --binary B --config C [...] --out FILE.json  micro-batch search, timed run, top kernels
  report --bench FILE.json [--tests ...] [...]       the one table gpu_check.sh prints
  cuda-tests --build DIR [--tag T] --out FILE.json   runs every Catch2 test case tagged [cuda]
  self-test                                          checks the parsers and the table on made-up input
cuda-tests and suite exit 0 when everything passed, 1 when anything failed, and 3 (OUT_OF_TIME) when
nothing failed but something was skipped for time (a test binary stopped at the deadline or not
run, a training row, PyTorch or a profile left out).
Their deadlines and timeouts run on the real clock, or, under GPU_CHECK_FAKE_CLOCK (tests of the
deadline logic; see scripts/gpu_check.sh), on the clock that file holds: a child then gets its
deadline in GPU_CHECK_FAKE_DEADLINE and stops there itself with exit status 124 (timed out).

MFU = tokens/s x (6 N + 12 L H Q T) / peak, with N parameters, L layers, H heads of size Q and
context T (matmuls forward and backward, plus attention's scores and weighted sums), against the
device's dense peak for the precision that ran (bf16 tensor cores; for fp32 the plain fp32 peak,
since llmtrain's fp32 path does not use TF32).
"""
import argparse
import csv
import io
import json
import os
import re
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET

SHARD_MAGIC, SHARD_VERSION = 20240520, 1
# Exit status of cuda-tests and suite when nothing failed but something was skipped for time.
OUT_OF_TIME = 3

# Dense (no sparsity) peaks of one device in TFLOP/s, from NVIDIA's datasheets: bf16 tensor
# cores, TF32 tensor cores, fp32 CUDA cores. First matching name wins (most specific first).
PEAKS = [
    ("H200", {"bf16": 989.0, "tf32": 494.5, "fp32": 67.0}),
    ("GH200", {"bf16": 989.0, "tf32": 494.5, "fp32": 67.0}),
    ("H100 PCIe", {"bf16": 756.0, "tf32": 378.0, "fp32": 51.0}),
    ("H100 NVL", {"bf16": 835.0, "tf32": 417.5, "fp32": 60.0}),
    ("H100", {"bf16": 989.0, "tf32": 494.5, "fp32": 67.0}),  # SXM
    ("H800", {"bf16": 989.0, "tf32": 494.5, "fp32": 67.0}),
    ("A100", {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("A800", {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.0, "tf32": 183.0, "fp32": 91.6}),
    ("A10", {"bf16": 125.0, "tf32": 62.5, "fp32": 31.2}),
]

# Under GPU_CHECK_FAKE_CLOCK a child is waited for without its timeout; this guards against a hung one.
FAKE_CLOCK_HANG_GUARD_S = 300


def now():
    """Seconds since the epoch: the real clock's, or the file's that GPU_CHECK_FAKE_CLOCK names
    (microseconds, moved on only by the stubs of the tests of the deadline logic)."""
    clock = os.environ.get("GPU_CHECK_FAKE_CLOCK")
    if not clock:
        return time.time()
    with open(clock) as f:
        return int(f.read()) / 1e6


def capped_env(timeout_s, env=None):
    """The environment of a child capped at `timeout_s` seconds: `env` as it is, and under the fake
    clock its deadline besides, in GPU_CHECK_FAKE_DEADLINE (the clock's microseconds)."""
    if not os.environ.get("GPU_CHECK_FAKE_CLOCK"):
        return env
    env = dict(os.environ if env is None else env)
    env["GPU_CHECK_FAKE_DEADLINE"] = str(int(round((now() + timeout_s) * 1e6)))
    return env


def wait_capped(proc, timeout_s, kill=None):
    """Exit code of `proc`, or None when it ran past `timeout_s` (then `kill(proc)`, by default
    proc.kill(), and a wait). Under the fake clock the child keeps to its deadline (capped_env)
    itself: exit status 124 there means it ran past it, as from timeout(1)."""
    fake = bool(os.environ.get("GPU_CHECK_FAKE_CLOCK"))
    try:
        code = proc.wait(timeout=FAKE_CLOCK_HANG_GUARD_S if fake else timeout_s)
    except subprocess.TimeoutExpired:
        (kill or (lambda p: p.kill()))(proc)
        proc.wait()
        return None
    return None if fake and code == 124 else code


# llmtrain's start-up error for a model.attention "cudnn" that cuDNN refuses or cannot run here.
REFUSED_PATTERN = re.compile(r'model\.attention: "cudnn"(: cuDNN \S+ refuses | cannot run here)')
OOM_PATTERN = re.compile(r"out of memory|CUDA_ERROR_OUT_OF_MEMORY|cudaErrorMemoryAllocation|OutOfMemory", re.I)


def peak_tflops(gpu_name, precision, override=None):
    """(TFLOP/s, what it is) for `precision` ("bf16" or "fp32") on the named GPU; (None, why) if unknown."""
    if override:
        return float(override), f"{float(override):g} TFLOP/s (PEAK_TFLOPS, given)"
    for key, peaks in PEAKS:
        if key in gpu_name and not (key == "A10" and "A100" in gpu_name):
            if precision == "bf16":
                return peaks["bf16"], f"{peaks['bf16']:g} TFLOP/s ({key} bf16 dense peak)"
            return peaks["fp32"], (f"{peaks['fp32']:g} TFLOP/s ({key} fp32 peak without TF32, as llmtrain's fp32 "
                                    f"path runs; TF32 would be {peaks['tf32']:g})")
    return None, f"unknown peak for '{gpu_name}': set PEAK_TFLOPS"


def model_dims(config):
    """Resolved GPT-2 dimensions of a config dict (defaults as llmtrain's: ffn_hidden 0 -> 4 C)."""
    m = config["model"]
    C = int(m["d_model"])
    return {"V": int(m["vocab_size"]), "T": int(m["context_length"]), "L": int(m["n_layer"]),
            "H": int(m["n_head"]), "C": C, "F": int(m.get("ffn_hidden") or 4 * C)}


def gpt2_parameters(d):
    """Parameters of a GPT-2 (tied embeddings), as llmtrain's parameter_count."""
    C, F = d["C"], d["F"]
    per_layer = 4 * C + 3 * C * C + 3 * C + C * C + C + F * C + F + C * F + C
    return d["V"] * C + d["T"] * C + d["L"] * per_layer + 2 * C


def flops_per_token(d, n_params):
    Q = d["C"] / d["H"]
    return 6.0 * n_params + 12.0 * d["L"] * d["H"] * Q * d["T"]


def write_shard(path, n_tokens, vocab, seed=1):
    """A shard in llm.c's format (256 int32 header, uint16 tokens) of pseudo-random tokens < vocab."""
    if vocab > 65536:
        raise ValueError("uint16 shards hold vocabularies up to 65,536 tokens")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    header = [0] * 256
    header[:3] = [SHARD_MAGIC, SHARD_VERSION, n_tokens]
    state = (seed * 6364136223846793005 + 1442695040888963407) & (2**64 - 1)
    tokens = bytearray(2 * n_tokens)
    for i in range(n_tokens):  # a 64-bit LCG: the same tokens everywhere for the same seed
        state = (state * 6364136223846793005 + 1442695040888963407) & (2**64 - 1)
        struct.pack_into("<H", tokens, 2 * i, (state >> 33) % vocab)
    with open(path + ".part", "wb") as f:  # renamed when whole: a stopped writer leaves no shard
        f.write(struct.pack("<256i", *header))
        f.write(tokens)
    os.replace(path + ".part", path)
    return path


def deep_merge(base, over):
    out = dict(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class GpuMemorySampler:
    """Largest GPU memory nvidia-smi reports for one process, sampled in a thread."""

    def __init__(self, pid, period_s=0.2):
        self.pid, self.period_s, self.peak_mib = pid, period_s, None
        self._stop = threading.Event()
        self._thread = None
        if shutil.which("nvidia-smi"):
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=10).stdout
                for line in out.splitlines():
                    fields = [f.strip() for f in line.split(",")]
                    if len(fields) == 2 and fields[0] == str(self.pid) and fields[1].isdigit():
                        self.peak_mib = max(self.peak_mib or 0, int(fields[1]))
            except (OSError, subprocess.SubprocessError):
                pass
            self._stop.wait(self.period_s)

    def stop(self):
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=15)
        return self.peak_mib


def summarize_metrics(path, skip=None):
    """Median tokens/s after warm-up, the steps it covers, and the largest host RSS, from metrics.jsonl."""
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                row = json.loads(line)
                if "loss" in row and "tokens_per_s" in row:
                    rows.append(row)
    if not rows:
        return None
    if skip is None:
        skip = min(5, len(rows) // 3)  # warm-up: allocation, autotuning, first page faults
    timed = rows[skip:] or rows[-1:]
    peak_host = max((r.get("peak_memory_bytes") or 0) for r in rows)
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed), "steps": len(rows),
            "timed_steps": [timed[0]["step"], timed[-1]["step"]], "peak_host_bytes": peak_host,
            "final_loss": rows[-1]["loss"]}


def first_error_line(text):
    lines = [l for l in text.splitlines() if l.strip()]
    for l in lines:
        if "error" in l.lower():
            return l.strip()
    return lines[-1].strip() if lines else "(no output)"


def run_llmtrain(binary, config, workdir, device, steps, batch, precision, peak=None, profile_ops=False,
                 wrapper=None, timeout_s=600, env=None):
    """One `llmtrain train` run of `config` (a dict) with micro-batch = global batch = `batch`.
    Returns {"ok", "exit_code", "oom", "error", "metrics", "peak_gpu_mib", "stderr", "seconds"}."""
    run_dir = os.path.join(workdir, f"run-b{batch}-{int(time.time() * 1000) % 10**8}")
    cfg = deep_merge(config, {
        "train": {"micro_batch_size": batch, "global_batch_size": batch, "max_steps": steps, "log_every": 1,
                  "eval_every": 0, "precision": precision, **({"peak_tflops": peak} if peak else {})},
        "data": {"val": []},
        "checkpoint": {"every": 0, "keep_last": 1},
        # The learning rate does not change the speed; the warm-up must fit in the run.
        "optim": {"warmup_steps": min(int(config.get("optim", {}).get("warmup_steps", 0)), steps)},
    })
    cfg_path = os.path.join(workdir, f"bench-b{batch}.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=1)
    cmd = list(wrapper or []) + [binary, "train", "--config", cfg_path, "--run-dir", run_dir, "--device", device,
                                 "--resume", "never"]
    if profile_ops:
        cmd.append("--profile-ops")
    start = now()
    err_path = os.path.join(workdir, f"train-b{batch}.err")
    with open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=capped_env(timeout_s, env))
        sampler = GpuMemorySampler(proc.pid)
        code = wait_capped(proc, timeout_s)
        peak_gpu = sampler.stop()
    with open(err_path, errors="replace") as f:
        stderr = f.read()
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    metrics = summarize_metrics(metrics_path) if os.path.exists(metrics_path) else None
    result = {"ok": code == 0 and metrics is not None, "exit_code": code, "oom": bool(OOM_PATTERN.search(stderr)),
              "metrics": metrics, "peak_gpu_mib": peak_gpu, "stderr": stderr, "seconds": now() - start,
              "command": " ".join(cmd), "run_dir": run_dir}
    if code is None:
        result["error"] = f"timed out after {timeout_s} s"
    elif not result["ok"]:
        result["error"] = first_error_line(stderr) if code != 0 else "no metrics.jsonl written"
    shutil.rmtree(os.path.join(run_dir, "checkpoints"), ignore_errors=True)  # GPT-2 124M: 1.5 GB each
    return result


def search_batch(binary, config, workdir, device, precision, candidates, probe_steps, timeout_s, peak=None):
    """Largest candidate micro-batch whose short run succeeds; stops at the first failure that is
    not out-of-memory. Returns (batch or None, [attempt summaries], last failed result or None)."""
    attempts, last = [], None
    for b in candidates:
        r = run_llmtrain(binary, config, workdir, device, probe_steps, b, precision, peak=peak, timeout_s=timeout_s)
        attempts.append({"batch": b, "ok": r["ok"], "oom": r["oom"], "error": r.get("error"), "seconds": round(r["seconds"], 1)})
        if r["ok"]:
            return b, attempts, None
        last = r
        if not r["oom"]:
            break
    return None, attempts, last


def parse_nsys_kernel_csv(text, top=10):
    """Top kernels from `nsys stats --report cuda_gpu_kern_sum --format csv` (or the older gpukernsum)."""
    lines = text.splitlines()
    start = next((i for i, l in enumerate(lines) if "Name" in l and ("Time" in l or "Total" in l)), None)
    if start is None:
        return []
    rows = list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))

    def field(row, *names):
        for n in names:
            for k, v in row.items():
                if k and k.strip().lower() == n.lower():
                    return v
        return None

    kernels = []
    for row in rows:
        name, total = field(row, "Name"), field(row, "Total Time (ns)", "Total Time")
        if not name or total is None:
            continue
        try:
            kernels.append({"name": name, "total_ms": float(total.replace(",", "")) / 1e6,
                            "calls": int(float((field(row, "Instances", "Count", "Calls") or "0").replace(",", ""))),
                            "percent": float((field(row, "Time (%)", "Time(%)") or "nan").replace(",", ""))})
        except ValueError:
            continue
    kernels.sort(key=lambda k: -k["total_ms"])
    return kernels[:top]


def parse_profile_ops(stderr, top=10):
    """Top ops from llmtrain's --profile-ops lines: `  name  N calls  S s  P%`."""
    ops = []
    for line in stderr.splitlines():
        m = re.search(r"^\s*(?:\[[^]]*\]\s*)?(\S+)\s+(\d+) calls\s+([\d.]+) s\s+([\d.]+)%\s*$", line)
        if m:
            ops.append({"name": m.group(1), "calls": int(m.group(2)), "total_ms": float(m.group(3)) * 1e3,
                        "percent": float(m.group(4))})
    ops.sort(key=lambda k: -k["total_ms"])
    return ops[:top]


def find_nsys():
    found = shutil.which("nsys")
    if found:
        return found
    for root in [os.environ.get("CUDA_HOME", "/usr/local/cuda"), "/opt/nvidia/nsight-systems"]:
        for dirpath, _, files in os.walk(root):
            if "nsys" in files and dirpath.endswith("bin") and dirpath.count(os.sep) - root.count(os.sep) < 4:
                return os.path.join(dirpath, "nsys")
    return None


def top_kernels(binary, config, workdir, device, batch, precision, steps, timeout_s):
    """The 10 most expensive kernels of a short run (nsys), else llmtrain's own op times."""
    nsys = find_nsys() if device == "cuda" else None
    nsys_failure = ""
    if nsys:
        out = os.path.join(workdir, "profile")
        r = run_llmtrain(binary, config, workdir, device, steps, batch, precision, timeout_s=timeout_s,
                         wrapper=[nsys, "profile", "--trace=cuda,nvtx", "--sample=none", "--cpuctxsw=none",
                                  "--force-overwrite=true", "-o", out])
        if r["ok"]:
            for report in ["cuda_gpu_kern_sum", "gpukernsum"]:
                p = subprocess.run([nsys, "stats", "--report", report, "--format", "csv", "--output", "-",
                                    out + ".nsys-rep"], capture_output=True, text=True)
                kernels = parse_nsys_kernel_csv(p.stdout)
                if kernels:
                    return {"source": f"nsys, {steps} steps", "kernels": kernels}
            nsys_failure = "nsys stats gave no kernel summary"
        else:
            nsys_failure = r.get("error") or "failed"
        nsys_failure = f"; nsys ({nsys}) failed: {nsys_failure}"  # then llmtrain's own op times
    r = run_llmtrain(binary, config, workdir, device, steps, batch, precision, profile_ops=True, timeout_s=timeout_s)
    if not r["ok"]:
        return {"source": "llmtrain --profile-ops", "error": r.get("error"), "kernels": []}
    return {"source": f"llmtrain --profile-ops, {steps} steps (ops by wall-clock, not kernels{nsys_failure or '; no nsys'})",
            "kernels": parse_profile_ops(r["stderr"])}


def parse_catch_xml(text):
    """Test cases of a Catch2 XML report (v2 or v3): [(name, "passed" | "failed" | "skipped")].
    Skipped: a v3 skip, or the "SKIPPED:" warning that LLMTRAIN_SKIP leaves under v2."""
    cases = []
    for tc in ET.fromstring(text).iter("TestCase"):
        result = tc.find("OverallResult")
        ok = result is not None and result.get("success") == "true"
        skipped = (result is not None and int(result.get("skips", "0") or 0) > 0) or tc.find(".//Skip") is not None or any(
            (w.text or "").strip().startswith("SKIPPED:") for w in tc.iter("Warning"))
        cases.append((tc.get("name"), "failed" if not ok else "skipped" if skipped else "passed"))
    return cases


def completed_cases_xml(text):
    """The test cases a Catch2 XML report had finished when its binary was stopped (the file ends
    mid-case): the complete TestCase elements, as a report of their own; None when there is none."""
    done = re.findall(r"<TestCase\b.*?</TestCase>", text, re.S)
    return "<Catch>" + "".join(done) + "</Catch>" if done else None


def run_in_group(cmd, timeout_s, cwd):
    """Exit code of `cmd`, or None when it ran past `timeout_s`: then it and every process it
    started (llmtrain runs of the CLI tests) are killed, as a process group."""
    def kill_group(proc):
        try:
            os.killpg(proc.pid, 9)
        except OSError:
            pass

    with open(os.devnull, "w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=sink, cwd=cwd, start_new_session=True,
                                env=capped_env(timeout_s))
        return wait_capped(proc, timeout_s, kill_group)


def skip_reasons(text):
    """{test case: why it skipped} of a Catch2 XML report: the v3 Skip's text, or LLMTRAIN_SKIP's "SKIPPED:" warning."""
    reasons = {}
    for tc in ET.fromstring(text).iter("TestCase"):
        for node in list(tc.iter("Skip")) + [w for w in tc.iter("Warning") if (w.text or "").strip().startswith("SKIPPED:")]:
            why = " ".join((node.text or "").split())
            reasons[tc.get("name")] = why[len("SKIPPED:"):].strip() if why.startswith("SKIPPED:") else why
            break
    return reasons


def run_tagged_tests(build_dir, tag="[cuda]", timeout_s=900, deadline=None, scale=1.0, order=(), only_order=False,
                     allow_all_skipped=False):
    """Runs the test binaries of BUILD/tests with the Catch2 tag filter and counts their cases. Those
    named in `order` first, in that order (only those when `only_order`); with a `deadline` (epoch
    seconds) one budget across them all: each binary gets what is left of it, those it leaves no
    time for are not run, and one still running at the deadline is stopped there. Both are skipped
    for time (summary "stopped" and "not_run", "out_of_time" true), not failed: the cases a stopped
    binary had finished still count, a failed one among them included. A binary that runs past its
    own `timeout_s` before the deadline hangs: that is a failure. Budget seconds are real seconds
    times `scale`."""
    tests_dir = os.path.abspath(os.path.join(build_dir, "tests"))
    names = os.listdir(tests_dir) if os.path.isdir(tests_dir) else []
    binaries = sorted(os.path.join(tests_dir, f) for f in names
                      if f.startswith("test_") and "." not in f and os.access(os.path.join(tests_dir, f), os.X_OK)
                      and os.path.isfile(os.path.join(tests_dir, f)))
    if order:
        rank = {name: i for i, name in enumerate(order)}
        binaries = [b for b in binaries if not only_order or os.path.basename(b) in rank]
        binaries.sort(key=lambda b: rank.get(os.path.basename(b), len(rank)))
    summary = {"passed": 0, "failed": 0, "skipped": 0, "binaries": 0, "failures": [], "skips": [], "problems": [],
               "skip_reasons": {}, "not_run": [], "stopped": [], "seconds": {}}
    if not binaries:
        summary["problems"].append(f"no test binaries (test_*) in {tests_dir}: was the build made with BUILD_TESTING=ON?")
    for binary in binaries:
        name = os.path.basename(binary)
        timeout = timeout_s / scale
        if deadline is not None:
            left = (deadline - now()) * scale
            if left < 10:
                summary["not_run"].append(name)
                continue
            timeout = min(timeout, left / scale)
        xml_path = binary + ".cuda-tests.xml"
        if os.path.exists(xml_path):
            os.remove(xml_path)
        start = now()
        try:
            code = run_in_group([binary, tag, "--reporter", "xml", "--out", xml_path], timeout, tests_dir)
        except OSError as e:
            summary["problems"].append(f"{name}: cannot run: {e}")
            continue
        summary["seconds"][name] = round((now() - start) * scale, 1)
        at_deadline = code is None and deadline is not None and timeout < timeout_s / scale
        try:
            with open(xml_path, errors="replace") as f:
                text = f.read()
        except OSError:
            text = ""
        if at_deadline:
            summary["stopped"].append(f"{name} (stopped at its deadline after {timeout * scale:.0f} s)")
            text = completed_cases_xml(text)  # what it had finished before it was stopped
            if text is None:
                continue
        try:
            cases, reasons = parse_catch_xml(text), skip_reasons(text)
        except ET.ParseError as e:
            why = f"timed out after {timeout * scale:.0f} s" if code is None else f"exit code {code}, unreadable report ({e})"
            summary["failed"] += 1
            summary["failures"].append(f"{name}: crashed or hung ({why})")
            summary["binaries"] += 1
            continue
        if not cases:
            continue  # no test case with this tag
        summary["binaries"] += 1
        for case, outcome in cases:
            summary[outcome] += 1
            if outcome == "failed":
                summary["failures"].append(f"{name}: {case}")
            elif outcome == "skipped":
                summary["skips"].append(f"{name}: {case}" + (f": {reasons[case]}" if reasons.get(case) else ""))
                why = reasons.get(case) or "no reason given"
                summary["skip_reasons"][why] = summary["skip_reasons"].get(why, 0) + 1
        if code not in (0, None) and not any(o == "failed" for _, o in cases):
            summary["problems"].append(f"{name} exited {code} with no failed case")
    ran = len(binaries) - len(summary["not_run"]) - len(summary["stopped"])
    if ran and summary["binaries"] == 0:
        summary["problems"].append(f"no test case tagged {tag} in {ran} test binaries")
    out_of_time = summary["stopped"] + [f"{n} (not run)" for n in summary["not_run"]]
    summary["out_of_time"] = bool(out_of_time)
    if summary["skipped"] and not summary["passed"] and not summary["failed"] and not allow_all_skipped and not out_of_time:
        first = next(iter(summary["skip_reasons"]), "")
        summary["problems"].append(f"every {tag} case skipped ({summary['skipped']}), nothing was checked: {first}")
    if out_of_time:
        summary.setdefault("notes", []).append(f"skipped for time: {', '.join(out_of_time)}")
    summary["line"] = (f"{summary['passed']} passed, {summary['failed']} failed, {summary['skipped']} skipped "
                       f"({summary['binaries']} test binaries with {tag} cases"
                       + (f"; skipped for time: {', '.join(out_of_time)}" if out_of_time else "") + ")")
    return summary


def cmd_cuda_tests(a):
    order = [b for b in (a.binaries or "").split(",") if b]
    summary = run_tagged_tests(a.build, a.tag, a.timeout, deadline=a.deadline, scale=a.time_scale, order=order,
                               only_order=bool(order) and not a.and_the_rest, allow_all_skipped=a.allow_all_skipped)
    with open(a.out, "w") as f:
        json.dump(summary, f, indent=1)
    print(summary["line"])
    for line in summary["failures"]:
        print(f"  FAILED  {line}")
    for line in summary["skips"]:
        print(f"  skipped {line}")
    for line in summary.get("notes", []):
        print(f"  note    {line}")
    for line in summary["problems"]:
        print(f"  problem {line}")
    if summary["failed"] or summary["problems"]:
        return 1
    return OUT_OF_TIME if summary["out_of_time"] else 0


def cmd_shard(a):
    path = write_shard(os.path.join(a.dir, "train_000000.bin"), a.tokens, a.vocab, a.seed)
    print(path)


def cmd_bench(a):
    with open(a.config) as f:
        config = json.load(f)
    config = deep_merge(config, {"data": {"train": [os.path.join(a.data, "train_*.bin")]}})
    d = model_dims(config)
    precision = a.precision or config.get("train", {}).get("precision", "fp32")
    if a.device == "cpu":
        peak, peak_text = None, "none for CPUs"
    else:
        peak, peak_text = peak_tflops(a.gpu_name or "", precision, os.environ.get("PEAK_TFLOPS"))
    workdir = tempfile.mkdtemp(prefix="llmtrain-bench-", dir=a.workdir)
    candidates = [int(b) for b in a.batches.split(",")]
    result = {"gpu": a.gpu_name, "device": a.device, "precision": precision, "dims": d,
              "params": gpt2_parameters(d), "peak_tflops": peak, "peak_text": peak_text, "candidates": candidates}
    result["flops_per_token"] = flops_per_token(d, result["params"])
    batch, attempts, failure = search_batch(a.binary, config, workdir, a.device, precision, candidates,
                                            a.probe_steps, a.timeout, peak=peak)
    result["attempts"] = attempts
    if batch is None:
        result["error"] = (failure or {}).get("error", "no micro-batch ran")
        if failure and failure["oom"]:
            result["error"] = f"out of memory even at micro-batch {candidates[-1]}: {failure['error']}"
        result["command"] = (failure or {}).get("command")
    else:
        result["batch"] = batch
        main = run_llmtrain(a.binary, config, workdir, a.device, a.steps, batch, precision, peak=peak,
                            timeout_s=a.timeout)
        result["command"] = main["command"]
        if not main["ok"]:
            result["error"] = main.get("error")
        else:
            m = main["metrics"]
            result.update({"tokens_per_s": m["tokens_per_s"], "timed_steps": m["timed_steps"], "steps": m["steps"],
                           "peak_host_bytes": m["peak_host_bytes"], "peak_gpu_mib": main["peak_gpu_mib"],
                           "final_loss": m["final_loss"]})
            if peak:
                result["mfu"] = m["tokens_per_s"] * result["flops_per_token"] / (peak * 1e12)
            if a.profile_steps > 0:
                result["top"] = top_kernels(a.binary, config, workdir, a.device, batch, precision, a.profile_steps,
                                            a.timeout)
    if not a.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0 if "error" not in result else 1


def run_pytorch(python, batch, steps, precision, workdir, timeout_s):
    """scripts/bench_vs_pytorch.py on the GPU at `batch` (GPT-2 124M, T=1024): its JSON, or {"error", "oom"}."""
    out = os.path.join(workdir, f"pytorch-b{batch}.json")
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench_vs_pytorch.py")
    cmd = [python, script, "--device", "cuda", "--batch", str(batch), "--steps", str(steps), "--precision", precision,
           "--json", out]
    start = now()
    fake = bool(os.environ.get("GPU_CHECK_FAKE_CLOCK"))
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=FAKE_CLOCK_HANG_GUARD_S if fake else timeout_s,
                           env=capped_env(timeout_s))
        text, code = p.stdout + p.stderr, p.returncode
        if fake and code == 124:  # stopped at its deadline on the fake clock (wait_capped)
            code = None
    except subprocess.TimeoutExpired as e:
        text, code = ((e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")), None
    result = {}
    if os.path.exists(out):
        with open(out) as f:
            result = json.load(f)
    result.update({"command": " ".join(cmd), "seconds": now() - start, "log_tail": text[-3000:]})
    if code is None:
        result["error"] = f"timed out after {timeout_s:.0f} s"
    elif code != 0 and "error" not in result:
        result["error"] = first_error_line(text)
    result["oom"] = bool(result.get("oom")) or bool(OOM_PATTERN.search(text)) and code != 0
    return result


def cmd_suite(a):
    """llmtrain with each attention path at the largest micro-batch that fits, PyTorch on the same
    shapes, then the top kernels; every stage only if the time left (--deadline) allows it."""
    with open(a.config) as f:
        config = json.load(f)
    config = deep_merge(config, {"data": {"train": [os.path.join(a.data, "train_*.bin")]}})
    d = model_dims(config)
    precision = a.precision
    peak, peak_text = peak_tflops(a.gpu_name or "", precision, os.environ.get("PEAK_TFLOPS"))
    deadline = a.deadline or now() + 3600
    workdir = tempfile.mkdtemp(prefix="llmtrain-suite-", dir=a.workdir)
    candidates = [int(b) for b in a.batches.split(",")]
    res = {"gpu": a.gpu_name, "precision": precision, "dims": d, "params": gpt2_parameters(d), "peak_tflops": peak,
           "peak_text": peak_text, "candidates": candidates, "rows": [], "skipped": [], "failures": []}
    res["flops_per_token"] = flops_per_token(d, res["params"])
    # Budget seconds (real seconds times --time-scale), until one was timed.
    scale = a.time_scale
    estimate = {"llmtrain": float(a.row_estimate), "pytorch": 150.0, "profile": 45.0}

    def left():
        return (deadline - now()) * scale

    def save():
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)

    def fits(kind, what):
        if left() >= estimate[kind]:
            return True
        res["skipped"].append(f"{what}: skipped, {max(0, left()):.0f} s left of the budget and it takes about "
                              f"{estimate[kind]:.0f} s")
        return False

    largest = None  # the largest micro-batch that ran: no other path needs to try more
    for path in a.attention.split(","):
        row = {"name": f"llmtrain, {path} attention", "kind": "llmtrain", "attention": path, "attempts": []}
        res["rows"].append(row)
        cfg = deep_merge(config, {"model": {"attention": path}})
        for b in [b for b in candidates if largest is None or b <= largest]:
            if not fits("llmtrain", f"{row['name']}, micro-batch {b}"):
                row["error"] = "not run: out of time"
                break
            r = run_llmtrain(a.binary, cfg, workdir, "cuda", a.steps, b, precision, peak=peak,
                             timeout_s=max(10, min(a.timeout, left())) / scale)
            if r["ok"]:
                estimate["llmtrain"] = r["seconds"] * scale
            row["attempts"].append({"batch": b, "ok": r["ok"], "oom": r["oom"], "error": r.get("error"),
                                    "seconds": round(r["seconds"], 1)})
            row["command"] = r["command"]
            if r["ok"]:
                m = r["metrics"]
                own = m.get("peak_host_bytes") or 0  # on CUDA, llmtrain's own figure is the GPU's peak
                row.update({"batch": b, "tokens_per_s": m["tokens_per_s"], "timed_steps": m["timed_steps"],
                            "final_loss": m["final_loss"], "seconds": round(r["seconds"], 1),
                            "peak_gpu_mib": own / 2**20 if own else r["peak_gpu_mib"],
                            "peak_source": "llmtrain's own" if own else "nvidia-smi"})
                if peak:
                    row["mfu"] = m["tokens_per_s"] * res["flops_per_token"] / (peak * 1e12)
                largest = b if largest is None else min(largest, b)
                row.pop("error", None)
                break
            row["error"] = r.get("error") or "failed"
            if path == "cudnn" and REFUSED_PATTERN.search(r["stderr"]):
                # cuDNN refuses this shape (or cannot run here) and llmtrain said so at start-up: a row
                # that reports the refusal, not a failure of llmtrain.
                row["error"] = "skipped: " + first_error_line(r["stderr"])
                row["refused"] = True
                break
            if not r["oom"]:
                res["failures"].append({"what": row["name"], "error": row["error"], "command": r["command"],
                                        "log_tail": r["stderr"][-4000:]})
                break
        else:
            if "batch" not in row and row["attempts"]:
                row["error"] = f"out of memory even at micro-batch {row['attempts'][-1]['batch']}"
        save()

    if a.pytorch:
        row = {"name": "PyTorch (bf16 autocast, SDPA, fused AdamW, torch.compile)" if precision == "bf16"
               else "PyTorch (fp32, SDPA, fused AdamW, torch.compile)", "kind": "pytorch", "attempts": []}
        res["rows"].append(row)
        b = largest or candidates[0]
        while b >= 1:
            if not fits("pytorch", f"PyTorch, micro-batch {b}"):
                row["error"] = "not run: out of time"
                break
            r = run_pytorch(a.pytorch, b, a.steps, precision, workdir, max(10, left()) / scale)
            row["attempts"].append({"batch": b, "ok": "error" not in r, "oom": r["oom"], "error": r.get("error"),
                                    "seconds": round(r["seconds"], 1)})
            row["command"] = r["command"]
            if "error" not in r:
                estimate["pytorch"] = r["seconds"] * scale
                row.update({"batch": b, "tokens_per_s": r["tokens_per_s"], "features": r.get("features"),
                            "peak_gpu_mib": (r.get("peak_gib") or 0) * 1024 or None, "peak_source": "torch.cuda.max_memory_allocated",
                            "seconds": round(r["seconds"], 1), "torch": r.get("torch")})
                if peak:
                    row["mfu"] = r["tokens_per_s"] * res["flops_per_token"] / (peak * 1e12)
                row.pop("error", None)
                break
            row["error"] = r["error"]
            if not r["oom"]:
                res["failures"].append({"what": row["name"], "error": r["error"], "command": r["command"],
                                        "log_tail": r["log_tail"]})
                break
            b //= 2
        save()

    torch_rows = [r for r in res["rows"] if r["kind"] == "pytorch" and r.get("tokens_per_s")]
    for row in res["rows"]:
        if row["kind"] == "llmtrain" and row.get("tokens_per_s") and torch_rows:
            ref = torch_rows[0]
            row["ratio"] = row["tokens_per_s"] / ref["tokens_per_s"]
            if ref["batch"] != row["batch"]:
                row["ratio_note"] = f"PyTorch at micro-batch {ref['batch']}"

    for row in [r for r in res["rows"] if r["kind"] == "llmtrain" and r.get("batch")]:
        if a.profile_steps <= 0 or not fits("profile", f"top kernels, {row['attention']} attention"):
            continue
        cfg = deep_merge(config, {"model": {"attention": row["attention"]}})
        t0 = now()
        row["top"] = top_kernels(a.binary, cfg, workdir, "cuda", row["batch"], precision, a.profile_steps,
                                 max(10, min(a.timeout, left())) / scale)
        estimate["profile"] = (now() - t0) * scale
        if row["top"].get("error"):
            res["failures"].append({"what": f"top kernels, {row['attention']} attention ({row['top']['source']})",
                                    "error": row["top"]["error"]})
        save()
    if not a.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    save()
    # A row not run for time, or a part skipped for time (PyTorch, a profile), is no failure.
    bad = [r for r in res["rows"] if "error" in r and not r.get("refused") and r["error"] != "not run: out of time"]
    if bad or res["failures"]:
        return 1
    return OUT_OF_TIME if res["skipped"] else 0


def fmt_bytes(n):
    return f"{n / 2**30:.1f} GiB" if n else "n/a"


def render_table(bench, header, tests, build):
    """The table gpu_check.sh prints: one row per check, then the benchmark's figures and kernels."""
    rows = []
    rows.append(("build", build or "n/a"))
    rows.append(("[cuda] tests", tests or "n/a"))
    d = bench.get("dims") or {}
    n = bench.get("params", 0)
    size = f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"
    shape = f"GPT-2 {size}, T={d.get('T')}, {bench.get('precision')}" if d else "GPT-2 124M"
    tried = ",".join(str(b) for b in bench.get("candidates", []))
    if "error" in bench:
        not_run = bench["error"].startswith(("not run", "skipped"))
        rows.append(("benchmark", bench["error"] if not_run else f"FAILED: {bench['error']}"))
        if bench.get("attempts"):
            rows.append(("  micro-batches tried", "; ".join(
                f"{t['batch']}: {'ok' if t['ok'] else 'out of memory' if t['oom'] else 'failed'}" for t in bench["attempts"])))
        if bench.get("command"):
            rows.append(("  command", bench["command"]))
    else:
        rows.append(("benchmark", f"ok: {shape}, micro-batch {bench['batch']} (largest that ran of {tried}), "
                                  f"median of steps {bench['timed_steps'][0]}-{bench['timed_steps'][1]}"))
    tps = bench.get("tokens_per_s")
    rows.append(("tokens/s", f"{tps:,.0f}" if tps else "n/a"))
    if bench.get("mfu") is not None:
        rows.append(("MFU", f"{100 * bench['mfu']:.1f}%"))
    else:
        rows.append(("MFU", "n/a" + (f" ({bench['peak_text']})" if bench.get("peak_text") and not bench.get("peak_tflops") else "")))
    if d:
        Q = d["C"] // d["H"]
        rows.append(("  formula", f"tokens/s x (6N + 12 L H Q T) / peak; N={bench['params']:,}, L={d['L']}, H={d['H']}, "
                                  f"Q={Q}, T={d['T']}: {bench['flops_per_token']:.3e} flop/token"))
    rows.append(("  peak", bench.get("peak_text", "n/a")))
    gpu_mib = bench.get("peak_gpu_mib")
    rows.append(("peak GPU memory", f"{gpu_mib / 1024:.1f} GiB (nvidia-smi, sampled every 0.2 s)" if gpu_mib else "n/a"))
    # llmtrain's own figure: the process's VmHWM on the CPU backend, the GPU's peak on CUDA.
    own = bench.get("peak_host_bytes")
    where = "GPU" if bench.get("device") == "cuda" else "process VmHWM"
    rows.append(("peak memory, llmtrain", fmt_bytes(own) + (f" (metrics.jsonl peak_memory_bytes: {where})" if own else "")))
    top = bench.get("top") or {}
    if top.get("kernels"):
        rows.append((f"top {len(top['kernels'])} kernels", top["source"]))
        for i, k in enumerate(top["kernels"], 1):
            pct = f"{k['percent']:5.1f}%" if k.get("percent") == k.get("percent") else "   n/a"
            name = k["name"] if len(k["name"]) <= 90 else k["name"][:87] + "..."
            rows.append((f"  {i:2d}. {pct}", f"{k['total_ms']:10.2f} ms {k['calls']:7d} calls  {name}"))
    elif top.get("error"):
        rows.append(("top 10 kernels", f"FAILED ({top['source']}): {top['error']}"))
    else:
        rows.append(("top 10 kernels", "n/a (benchmark did not run)" if "error" in bench else "n/a"))
    width = max(len(r[0]) for r in rows)
    out = [header] if header else []
    rule = "-" * (width + 2) + "+" + "-" * 60
    out.append(rule)
    for key, value in rows:
        out.append(f" {key.ljust(width)} | {value}")
    out.append(rule)
    return "\n".join(out)


def render_suite(suite, header, tests, build, problems=(), notes=(), extra=()):
    """The table of a gpu_check.sh run: its checks, one row per training run, then the top kernels."""
    out = [header] if header else []
    checks = [("build", build or "n/a"), ("[cuda] tests", tests or "n/a")] + list(extra)
    checks += [("missing", p) for p in problems] + [("note", n) for n in notes]
    d = suite.get("dims") or {}
    if d:
        checks.append(("shape", f"GPT-2 {suite.get('params', 0) / 1e6:.0f}M, T={d.get('T')}, {suite.get('precision')}, "
                                f"micro-batch: the largest of {','.join(str(b) for b in suite.get('candidates', []))} that fits"))
        checks.append(("MFU", f"tokens/s x (6N + 12 L H Q T) / peak = {suite['flops_per_token']:.3e} flop/token; "
                              f"peak {suite.get('peak_text', 'n/a')}"))
    if suite.get("error"):
        checks.append(("benchmark", suite["error"]))
    width = max(len(k) for k, _ in checks)
    for key, value in checks:
        out.append(f" {key.ljust(width)} | {value}")
    rows = [("run", "micro-batch", "tokens/s", "MFU", "peak GPU mem", "vs PyTorch")]
    for r in suite.get("rows", []):
        if r.get("tokens_per_s"):
            ratio = f"{r['ratio']:.2f}x" if r.get("ratio") else ("1.00x" if r["kind"] == "pytorch" else "n/a")
            if r.get("ratio_note"):
                ratio += f" ({r['ratio_note']})"
            mem = f"{r['peak_gpu_mib'] / 1024:.1f} GiB" if r.get("peak_gpu_mib") else "n/a"
            mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "n/a"
            rows.append((r["name"], str(r["batch"]), f"{r['tokens_per_s']:,.0f}", mfu, mem, ratio))
        else:
            tried = "; ".join(f"{t['batch']}: {'out of memory' if t['oom'] else 'failed'}" for t in r.get("attempts", []))
            rows.append((r["name"], "-", "FAILED" if not str(r.get("error", "")).startswith(("not run", "skipped")) else "-", "", "",
                         f"{r.get('error')}" + (f" (tried {tried})" if tried else "")))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    rule = "-" * (sum(widths) + 3 * len(widths) + 12)
    out.append(rule)
    for row in rows:
        out.append(" " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
                   + " | " + row[-1])
    out.append(rule)
    for s in suite.get("skipped", []):
        out.append(f" skipped: {s}")
    for r in suite.get("rows", []):
        top = r.get("top") or {}
        if top.get("kernels"):
            out.append(f" top {len(top['kernels'])} kernels, {r['name']} ({top['source']}):")
            for i, k in enumerate(top["kernels"], 1):
                pct = f"{k['percent']:5.1f}%" if k.get("percent") == k.get("percent") else "   n/a"
                name = k["name"] if len(k["name"]) <= 90 else k["name"][:87] + "..."
                out.append(f"  {i:2d}. {pct} {k['total_ms']:10.2f} ms {k['calls']:7d} calls  {name}")
        elif top.get("error"):
            out.append(f" top kernels, {r['name']}: FAILED ({top['source']}): {top['error']}")
    return "\n".join(out)


def render_kernels(doc, status):
    """bench_kernels' table (its JSON), under its status line: one row per op."""
    out = [f" kernels | {status}"] if status else []
    if not doc:
        return "\n".join(out)
    shape, ceil = doc.get("shape", {}), doc.get("ceilings", {})
    out.append(f" kernels on {doc.get('device')}: {doc.get('dtype')}, "
               + " ".join(f"{k}={v}" for k, v in shape.items())
               + f", mean of {doc.get('reps')} runs; ceilings {ceil.get('gbps', 0):.0f} GB/s, {ceil.get('tflops', 0):.0f} TFLOP/s")
    rows = [("op", "shape", "ms", "achieved", "of ceiling")]
    for r in doc.get("rows", []):
        if "ms" in r:
            achieved = f"{r['tflops']:.1f} TFLOP/s" if r.get("bound") == "compute" else f"{r.get('gbps', 0):.0f} GB/s"
            rows.append((r["op"], r["shape"], f"{r['ms']:.4f}", achieved, f"{100 * r.get('fraction', 0):.1f}%"))
        else:
            rows.append((r["op"], r["shape"], "-", "FAILED" if "error" in r else "skipped", r.get("error") or r.get("skipped", "")))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    rule = "-" * (sum(widths) + 3 * len(widths) + 12)
    out.append(rule)
    for row in rows:
        out.append(" " + " | ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
                   + " | " + row[-1])
    out.append(rule)
    return "\n".join(out)


def tail_of(path, lines=40):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def cmd_report(a):
    suite, bench, tests = None, {}, None
    if a.suite and os.path.exists(a.suite):
        with open(a.suite) as f:
            suite = json.load(f)
    elif a.bench and os.path.exists(a.bench):
        with open(a.bench) as f:
            bench = json.load(f)
    if a.bench_error:
        if suite is None and not bench:
            suite = {"error": a.bench_error} if (a.problem or a.json or a.note or a.stage) else None
            bench = {"error": a.bench_error}
    if a.tests_json and os.path.exists(a.tests_json):
        with open(a.tests_json) as f:
            tests = json.load(f)
    kernels = None
    if a.kernels and os.path.exists(a.kernels):
        with open(a.kernels) as f:
            kernels = json.load(f)
    extra = []  # under the tests: why cases skipped (cuDNN's refusals among them); then the other stages
    for why, count in ((tests or {}).get("skip_reasons") or {}).items():
        extra.append(("  skipped", f"{count} case{'s' if count > 1 else ''}: {why}"))
    extra += [("  note", n) for n in (tests or {}).get("notes", [])]
    extra += [tuple(s.split("=", 1)) for s in a.stage or [] if "=" in s]
    if suite is not None:
        table = render_suite(suite, a.header, a.tests, a.build, a.problem or [], a.note or [], extra)
    else:
        table = render_table(bench, a.header, a.tests, a.build)
        if a.problem:
            table += "\n" + "\n".join(f" missing: {p}" for p in a.problem)
    if a.kernels_status or kernels:
        table += "\n" + render_kernels(kernels, a.kernels_status)
    print(table)
    if a.json:
        doc = {"status": a.status, "out_of_time": [x for x in (a.out_of_time or "").split(", ") if x],
               "header": a.header, "build": a.build, "tests": a.tests, "tests_detail": tests,
               "problems": a.problem or [], "notes": a.note or [], "found": a.found or [],
               "ld_library_path": a.ld_library_path, "benchmark": suite if suite is not None else bench,
               "kernels_status": a.kernels_status, "kernels": kernels, "stages": a.stage or [], "table": table}
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
    if a.failures_log:  # everything that failed, with the end of its log
        parts = [f"missing: {p}" for p in a.problem or []]
        if a.build and a.build.startswith("FAILED") and a.logs:
            for name in ("configure.log", "build.log"):
                parts.append(f"== {a.build}\n-- {name}, last lines:\n" + tail_of(os.path.join(a.logs, name), 60))
        if tests and (tests.get("failed") or tests.get("problems")):
            parts.append("== [cuda] tests: " + tests.get("line", "") + "\n" +
                         "\n".join(f"  FAILED  {x}" for x in tests.get("failures", [])) + "\n" +
                         "\n".join(f"  problem {x}" for x in tests.get("problems", [])))
            if a.logs:
                parts.append(tail_of(os.path.join(a.logs, "cuda_tests.txt"), 80))
        if a.kernels_status and a.kernels_status.startswith("FAILED"):
            parts.append(f"== kernels: {a.kernels_status}\n" + (tail_of(os.path.join(a.logs, "kernels.txt"), 60) if a.logs else ""))
        for r in (kernels or {}).get("rows", []):
            if r.get("error"):
                parts.append(f"== kernel {r['op']} ({r['shape']}): {r['error']}")
        for f_ in (suite or {}).get("failures", []):
            parts.append(f"== {f_['what']}: {f_['error']}\n" + (f"command: {f_['command']}\n" if f_.get("command") else "")
                         + f_.get("log_tail", ""))
        for r in (suite or {}).get("rows", []):
            if r.get("error") and not any(f_["what"] == r["name"] for f_ in suite.get("failures", [])):
                parts.append(f"== {r['name']}: {r['error']}")
        with open(a.failures_log, "w") as f:
            f.write("\n".join(parts) + ("\n" if parts else "nothing failed\n"))
    return 0


def cmd_self_test(_):
    """Parsers, MFU and the table on made-up input: what can be checked without a GPU."""
    d = {"V": 50257, "T": 1024, "L": 12, "H": 12, "C": 768, "F": 3072}
    assert gpt2_parameters(d) == 124439808, gpt2_parameters(d)  # docs/plan.md: llmtrain plan's count
    assert abs(flops_per_token(d, 124439808) - (6 * 124439808 + 12 * 12 * 12 * 64 * 1024)) < 1
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16")[0] == 989.0
    assert peak_tflops("NVIDIA H100 PCIe", "bf16")[0] == 756.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "fp32")[0] == 19.5
    assert peak_tflops("NVIDIA A10", "bf16")[0] == 125.0
    assert "TF32 would be 494.5" in peak_tflops("NVIDIA H200", "fp32")[1]
    assert peak_tflops("Tesla T4", "bf16")[0] is None
    assert peak_tflops("Tesla T4", "bf16", "65")[0] == 65.0
    csv_text = ("Processing [report.sqlite] with [cuda_gpu_kern_sum.py]...\n"
                "Time (%),Total Time (ns),Instances,Avg (ns),Med (ns),Min (ns),Max (ns),StdDev (ns),Name\n"
                "61.5,\"1,230,000\",120,10250.0,10000.0,9000,12000,100.0,\"sm90_xmma_gemm_bf16bf16, kernel\"\n"
                "20.0,400000,60,6666.7,6600.0,6000,7000,50.0,layernorm_forward_kernel\n"
                "18.5,370000,30,12333.3,12000.0,11000,13000,70.0,adamw_kernel\n")
    k = parse_nsys_kernel_csv(csv_text)
    assert [x["name"] for x in k] == ["sm90_xmma_gemm_bf16bf16, kernel", "layernorm_forward_kernel", "adamw_kernel"], k
    assert abs(k[0]["total_ms"] - 1.23) < 1e-9 and k[0]["calls"] == 120 and k[0]["percent"] == 61.5
    log = ("[2025-01-01 00:00:00 rank 0] op time (2.00 s in ops of 2.50 s in all):\n"
           "[2025-01-01 00:00:00 rank 0]   matmul_backward          120 calls     0.900 s  36.0%\n"
           "[2025-01-01 00:00:00 rank 0]   matmul_forward           120 calls     0.400 s  16.0%\n")
    ops = parse_profile_ops(log)
    assert [o["name"] for o in ops] == ["matmul_backward", "matmul_forward"] and ops[0]["calls"] == 120, ops
    with tempfile.TemporaryDirectory() as tmp:
        path = write_shard(os.path.join(tmp, "train_000000.bin"), 1000, 50257, seed=3)
        raw = open(path, "rb").read()
        assert len(raw) == 1024 + 2000 and struct.unpack_from("<3i", raw) == (SHARD_MAGIC, 1, 1000)
        assert max(struct.unpack_from("<1000H", raw, 1024)) < 50257
        metrics = os.path.join(tmp, "metrics.jsonl")
        with open(metrics, "w") as f:
            for s in range(1, 11):
                f.write(json.dumps({"step": s, "loss": 5.0, "tokens_per_s": 100.0 * s, "peak_memory_bytes": s << 20}) + "\n")
            f.write(json.dumps({"step": 10, "val_loss": 4.0}) + "\n")
        m = summarize_metrics(metrics)
        assert m["timed_steps"] == [4, 10] and m["tokens_per_s"] == 700.0 and m["peak_host_bytes"] == 10 << 20, m
    bench = {"dims": d, "params": 124439808, "flops_per_token": flops_per_token(d, 124439808), "precision": "bf16",
             "candidates": [64, 32], "batch": 32, "timed_steps": [6, 30], "tokens_per_s": 500000.0,
             "peak_tflops": 989.0, "peak_text": "989 TFLOP/s (H200 bf16 dense peak)",
             "mfu": 500000.0 * flops_per_token(d, 124439808) / 989e12, "peak_gpu_mib": 61440,
             "peak_host_bytes": 3 << 30, "top": {"source": "nsys, 10 steps", "kernels": k}}
    table = render_table(bench, "header", "3 passed, 0 failed, 0 skipped", "ok")
    for want in ["tokens/s", "500,000", "MFU", "43.5%", "6N + 12 L H Q T", "60.0 GiB", "adamw_kernel"]:
        assert want in table, (want, table)
    failed = render_table({"error": "llmtrain: error: --device cuda: not yet", "attempts": [{"batch": 64, "ok": False, "oom": False}]},
                          "", "n/a", "ok")
    assert "FAILED: llmtrain: error: --device cuda: not yet" in failed and "64: failed" in failed, failed
    v2 = ('<?xml version="1.0" encoding="UTF-8"?><Catch name="t"><Group name="t">'
          '<TestCase name="a, b" tags="[cuda]"><OverallResult success="true"/></TestCase>'
          '<TestCase name="c" tags="[cuda]"><Warning>SKIPPED: no CUDA device: none</Warning>'
          '<OverallResult success="true"/></TestCase>'
          '<TestCase name="d" tags="[cuda]"><Expression success="false"/><OverallResult success="false"/></TestCase>'
          '</Group></Catch>')
    assert parse_catch_xml(v2) == [("a, b", "passed"), ("c", "skipped"), ("d", "failed")], parse_catch_xml(v2)
    v3 = ('<Catch2TestRun name="t"><TestCase name="e" tags="[cuda]"><Skip filename="x" line="1">no GPU</Skip>'
          '<OverallResult success="true" skips="1"/></TestCase></Catch2TestRun>')
    assert parse_catch_xml(v3) == [("e", "skipped")]
    assert skip_reasons(v2) == {"c": "no CUDA device: none"} and skip_reasons(v3) == {"e": "no GPU"}
    kdoc = {"device": "NVIDIA H200", "dtype": "bf16", "shape": {"B": 8, "T": 1024}, "reps": 20,
            "ceilings": {"gbps": 4300.0, "tflops": 790.0},
            "rows": [{"op": "layernorm_forward", "shape": "N=8192 C=768", "ms": 0.01, "bound": "memory", "gbps": 2516.0,
                      "fraction": 0.585},
                     {"op": "matmul_forward fc", "shape": "N=8192 C=768 OC=3072", "ms": 0.1, "bound": "compute",
                      "tflops": 386.5, "fraction": 0.489},
                     {"op": "attention_forward cudnn", "shape": "B=8", "skipped": "skipped: no cuDNN"},
                     {"op": "adamw_update", "shape": "params=1", "error": "out of memory"}]}
    kt = render_kernels(kdoc, "ok: 4 ops")
    for want in [" kernels | ok: 4 ops", "4300 GB/s", "2516 GB/s", "58.5%", "386.5 TFLOP/s", "48.9%", "skipped: no cuDNN",
                 "FAILED"]:
        assert want in kt, (want, kt)
    # A test binary still running at the deadline: skipped for time, not failed; the cases it had
    # finished count (the failed one too); the binary after it is not run.
    partial = ('<?xml version="1.0" encoding="UTF-8"?><Catch name="t"><Group name="t">'
               '<TestCase name="p" tags="[cuda]"><OverallResult success="true"/></TestCase>'
               '<TestCase name="f" tags="[cuda]"><Expression success="false"/><OverallResult success="false"/></TestCase>'
               '<TestCase name="unfinished" tags="[cuda]"><Expression success="true"/>')
    assert parse_catch_xml(completed_cases_xml(partial)) == [("p", "passed"), ("f", "failed")]
    assert completed_cases_xml('<?xml version="1.0"?><Catch name="t"><Group name="t"><TestCase name="u">') is None
    # Twice: on the real clock, where test_a hangs and is killed (what took how long depends on the
    # machine's load, so only the order of events is checked), and on a fake clock (the file that
    # GPU_CHECK_FAKE_CLOCK names), where test_a keeps to the deadline it is handed and the seconds
    # are exact.
    with tempfile.TemporaryDirectory() as tmp:
        os.makedirs(os.path.join(tmp, "tests"))
        for name, body in (("test_a", partial), ("test_b", "")):
            path = os.path.join(tmp, "tests", name)
            with open(path, "w") as f:  # writes its report so far, then hangs (fake clock: runs to its deadline)
                f.write(f"#!/bin/sh\nwhile [ $# -gt 0 ]; do [ \"$1\" = --out ] && out=\"$2\"; shift; done\n"
                        f"printf '%s' '{body}' > \"$out\"\n"
                        "if [ -n \"$GPU_CHECK_FAKE_CLOCK\" ]; then\n"
                        "  echo \"$GPU_CHECK_FAKE_DEADLINE\" > \"$GPU_CHECK_FAKE_CLOCK\"; exit 124\nfi\n"
                        "exec sleep 60\n")
            os.chmod(path, 0o755)
        clock = os.path.join(tmp, "clock")
        for fake in (False, True):
            if fake:
                with open(clock, "w") as f:
                    f.write("1700000000000000\n")
                os.environ["GPU_CHECK_FAKE_CLOCK"] = clock
            try:
                s = run_tagged_tests(tmp, deadline=now() + 1.5, scale=10.0, order=["test_a", "test_b"])
            finally:
                os.environ.pop("GPU_CHECK_FAKE_CLOCK", None)
            stopped = r"test_a \(stopped at its deadline after " + (r"15" if fake else r"[0-9]+") + r" s\)$"
            assert len(s["stopped"]) == 1 and re.match(stopped, s["stopped"][0]), (fake, s)
            assert s["not_run"] == ["test_b"] and s["out_of_time"] and (s["passed"], s["failed"]) == (1, 1), (fake, s)
            assert s["failures"] == ["test_a: f"] and "skipped for time: test_a (stopped" in s["line"], (fake, s)
            assert "test_b (not run)" in s["line"] and not s["problems"], (fake, s)
            if fake:
                with open(clock) as f:
                    assert s["seconds"] == {"test_a": 15.0} and int(f.read()) == 1700000001500000, s
    print("gpu_bench.py self-test: ok")
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("shard", help="write a synthetic token shard")
    s.add_argument("dir")
    s.add_argument("--tokens", type=int, default=1 << 21)
    s.add_argument("--vocab", type=int, default=50257)
    s.add_argument("--seed", type=int, default=1)
    s.set_defaults(func=cmd_shard)
    b = sub.add_parser("bench", help="micro-batch search, timed run, top kernels -> JSON")
    b.add_argument("--binary", required=True)
    b.add_argument("--config", required=True)
    b.add_argument("--data", required=True, help="folder with train_*.bin")
    b.add_argument("--device", default="cuda")
    b.add_argument("--gpu-name", default="")
    b.add_argument("--precision", choices=["bf16", "fp32"])
    b.add_argument("--batches", default="64,32,16,8,4,2,1")
    b.add_argument("--probe-steps", type=int, default=3)
    b.add_argument("--steps", type=int, default=30)
    b.add_argument("--profile-steps", type=int, default=10)
    b.add_argument("--timeout", type=int, default=300, help="seconds per llmtrain run")
    b.add_argument("--workdir", default=None)
    b.add_argument("--keep", action="store_true", help="keep the runs' folders")
    b.add_argument("--out", required=True)
    b.set_defaults(func=cmd_bench)
    u = sub.add_parser("suite", help="each attention path, PyTorch, top kernels, within a deadline -> JSON")
    u.add_argument("--binary", required=True)
    u.add_argument("--config", required=True)
    u.add_argument("--data", required=True, help="folder with train_*.bin")
    u.add_argument("--gpu-name", default="")
    u.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    u.add_argument("--attention", default="flash,cudnn")
    u.add_argument("--batches", default="64,32,16,8,4,2,1")
    u.add_argument("--steps", type=int, default=30)
    u.add_argument("--profile-steps", type=int, default=10)
    u.add_argument("--pytorch", metavar="PYTHON", help="also run scripts/bench_vs_pytorch.py with this interpreter")
    u.add_argument("--deadline", type=float, default=0, help="seconds since the epoch by which to be done")
    u.add_argument("--timeout", type=int, default=300, help="seconds per llmtrain run")
    u.add_argument("--row-estimate", type=float, default=60.0, help="seconds a training row takes, until one was timed")
    u.add_argument("--time-scale", type=float, default=1.0, help="budget seconds per real second (tests only)")
    u.add_argument("--workdir", default=None)
    u.add_argument("--keep", action="store_true")
    u.add_argument("--out", required=True)
    u.set_defaults(func=cmd_suite)
    r = sub.add_parser("report", help="print the table")
    r.add_argument("--bench")
    r.add_argument("--bench-error")
    r.add_argument("--tests")
    r.add_argument("--build")
    r.add_argument("--header", default="")
    r.add_argument("--status", help='the run\'s status: "passed", "failed" or "incomplete (out of time)"')
    r.add_argument("--out-of-time", help="the stages skipped or cut short for time, separated by \", \"")
    r.add_argument("--suite", help="gpu_bench.py suite's JSON")
    r.add_argument("--tests-json", help="gpu_bench.py cuda-tests' JSON")
    r.add_argument("--problem", action="append", help="a missing piece (repeatable)")
    r.add_argument("--kernels", help="bench_kernels' JSON")
    r.add_argument("--kernels-status", help="the kernel table's status line")
    r.add_argument("--note", action="append")
    r.add_argument("--stage", action="append", help="NAME=STATUS: one more row of the checks (repeatable)")
    r.add_argument("--found", action="append")
    r.add_argument("--ld-library-path", default="")
    r.add_argument("--json", help="write the table and everything behind it here")
    r.add_argument("--failures-log", help="write what failed, with the end of each log, here")
    r.add_argument("--logs", help="the folder with configure.log, build.log, cuda_tests.txt")
    r.set_defaults(func=cmd_report)
    c = sub.add_parser("cuda-tests", help="run every Catch2 test case with a tag, count the outcomes")
    c.add_argument("--build", required=True)
    c.add_argument("--tag", default="[cuda]")
    c.add_argument("--out", required=True)
    c.add_argument("--timeout", type=int, default=900, help="seconds per test binary")
    c.add_argument("--deadline", type=float, help="seconds since the epoch by which every binary is done")
    c.add_argument("--time-scale", type=float, default=1.0, help="budget seconds per real second (tests only)")
    c.add_argument("--binaries", help="these test binaries first, in this order, and only these unless --and-the-rest")
    c.add_argument("--and-the-rest", action="store_true")
    c.add_argument("--allow-all-skipped", action="store_true",
                   help="a machine without a GPU: every case skipping is not a problem")
    c.set_defaults(func=cmd_cuda_tests)
    t = sub.add_parser("self-test", help="check the parsers and the table on made-up input")
    t.set_defaults(func=cmd_self_test)
    a = p.parse_args(argv)
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())
