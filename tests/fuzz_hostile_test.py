#!/usr/bin/python3
"""Hostile inputs: hundreds of malformed files and command lines, each of which llmtrain must
refuse with exit 2 and exactly one `llmtrain: error:` line on stderr, without dying of a signal,
hanging (a timeout per run), passing a memory bound (RLIMIT_AS in the child), or changing any
good file (every fixture hashed before and after).

The inputs cover token shards, safetensors for model.init_from, checkpoints for inspect, eval,
generate, export and train --resume, tokenizer files, text inputs and command lines. Each case is
tiny (a 1-layer model of width 16), so the whole test runs in well under a minute on 2 cores.

usage: fuzz_hostile_test.py LLMTRAIN [--no-memory-limit]   (the latter under AddressSanitizer,
whose shadow memory cannot live under RLIMIT_AS)
"""
import concurrent.futures
import hashlib
import json
import os
import random
import re
import resource
import shutil
import stat
import struct
import subprocess
import sys
import tempfile
import time
import zlib

TIMEOUT_S = 30
MEMORY_LIMIT = 2 << 30  # address space per run; the valid inputs need a small part of it

LLMTRAIN = os.path.abspath(sys.argv[1])
USE_RLIMIT = "--no-memory-limit" not in sys.argv[2:]
ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")


def limit_memory():
    if USE_RLIMIT:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def run(args, cwd=None, check_ok=False):
    proc = subprocess.run([LLMTRAIN] + args, cwd=cwd, env=ENV, capture_output=True, timeout=120,
                          preexec_fn=limit_memory)
    if check_ok and proc.returncode != 0:
        sys.exit(f"fuzz: setup failed: llmtrain {' '.join(args)}: exit {proc.returncode}\n"
                 f"{proc.stderr.decode(errors='replace')}")
    return proc


def write(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())
    return path


def read(path):
    with open(path, "rb") as f:
        return f.read()


def tree_hashes(root):
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            if stat.S_ISREG(os.lstat(path).st_mode):
                out[os.path.relpath(path, root)] = hashlib.sha256(read(path)).hexdigest()
            else:
                out[os.path.relpath(path, root)] = "link:" + os.readlink(path) if os.path.islink(path) else "other"
        for name in dirnames:
            out[os.path.relpath(os.path.join(dirpath, name), root) + "/"] = "dir"
    return out


SPECIAL = {"a directory": "dir", "a FIFO": "fifo", "a link to /dev/zero": "zero", "a link loop": "loop",
           "a dangling link": "dangling", "missing": "missing"}


def make_special(path, how):
    """Puts at `path` what does not belong where a file is read: dir, fifo, zero, loop, dangling, missing."""
    if os.path.lexists(path):
        shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
    if how == "dir":
        os.makedirs(path)
    elif how == "fifo":
        os.mkfifo(path)
    elif how == "zero":
        os.symlink("/dev/zero", path)
    elif how == "loop":
        os.symlink(path, path)
    elif how == "dangling":
        os.symlink(path + ".nowhere", path)


def deep(n, open_="[", close="]", inner="1"):
    return open_ * n + inner + close * n


def deep_object(n):
    return '{"a":' * n + "1" + "}" * n


# ---------------------------------------------------------------------------------------------
# Fixtures: good inputs, made once by llmtrain itself.

ROOT = tempfile.mkdtemp(prefix="llmtrain-fuzz-")
GOOD = os.path.join(ROOT, "good")  # hashed before and after: nothing may change in it
CASES = os.path.join(ROOT, "cases")
os.makedirs(GOOD)
os.makedirs(CASES)

rng = random.Random(20240520)
words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "and", "runs", "far", "away"]
TEXT = write(f"{GOOD}/text.txt", "\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(60)) + "\n")
SHARDS = f"{GOOD}/shards"
run(["tokenize", "--input", TEXT, "--output", SHARDS, "--val-fraction", "0.1"], check_ok=True)
BPE = f"{GOOD}/bpe"
run(["tokenize", "--input", TEXT, "--output", BPE, "--tokenizer", "bpe:300"], check_ok=True)

CONFIG = {
    "model": {"vocab_size": 256, "context_length": 16, "n_layer": 1, "n_head": 2, "d_model": 16},
    "data": {"train": f"{SHARDS}/train_*.bin", "val": f"{SHARDS}/val_*.bin", "shuffle": False},
    "train": {"micro_batch_size": 2, "global_batch_size": 4, "max_steps": 2, "log_every": 1, "eval_every": 0,
              "eval_batches": 1},
    "optim": {"lr": 0.01, "warmup_steps": 1},
    "checkpoint": {"every": 2, "keep_last": 1},
}
CONFIG_FILE = write(f"{GOOD}/config.json", json.dumps(CONFIG))
RUN = f"{GOOD}/run"
run(["train", "--config", CONFIG_FILE, "--run-dir", RUN], check_ok=True)
STEP = f"{RUN}/checkpoints/step_00000002"
HF = f"{GOOD}/hf"
run(["export", "--checkpoint", RUN, "--output", HF], check_ok=True)
HF_FILE = f"{HF}/model.safetensors"
# A Mixtral-shaped Llama, exported: its config.json carries the keys a run's config is checked
# against (rms_norm_eps, rope_theta, tie_word_embeddings, head_dim, num_experts_per_tok).
MOE_CONFIG = json.loads(json.dumps(CONFIG))
MOE_CONFIG["model"].update(arch="llama", n_kv_head=1, ffn_hidden=32, rope_theta=10000.0, norm_eps=1e-5,
                           moe={"experts": 2, "top_k": 2, "ffn_hidden": 16})
MOE_CONFIG_FILE = write(f"{GOOD}/moe-config.json", json.dumps(MOE_CONFIG))
MOE_RUN = f"{GOOD}/moe-run"
run(["train", "--config", MOE_CONFIG_FILE, "--run-dir", MOE_RUN], check_ok=True)
MOE_HF = f"{GOOD}/moe-hf"
run(["export", "--checkpoint", MOE_RUN, "--output", MOE_HF], check_ok=True)
# A DeepSeek-style router: sigmoid scores and an expert bias that steers which experts are chosen.
BIAS_CONFIG = json.loads(json.dumps(MOE_CONFIG))
BIAS_CONFIG["model"]["moe"].update(router="sigmoid", top_k=1, bias_update_rate=0.001)
BIAS_CONFIG_FILE = write(f"{GOOD}/bias-config.json", json.dumps(BIAS_CONFIG))
BIAS_RUN = f"{GOOD}/bias-run"
run(["train", "--config", BIAS_CONFIG_FILE, "--run-dir", BIAS_RUN], check_ok=True)
MUON_CONFIG = json.loads(json.dumps(CONFIG))
MUON_CONFIG["optim"]["name"] = "muon"
MUON_CONFIG_FILE = write(f"{GOOD}/muon-config.json", json.dumps(MUON_CONFIG))
MUON_RUN = f"{GOOD}/muon-run"
run(["train", "--config", MUON_CONFIG_FILE, "--run-dir", MUON_RUN], check_ok=True)
GOOD_HASHES = tree_hashes(GOOD)

# ---------------------------------------------------------------------------------------------
# Cases: (class, name, args, expected text in the error line or None, cwd)

cases = []
counter = [0]


def case_dir():
    counter[0] += 1
    path = os.path.join(CASES, f"c{counter[0]:04d}")
    os.makedirs(path)
    return path


def add(kind, name, args, expect=None):
    cases.append((kind, name, args, expect))


def config_with(d, **changes):
    cfg = json.loads(json.dumps(CONFIG))
    for key, value in changes.items():
        section, k = key.split("__")
        cfg[section][k] = value
    return write(f"{d}/config.json", json.dumps(cfg))


# --- token shards: train on the bad shard, and eval a good checkpoint on it -------------------
good_shard = read(f"{SHARDS}/train_000000.bin")
header = bytearray(good_shard[:1024])
body = good_shard[1024:]


def shard_with(magic=None, version=None, count=None, tokens=None):
    h = bytearray(header)
    if magic is not None:
        struct.pack_into("<i", h, 0, magic)
    if version is not None:
        struct.pack_into("<i", h, 4, version)
    if count is not None:
        struct.pack_into("<i", h, 8, count)
    return bytes(h) + (body if tokens is None else tokens)


n_tokens = len(body) // 2
shard_variants = {
    "empty file": b"",
    "1 byte": b"\x00",
    "cut inside the header": good_shard[:100],
    "header only": bytes(header),
    "cut inside the tokens": good_shard[:1024 + 11],
    "one byte extra": good_shard + b"\x00",
    "bad magic": shard_with(magic=12345),
    "magic of another format": b"GGUF" + good_shard[4:],
    "version 0": shard_with(version=0),
    "version 3": shard_with(version=3),
    "version -1": shard_with(version=-1),
    "negative count": shard_with(count=-5),
    "count past the file": shard_with(count=n_tokens + 1),
    "count below the file": shard_with(count=n_tokens - 1),
    "count INT32_MAX": shard_with(count=2**31 - 1),
    "count 0 with tokens": shard_with(count=0),
    "token 65535 in uint16": shard_with(tokens=b"\xff\xff" + body[2:]),
    "token 256 (vocab is 256)": shard_with(tokens=struct.pack("<H", 256) + body[2:]),
    "version 2 token 2^32-1": shard_with(version=2, count=n_tokens // 2,
                                        tokens=b"\xff\xff\xff\xff" + body[4:n_tokens // 2 * 4]),
    "random bytes": bytes(rng.randrange(256) for _ in range(2048)),
    "all 0xff": b"\xff" * 2048,
}
for name, data in shard_variants.items():
    d = case_dir()
    shard = write(f"{d}/bad.bin", data)
    add("shard", f"train on shard: {name}",
        ["train", "--config", config_with(d, data__train=shard, data__val=[]), "--run-dir", f"{d}/run"], "bad.bin")
    add("shard", f"eval on shard: {name}", ["eval", "--checkpoint", RUN, "--data", shard], "bad.bin")

# A bad validation shard found while a background save is in flight: step 1's save is still
# uncommitted when step 2's validation reads the shard (the commit comes after it).
for name in ("token 65535 in uint16", "token 256 (vocab is 256)"):
    d = case_dir()
    shard = write(f"{d}/bad.bin", shard_variants[name])
    add("shard", f"validate with a background save in flight: {name}",
        ["train", "--config", config_with(d, data__val=shard, checkpoint__every=1, checkpoint__async=True,
                                          train__eval_every=2, train__max_steps=4), "--run-dir", f"{d}/run"], "bad.bin")

for name in ["a directory", "a FIFO", "a link to /dev/zero", "a link loop", "a dangling link"]:
    d = case_dir()
    shard = f"{d}/bad.bin"
    make_special(shard, SPECIAL[name])
    add("shard", f"train on shard: {name}",
        ["train", "--config", config_with(d, data__train=shard, data__val=[]), "--run-dir", f"{d}/run"], "bad.bin")
    add("shard", f"eval on shard: {name}", ["eval", "--checkpoint", RUN, "--data", shard], "bad.bin")

# --- safetensors for model.init_from ----------------------------------------------------------
hf_bytes = read(HF_FILE)
hf_header_len = struct.unpack("<Q", hf_bytes[:8])[0]
hf_header = json.loads(hf_bytes[8:8 + hf_header_len])
hf_data = hf_bytes[8 + hf_header_len:]


def safetensors(header_obj=None, header_text=None, data=None):
    text = header_text if header_text is not None else json.dumps(header_obj).encode()
    if isinstance(text, str):
        text = text.encode()
    return struct.pack("<Q", len(text)) + text + (hf_data if data is None else data)


def hf_edit(fn):
    h = json.loads(json.dumps(hf_header))
    fn(h)
    return safetensors(h)


first = next(k for k in hf_header if k != "__metadata__")
st_variants = {
    "empty": b"",
    "7 bytes": b"\x01" * 7,
    "header length 2^63": struct.pack("<Q", 2**63) + hf_bytes[8:],
    "header length past the end": struct.pack("<Q", len(hf_bytes)) + hf_bytes[8:],
    "header length 2^64-1": b"\xff" * 8 + hf_bytes[8:],
    "header not JSON": safetensors(header_text="{not json"),
    "header a JSON array": safetensors(header_text="[1, 2]"),
    "header nested 100000 deep": safetensors(header_text=deep(100000)),
    "metadata nested 50000 deep": safetensors(header_text='{"__metadata__": ' + deep_object(50000) + "}"),
    "tensor entry nested 50000 deep": safetensors(header_text='{"x": ' + deep(50000) + "}"),
    "shape nested 50000 deep": safetensors(header_text='{"x": {"dtype": "F32", "shape": ' + deep(50000) +
                                           ', "data_offsets": [0, 4]}}'),
    "header invalid UTF-8": safetensors(header_text=b'{"\xff\xfe": 1}'),
    "header a 200 kB string": safetensors(header_text=json.dumps({"x": "A" * 200000})),
    "dtype F64": hf_edit(lambda h: h[first].update(dtype="F64")),
    "dtype a number": hf_edit(lambda h: h[first].update(dtype=7)),
    "negative dim": hf_edit(lambda h: h[first].update(shape=[-1, 16])),
    "dims overflowing": hf_edit(lambda h: h[first].update(shape=[2**62, 2**62])),
    "dim 2^64-1": safetensors(header_text=json.dumps(hf_header).replace(
        json.dumps(hf_header[first]["shape"]), "[18446744073709551615]", 1)),
    "shape a string": hf_edit(lambda h: h[first].update(shape="16")),
    "offsets past the end": hf_edit(lambda h: h[first].update(data_offsets=[0, 10**12])),
    "offsets reversed": hf_edit(lambda h: h[first].update(data_offsets=[8, 0])),
    "offsets negative": hf_edit(lambda h: h[first].update(data_offsets=[-4, 0])),
    "offsets of 3 numbers": hf_edit(lambda h: h[first].update(data_offsets=[0, 4, 8])),
    "offsets overlapping": hf_edit(lambda h: [h[k].update(data_offsets=h[first]["data_offsets"])
                                              for k in h if k not in ("__metadata__", first)][:1]),
    "a tensor missing": hf_edit(lambda h: h.pop(first)),
    "an unexpected tensor": hf_edit(lambda h: h.update(extra={"dtype": "F32", "shape": [0], "data_offsets": [0, 0]})),
    "shape transposed": hf_edit(lambda h: h[first].update(shape=list(reversed(h[first]["shape"])) + [1])),
    "metadata a number": hf_edit(lambda h: h.update(__metadata__=5)),
    "metadata value a list": hf_edit(lambda h: h.update(__metadata__={"format": [1]})),
    "a key twice": safetensors(header_text=json.dumps(hf_header)[:-1] + ', "' + first + '": ' +
                               json.dumps(hf_header[first]) + "}"),
    "data cut short": hf_bytes[:-100],
    "random bytes after a valid length": struct.pack("<Q", 64) + bytes(rng.randrange(256) for _ in range(64)),
}
for name, data in st_variants.items():
    d = case_dir()
    path = write(f"{d}/model.safetensors", data)
    add("safetensors", f"init_from: {name}",
        ["train", "--config", config_with(d, model__init_from=path), "--run-dir", f"{d}/run"], "model.safetensors")

for name in ["a directory without weights", "a FIFO", "a link to /dev/zero", "index naming ../ files",
             "index weight_map a list", "index nested 50000 deep", "index a directory"]:
    d = case_dir()
    path = f"{d}/weights"
    if not name.startswith("index"):
        make_special(path, SPECIAL.get(name, "dir"))
    else:
        os.makedirs(path)
        index = f"{path}/model.safetensors.index.json"
        if name == "index naming ../ files":
            write(index, json.dumps({"weight_map": {first: "../../../../../../dev/zero"}}))
        elif name == "index weight_map a list":
            write(index, json.dumps({"weight_map": [1, 2]}))
        elif name == "index nested 50000 deep":
            write(index, deep_object(50000))
        else:
            os.makedirs(index)
    add("safetensors", f"init_from: {name}",
        ["train", "--config", config_with(d, model__init_from=path), "--run-dir", f"{d}/run"], "weights")

# --- a Hugging Face folder's config.json: every checked value by its type, never skipped -----------
moe_hf_config = json.loads(read(f"{MOE_HF}/config.json"))
hf_config_variants = {
    "num_experts_per_tok a string": ({"num_experts_per_tok": "1"}, "num_experts_per_tok: expected an integer"),
    "num_experts_per_tok 1.5": ({"num_experts_per_tok": 1.5}, "num_experts_per_tok: expected an integer"),
    "num_experts_per_tok 1 (the run's top_k is 2)": ({"num_experts_per_tok": 1}, "model.moe.top_k"),
    "rms_norm_eps a string": ({"rms_norm_eps": "1e-3"}, "rms_norm_eps: expected a number"),
    "rms_norm_eps negative": ({"rms_norm_eps": -1e-5}, "rms_norm_eps: expected a number"),
    "rope_theta a list": ({"rope_theta": [10000]}, "rope_theta: expected a number"),
    "tie_word_embeddings a string": ({"tie_word_embeddings": "true"}, "tie_word_embeddings: expected true or false"),
    "tie_word_embeddings 1": ({"tie_word_embeddings": 1}, "tie_word_embeddings: expected true or false"),
    "head_dim a string": ({"head_dim": "8"}, "head_dim: expected an integer"),
    "head_dim 2^40": ({"head_dim": 2**40}, "head_dim: expected an integer"),
    "a JSON list": (None, "config.json: expected a JSON object"),
}
for name, (changes, expect) in hf_config_variants.items():
    d = case_dir()
    shutil.copytree(MOE_HF, f"{d}/hf")
    edited = dict(moe_hf_config, **changes) if changes is not None else [moe_hf_config]
    write(f"{d}/hf/config.json", json.dumps(edited))
    cfg = json.loads(json.dumps(MOE_CONFIG))
    cfg["model"]["init_from"] = f"{d}/hf"
    add("hf config", f"init_from: config.json {name}",
        ["train", "--config", write(f"{d}/config.json", json.dumps(cfg)), "--run-dir", f"{d}/run"], expect)

# --- checkpoints --------------------------------------------------------------------------------
state = json.loads(read(f"{STEP}/state.json"))


def copy_step(d, run_dir=RUN):
    """A copy of a good run's checkpoint as d/run/checkpoints/step_00000002 (with `latest`)."""
    shutil.copytree(f"{run_dir}/checkpoints", f"{d}/run/checkpoints")
    return f"{d}/run/checkpoints/step_00000002"


def recommit(step):
    """COMPLETE recording the state.json now in place: an edit the commit itself could have made."""
    data = read(f"{step}/state.json")
    write(f"{step}/COMPLETE", json.dumps({"state.json": {"crc32": zlib.crc32(data), "bytes": len(data)}}) + "\n")


def with_state(fn, committed=True):
    def mutate(step):
        s = json.loads(json.dumps(state))
        fn(s)
        write(f"{step}/state.json", json.dumps(s))
        if committed:
            recommit(step)
    return mutate


def state_digit_changed(step):
    """A digit of tokens_seen changed: valid JSON and a valid state.json, but not the one committed."""
    text = read(f"{step}/state.json")
    at = text.index(b'"tokens_seen": ') + len(b'"tokens_seen": ')
    write(f"{step}/state.json", text[:at] + (b"7" if text[at:at + 1] != b"7" else b"8") + text[at + 1:])


def whole_crc_wrong(s):
    """The whole file's crc32 off by one bit, its chunk checksums (the ones a reader checks) right."""
    listed = s["files"]["model.safetensors"]
    assert "chunk_crc32" in listed
    listed["crc32"] ^= 1


def state_text(text):
    return lambda step: write(f"{step}/state.json", text)


def rewrite_listed(step, name, data):
    """Replaces a listed file and updates its size and checksum: a consistent but hostile checkpoint."""
    write(f"{step}/{name}", data)
    s = json.loads(read(f"{step}/state.json"))
    s["files"][name] = {"crc32": zlib.crc32(data), "bytes": len(data)}
    write(f"{step}/state.json", json.dumps(s))
    recommit(step)


def optim_with(metadata_changes=None, tensor_changes=None):
    raw = read(f"{STEP}/optim-00000.safetensors")
    n = struct.unpack("<Q", raw[:8])[0]
    h = json.loads(raw[8:8 + n])
    h["__metadata__"].update(metadata_changes or {})
    for key, value in (tensor_changes or {}).items():
        h[key].update(value)
    text = json.dumps(h).encode()
    return lambda step: rewrite_listed(step, "optim-00000.safetensors",
                                       struct.pack("<Q", len(text)) + text + raw[8 + n:])


def optim_ranges(fn):
    """The optimizer file with its ranges tensor ((n, 2) int64 [begin, end) pairs) edited by fn."""
    raw = read(f"{STEP}/optim-00000.safetensors")
    n = struct.unpack("<Q", raw[:8])[0]
    h = json.loads(raw[8:8 + n])
    begin, end = h["ranges"]["data_offsets"]
    start = 8 + n
    pairs = list(struct.unpack(f"<{(end - begin) // 8}q", raw[start + begin:start + end]))
    fn(pairs)
    data = raw[:start + begin] + struct.pack(f"<{len(pairs)}q", *pairs) + raw[start + end:]
    return lambda step: rewrite_listed(step, "optim-00000.safetensors", data)


def model_with(fn):
    raw = read(f"{STEP}/model.safetensors")
    n = struct.unpack("<Q", raw[:8])[0]
    h = json.loads(raw[8:8 + n])
    fn(h)
    text = json.dumps(h).encode()
    return lambda step: rewrite_listed(step, "model.safetensors", struct.pack("<Q", len(text)) + text + raw[8 + n:])


def replace_file(name, how):
    return lambda step: make_special(f"{step}/{name}", how)


def flip_byte(name, offset):
    def mutate(step):
        data = bytearray(read(f"{step}/{name}"))
        data[offset] ^= 0x55
        write(f"{step}/{name}", bytes(data))
    return mutate


def set_latest(how):
    def mutate(step):
        latest = os.path.join(os.path.dirname(step), "latest")
        if how in ("loop", "dir", "fifo"):
            make_special(latest, how)
        else:
            write(latest, how)
    return mutate


ALL = ("inspect", "eval", "generate", "export", "resume")
LOADERS = ("eval", "generate", "export", "resume")  # read the weights (inspect only verifies)
RESUME = ("resume",)  # only a resume reads the optimizer state
big = 2**63 - 1
checkpoint_variants = [
    ("step -1", with_state(lambda s: s.update(step=-1)), ALL, "step"),
    ("step 2^63-1", with_state(lambda s: s.update(step=big)), ALL, "step"),
    ("step 1e300", with_state(lambda s: s.update(step=1e300)), ALL, "step"),
    ("step a string", with_state(lambda s: s.update(step="2")), ALL, "step"),
    ("step missing", with_state(lambda s: s.pop("step")), ALL, "step"),
    ("tokens_seen negative", with_state(lambda s: s.update(tokens_seen=-1)), ALL, "tokens_seen"),
    ("sampler missing", with_state(lambda s: s.pop("sampler")), ALL, "sampler"),
    ("sampler a string", with_state(lambda s: s.update(sampler="0")), ALL, "sampler"),
    ("sampler.epoch negative", with_state(lambda s: s["sampler"].update(epoch=-3)), ALL, "epoch"),
    ("sampler.next_sample huge", with_state(lambda s: s["sampler"].update(next_sample=big)), ALL, "next_sample"),
    ("world_size 0", with_state(lambda s: s.update(world_size=0)), ALL, "world_size"),
    ("zero_stage 9", with_state(lambda s: s.update(zero_stage=9)), ALL, "zero_stage"),
    ("files a string", with_state(lambda s: s.update(files="")), ALL, "files"),
    ("files a list", with_state(lambda s: s.update(files=["model.safetensors"])), ALL, "files"),
    ("files names ../../../dev/zero", with_state(lambda s: s["files"].update(
        {"../../../../../../../../dev/zero": {"crc32": 0, "bytes": 0}})), ALL, "plain file name"),
    ("files names /etc/passwd", with_state(lambda s: s["files"].update(
        {"/etc/passwd": {"crc32": 0, "bytes": 0}})), ALL, "plain file name"),
    ("files names ..", with_state(lambda s: s["files"].update({"..": {"crc32": 0, "bytes": 0}})), ALL,
     "plain file name"),
    ("files names the empty string", with_state(lambda s: s["files"].update({"": {"crc32": 0, "bytes": 0}})), ALL,
     "plain file name"),
    ("files without model.safetensors", with_state(lambda s: s["files"].pop("model.safetensors")), ALL,
     "model.safetensors"),
    ("crc32 a string", with_state(lambda s: s["files"]["model.safetensors"].update(crc32="abc")), ALL, "crc32"),
    ("bytes negative", with_state(lambda s: s["files"]["model.safetensors"].update(bytes=-1)), ALL, "bytes"),
    ("config missing", with_state(lambda s: s.pop("config")), ALL, "config"),
    ("config a list", with_state(lambda s: s.update(config=[1])), ALL, "config"),
    ("config nested 30000 deep", state_text(json.dumps(state)[:-1] + ', "deep": ' + deep(30000) + "}"), ALL,
     "nested deeper"),
    ("config model.n_head 0", with_state(lambda s: s["config"]["model"].update(n_head=0)), ALL, "n_head"),
    ("config model.arch a number", with_state(lambda s: s["config"]["model"].update(arch=3)), ALL, "arch"),
    ("config model.d_model 2^40", with_state(lambda s: s["config"]["model"].update(d_model=2**40)), ALL, "d_model"),
    ("config describing a far larger model", with_state(lambda s: s["config"]["model"].update(
        n_layer=1000, d_model=8192, n_head=64, n_kv_head=64, ffn_hidden=32768)), ("eval", "generate", "export"),
     "cannot hold"),
    ("config invalid UTF-8", state_text(json.dumps(state).replace('"gpt2"', '"gpt2\\udcff"', 1)), ALL, "state.json"),
    ("state.json raw invalid UTF-8", lambda step: write(f"{step}/state.json", read(f"{step}/state.json")
                                                        .replace(b'"gpt2"', b'"gp\xff\xfe"', 1)), ALL, "state.json"),
    ("state.json not JSON", state_text("{"), ALL, "state.json"),
    ("state.json a list", state_text("[]"), ALL, "state.json"),
    ("state.json nested 100000 deep", state_text(deep(100000)), ALL, "nested deeper"),
    ("state.json empty", state_text(""), ALL, "state.json"),
    ("state.json a directory", replace_file("state.json", "dir"), ALL, "state.json"),
    ("state.json a FIFO", replace_file("state.json", "fifo"), ALL, "state.json"),
    ("state.json a link loop", replace_file("state.json", "loop"), ALL, "state.json"),
    ("COMPLETE missing", lambda step: os.remove(f"{step}/COMPLETE"), LOADERS, "COMPLETE"),
    ("COMPLETE not a marker", lambda step: write(f"{step}/COMPLETE", "[1, 2]"), ALL, "COMPLETE"),
    ("state.json damaged (a digit changed, still valid)", state_digit_changed, ALL, "state.json"),
    ("whole-file crc32 wrong, chunk checksums right", with_state(whole_crc_wrong), ALL, "combine"),
    ("model.safetensors a byte flipped", flip_byte("model.safetensors", -1), ALL, "model.safetensors"),
    ("model.safetensors cut short", lambda step: write(f"{step}/model.safetensors",
                                                       read(f"{step}/model.safetensors")[:-7]), ALL,
     "model.safetensors"),
    ("model.safetensors missing", lambda step: os.remove(f"{step}/model.safetensors"), ALL, "model.safetensors"),
    ("model.safetensors a directory", replace_file("model.safetensors", "dir"), ALL, "model.safetensors"),
    ("model.safetensors a FIFO", replace_file("model.safetensors", "fifo"), ALL, "model.safetensors"),
    ("model.safetensors a link to /dev/zero", replace_file("model.safetensors", "zero"), ALL, "model.safetensors"),
    ("model.safetensors a link loop", replace_file("model.safetensors", "loop"), ALL, "model.safetensors"),
    # Each reader checks the bytes it reads: the tools that read only the weights never see it.
    ("optim file a byte flipped", flip_byte("optim-00000.safetensors", 20), ("inspect", "resume"), "optim-00000"),
    ("consistent model without a tensor", model_with(lambda h: h.pop(next(k for k in h if k != "__metadata__"))),
     LOADERS, "model.safetensors"),
    ("consistent model with a wrong shape", model_with(lambda h: h[next(k for k in h if k != "__metadata__")]
                                                       .update(shape=[1])), LOADERS, "model.safetensors"),
    ("consistent model nested 50000 deep", lambda step: rewrite_listed(step, "model.safetensors", safetensors(
        header_text=deep(50000), data=b"")), LOADERS, "nested deeper"),
    ("consistent optim range_end 2^62", optim_ranges(lambda r: r.__setitem__(1, 2**62)), RESUME, "optim-00000"),
    ("consistent optim range_begin -5", optim_ranges(lambda r: r.__setitem__(0, -5)), RESUME, "range"),
    ("consistent optim range reversed", optim_ranges(lambda r: r.__setitem__(slice(0, 2), [100, 50])), RESUME, "range"),
    ("consistent optim ranges as F32", optim_with(None, {"ranges": {"dtype": "F32", "shape": [1, 4]}}), RESUME,
     "ranges"),
    ("consistent optim ranges of shape [2]", optim_with(None, {"ranges": {"shape": [2]}}), RESUME, "ranges"),
    ("consistent optim m of another shape", optim_with(None, {"adamw.m": {"shape": [1]}}), RESUME, "optim-00000"),
    ("latest a link loop", set_latest("loop"), ALL, "latest"),
    ("latest a directory", set_latest("dir"), ALL, "latest"),
    ("latest a FIFO", set_latest("fifo"), ALL, "latest"),
    ("latest names ../..", set_latest("../../..\n"), ALL, "latest"),
    ("latest names a missing folder", set_latest("step_99999999\n"), ALL, None),
    ("latest empty", set_latest(""), ALL, "latest"),
]
checkpoint_variants = [v for v in checkpoint_variants if v[2]]


def tensor_values(path, name, fn):
    """Rewrites tensor `name` (F32) of the safetensors file at path with fn(list of floats)."""
    raw = read(path)
    n = struct.unpack("<Q", raw[:8])[0]
    h = json.loads(raw[8:8 + n])
    begin, end = h[name]["data_offsets"]
    start = 8 + n
    values = list(struct.unpack(f"<{(end - begin) // 4}f", raw[start + begin:start + end]))
    fn(values)
    return raw[:start + begin] + struct.pack(f"<{len(values)}f", *values) + raw[start + end:]


def poisoned(file, tensor, fn):
    """A consistent checkpoint (sizes, checksums, commit) whose tensor holds what fn puts there."""
    return lambda step: rewrite_listed(step, file, tensor_values(f"{step}/{file}", tensor, fn))


def fill(value):
    return lambda v: v.__setitem__(slice(None), [value] * len(v))


# State that steers training must be finite: the expert bias, the weights, AdamW's moments. (The
# sigmoid router has no Hugging Face form: export refuses the model itself, so it is not run here.)
BIAS = "model.layers.0.mlp.gate.e_score_correction_bias"
LOADERS_BUT_EXPORT = ("eval", "generate", "resume")
finite_variants = [
    ("expert bias all NaN", poisoned("model.safetensors", BIAS, fill(float("nan"))), LOADERS_BUT_EXPORT, BIAS + "[0] is NaN"),
    ("expert bias +inf", poisoned("model.safetensors", BIAS, lambda v: v.__setitem__(1, float("inf"))), LOADERS_BUT_EXPORT,
     BIAS + "[1] is +inf"),
    ("a weight NaN", poisoned("model.safetensors", "model.norm.weight", lambda v: v.__setitem__(3, float("nan"))),
     LOADERS_BUT_EXPORT, "model.norm.weight[3] is NaN"),
    ("adamw.m NaN", poisoned("optim-00000.safetensors", "adamw.m", lambda v: v.__setitem__(5, float("nan"))), RESUME,
     "the optimizer's adamw.m of "),
    ("adamw.v -inf", poisoned("optim-00000.safetensors", "adamw.v", lambda v: v.__setitem__(0, float("-inf"))), RESUME,
     "the optimizer's adamw.v of "),
]

for name, mutate, commands, expect, run_dir, config_file in [v + (RUN, CONFIG_FILE) for v in checkpoint_variants] + \
        [v + (BIAS_RUN, BIAS_CONFIG_FILE) for v in finite_variants] + \
        [("muon.momentum NaN", poisoned("optim-00000.safetensors", "muon.momentum",
                                        lambda v: v.__setitem__(2, float("nan"))), RESUME,
          "the optimizer's muon.momentum of ", MUON_RUN, MUON_CONFIG_FILE)]:
    for command in commands:
        d = case_dir()
        step = copy_step(d, run_dir)
        mutate(step)
        target = f"{d}/run"
        if command == "inspect":
            args = ["inspect", "--checkpoint", target]
        elif command == "eval":
            args = ["eval", "--checkpoint", target, "--data", f"{SHARDS}/val_*.bin", "--batches", "1"]
        elif command == "generate":
            args = ["generate", "--checkpoint", target, "--max-new-tokens", "3", "--tokenizer", SHARDS]
        elif command == "export":
            args = ["export", "--checkpoint", target, "--output", f"{d}/exported"]
        else:
            args = ["train", "--config", config_file, "--run-dir", f"{d}/resumed", "--resume", target,
                    "--set", "train.max_steps=4"]
        add("checkpoint", f"{command}: {name}", args, expect)

# --- tokenizer files -----------------------------------------------------------------------------
encoder = json.loads(read(f"{BPE}/encoder.json"))
merges = read(f"{BPE}/vocab.bpe").decode()


def tokenizer_dir(d, encoder_text=None, merges_text=None, record=None):
    t = f"{d}/tok"
    os.makedirs(t)
    write(f"{t}/encoder.json", json.dumps(encoder) if encoder_text is None else encoder_text)
    write(f"{t}/vocab.bpe", merges if merges_text is None else merges_text)
    write(f"{t}/tokenizer.json", json.dumps({"kind": "gpt2", "vocab_size": len(encoder), "eot_token": None,
                                             "files": ["encoder.json", "vocab.bpe"]}) if record is None else record)
    return t


def enc(fn):
    e = dict(encoder)
    fn(e)
    return json.dumps(e)


some_token = next(iter(encoder))
merge_lines = merges.splitlines()
tokenizer_variants = [
    ("encoder.json nested 100000 deep", dict(encoder_text=deep(100000)), "encoder.json"),
    ("encoder.json a list", dict(encoder_text="[1, 2]"), "encoder.json"),
    ("encoder.json empty object", dict(encoder_text="{}"), "encoder.json"),
    ("encoder.json not JSON", dict(encoder_text='{"a": '), "encoder.json"),
    ("encoder.json raw invalid UTF-8", dict(encoder_text=b'{"\xff": 0}'), "encoder.json"),
    ("encoder.json an id a string", dict(encoder_text=enc(lambda e: e.update({some_token: "0"}))), "encoder.json"),
    ("encoder.json an id negative", dict(encoder_text=enc(lambda e: e.update({some_token: -1}))), "encoder.json"),
    ("encoder.json an id 2^40", dict(encoder_text=enc(lambda e: e.update({some_token: 2**40}))), "encoder.json"),
    ("encoder.json an id twice", dict(encoder_text=enc(lambda e: e.update({some_token: e[list(e)[1]]}))),
     "encoder.json"),
    ("encoder.json a token not in GPT-2 form", dict(encoder_text=enc(lambda e: e.update({" \x01": e.pop(some_token)}))),
     "encoder.json"),
    ("vocab.bpe a line of three tokens", dict(merges_text=merges + "a b c\n"), "vocab.bpe"),
    ("vocab.bpe a merge of unknown tokens", dict(merges_text=merges + "zzzz qqqq\n"), "vocab.bpe"),
    ("vocab.bpe a line without a space", dict(merges_text=merges + "abc\n"), "vocab.bpe"),
    ("vocab.bpe raw invalid UTF-8", dict(merges_text=merges.encode() + b"\xff \xfe\n"), "vocab.bpe"),
    ("tokenizer.json kind a number", dict(record='{"kind": 5}'), "tokenizer.json"),
    ("tokenizer.json kind unknown", dict(record='{"kind": "sentencepiece"}'), "tokenizer.json"),
    ("tokenizer.json a list", dict(record="[]"), "tokenizer.json"),
    ("tokenizer.json nested 100000 deep", dict(record=deep_object(100000)), "tokenizer.json"),
]
for name, parts, expect in tokenizer_variants:
    for command in ("tokenize", "generate"):
        if command == "tokenize" and expect == "tokenizer.json":
            continue  # tokenize --tokenizer gpt2:DIR reads encoder.json and vocab.bpe only
        d = case_dir()
        t = tokenizer_dir(d, **parts)
        if command == "tokenize":
            args = ["tokenize", "--input", TEXT, "--output", f"{d}/out", "--tokenizer", f"gpt2:{t}"]
        else:
            args = ["generate", "--checkpoint", RUN, "--max-new-tokens", "2", "--tokenizer", t]
        add("tokenizer", f"{command}: {name}", args, expect)

# The end-of-text id that data.document_mask splits documents at: a token of the tokenizer and a row
# of the model, never cut to 32 bits, never a string.
for name, eot in (("2^32 + 10", 2**32 + 10), ("70000", 70000), ("256 (the vocabulary's size)", 256),
                  ("a string", "10"), ("negative", -1), ("1.5", 1.5)):
    d = case_dir()
    shutil.copytree(SHARDS, f"{d}/shards")
    write(f"{d}/shards/tokenizer.json", json.dumps({"kind": "byte", "vocab_size": 256, "eot_token": eot}))
    cfg = json.loads(json.dumps(CONFIG))
    cfg["data"].update(train=f"{d}/shards/train_*.bin", val=f"{d}/shards/val_*.bin", document_mask=True)
    add("tokenizer", f"train: tokenizer.json eot_token {name}",
        ["train", "--config", write(f"{d}/config.json", json.dumps(cfg)), "--run-dir", f"{d}/run"],
        "tokenizer.json: eot_token")

for name in ("encoder.json", "vocab.bpe", "tokenizer.json"):
    for how in ("dir", "fifo", "zero", "loop"):
        for command in ("tokenize", "generate"):
            if command == "tokenize" and name == "tokenizer.json":
                continue
            d = case_dir()
            t = tokenizer_dir(d)
            replace_file(name, how)(t)
            if command == "tokenize":
                args = ["tokenize", "--input", TEXT, "--output", f"{d}/out", "--tokenizer", f"gpt2:{t}"]
            else:
                args = ["generate", "--checkpoint", RUN, "--max-new-tokens", "2", "--tokenizer", t]
            add("tokenizer", f"{command}: {name} replaced by a {how}", args, name)

# --- text inputs and outputs of tokenize -------------------------------------------------------
for name in ("a directory", "a FIFO", "a link to /dev/zero", "a link loop", "missing"):
    d = case_dir()
    path = f"{d}/input.txt"
    make_special(path, SPECIAL[name])
    add("text", f"tokenize --input {name}", ["tokenize", "--input", path, "--output", f"{d}/out"], "input.txt")
d = case_dir()
add("text", "tokenize --output an existing file",
    ["tokenize", "--input", TEXT, "--output", write(f"{d}/file", "x")], "--output")
d = case_dir()
os.mkfifo(f"{d}/fifo")
add("text", "tokenize --output a FIFO", ["tokenize", "--input", TEXT, "--output", f"{d}/fifo"], "--output")
add("text", "tokenize --output holding shards", ["tokenize", "--input", TEXT, "--output", SHARDS], "already holds")
for value in ("nan", "-1", "1", "abc", "1e400"):
    d = case_dir()
    add("text", f"tokenize --val-fraction {value}",
        ["tokenize", "--input", TEXT, "--output", f"{d}/out", "--val-fraction", value], "val-fraction")
for value in ("0", "-5", "abc", "99999999999999999999999"):
    d = case_dir()
    add("text", f"tokenize --shard-tokens {value}",
        ["tokenize", "--input", TEXT, "--output", f"{d}/out", "--shard-tokens", value], "shard-tokens")
for value in ("bpe:abc", "bpe:0", "bpe:99999999999999999999", "bpe:", "gpt2:", "gpt2:/nonexistent", "sentencepiece"):
    d = case_dir()
    add("text", f"tokenize --tokenizer {value}",
        ["tokenize", "--input", TEXT, "--output", f"{d}/out", "--tokenizer", value],
        "encoder.json" if value == "gpt2:/nonexistent" else "--tokenizer")

# --- configs and command lines -------------------------------------------------------------------
config_texts = {
    "nested 100000 deep": deep_object(100000),
    "a value nested 50000 deep": '{"model": {"vocab_size": ' + deep(50000) + "}}",
    "invalid UTF-8 in a key": b'{"mod\xffel": {}}',
    "invalid UTF-8 in a value": b'{"model": {"arch": "gp\xc3\x28"}}',
    "a NUL byte": b'{"model": {"arch": "gpt2\x00"}}',
    "not JSON": "{model: 1}",
    "a JSON list": "[1, 2, 3]",
    "empty": "",
    "a 100 kB key": '{"' + "k" * 100000 + '": 1}',
    "a key twice": '{"model": {}, "model": {}}',
    "vocab_size -1": '{"model": {"vocab_size": -1}}',
    "vocab_size 2^63": '{"model": {"vocab_size": 9223372036854775808}}',
    "vocab_size 1e300": '{"model": {"vocab_size": 1e300}}',
    "lr NaN text": '{"optim": {"lr": NaN}}',
    "an unknown section": '{"modle": {}}',
}
for name, text in config_texts.items():
    for command in ("check-config", "train", "plan"):
        d = case_dir()
        path = write(f"{d}/config.json", text)
        args = [command, "--config", path] + (["--run-dir", f"{d}/run"] if command == "train" else [])
        add("command line", f"{command}: config {name}", args, "config.json")
for name in ("a directory", "a FIFO", "a link to /dev/zero", "a link loop", "missing"):
    d = case_dir()
    path = f"{d}/config.json"
    make_special(path, SPECIAL[name])
    add("command line", f"check-config: config {name}", ["check-config", "--config", path], "config.json")

set_values = {
    "invalid UTF-8 value": b"model.arch=\xff\xfe".decode("utf-8", "surrogateescape"),
    "invalid UTF-8 key": b"mo\xffdel.arch=gpt2".decode("utf-8", "surrogateescape"),
    # (one argument holds at most 128 kB on Linux)
    "a value nested 50000 deep": "model.vocab_size=" + deep(50000),
    "an object nested 20000 deep": "model=" + deep_object(20000),
    "unclosed nesting 100000 deep": "model.arch=" + "[" * 100000,
    "a 100 kB value": "model.arch=" + "x" * 100000,
    "no equals sign": "model.arch",
    "an empty key": "=3",
    "an empty segment": "model..arch=gpt2",
    "a key through a value": "model.arch.x=1",
    "an unknown key": "model.n_layers=2",
    "vocab_size negative": "model.vocab_size=-4",
    "vocab_size a string": 'model.vocab_size="big"',
    "max_steps 2^64": "train.max_steps=18446744073709551616",
}
for name, value in set_values.items():
    for command in ("check-config", "train"):
        d = case_dir()
        args = [command, "--config", CONFIG_FILE, "--set", value] + (["--run-dir", f"{d}/run"] if command == "train" else [])
        add("command line", f"{command}: --set {name}", args, "--set" if "key" not in name or "unknown" in name else None)

d = case_dir()
add("command line", "train --run-dir an existing file",
    ["train", "--config", CONFIG_FILE, "--run-dir", write(f"{d}/file", "x")], "--run-dir")
d = case_dir()
add("command line", "train checkpoint.dir an existing file",
    ["train", "--config", CONFIG_FILE, "--run-dir", f"{d}/run", "--set", f"checkpoint.dir={write(f'{d}/file', 'x')}"],
    "checkpoint.dir")
d = case_dir()
add("command line", "export --output an existing file",
    ["export", "--checkpoint", RUN, "--output", write(f"{d}/file", "x")], "--output")
add("command line", "export --output the checkpoint's own folder", ["export", "--checkpoint", RUN, "--output", STEP],
    "overlaps")
add("command line", "export --output the run folder", ["export", "--checkpoint", RUN, "--output", RUN], "overlaps")
add("command line", "export --output the checkpoints folder",
    ["export", "--checkpoint", f"{RUN}/checkpoints", "--output", f"{RUN}/checkpoints"], "overlaps")
add("command line", "export --output inside the checkpoint", ["export", "--checkpoint", STEP, "--output", f"{STEP}/x"],
    "overlaps")
add("command line", "train --resume never into a used run folder",
    ["train", "--config", CONFIG_FILE, "--run-dir", RUN, "--resume", "never"], "already holds")
add("command line", "train --resume a missing path",
    ["train", "--config", CONFIG_FILE, "--run-dir", f"{case_dir()}/run", "--resume", "/nonexistent/ckpt"], "nonexistent")
cli_lines = [
    ["tarin"], [], ["--bogus"], ["train"], ["train", "--config"], ["eval"],
    ["generate", "--checkpoint", RUN, "--max-new-tokens", "-1"],
    ["generate", "--checkpoint", RUN, "--top-p", "2"],
    ["generate", "--checkpoint", RUN, "--temperature", "abc"],
    ["generate", "--checkpoint", RUN, "--seed", "-1x"],
    ["generate", "--checkpoint", RUN, "--prompt", "x" * 5000, "--tokenizer", SHARDS],
    ["eval", "--checkpoint", RUN, "--batches", "0"],
    ["eval", "--checkpoint", RUN, "--data", "/nonexistent/*.bin"],
    ["plan", "--config", CONFIG_FILE, "--world-size", "0"],
    ["plan", "--config", CONFIG_FILE, "--world-size", "abc"],
    ["plan", "--config", CONFIG_FILE, "--suggest", "--gpus", "-8"],
    ["plan", "--config", CONFIG_FILE, "--suggest", "--gpus", "99999999999"],
    ["plan", "--config", CONFIG_FILE, "--suggest", "--host-memory", "lots"],
    ["plan", "--config", CONFIG_FILE, "--suggest", "--ranks-per-node", "0"],
    ["export", "--checkpoint", RUN, "--output", f"{CASES}/x", "--format", "gguf"],
    ["inspect", "--checkpoint", "/nonexistent"],
    ["inspect", "--checkpoint", "/dev/null"],
    ["train", "--config", CONFIG_FILE, "--device", "tpu"],
    ["check-config", "--config", CONFIG_FILE, "--set", "a=1", "extra"],
]
for args in cli_lines:
    add("command line", "llmtrain " + " ".join(a[:40] for a in args), args, None)
# A range error names the option and the range in plain numbers.
cli_ranges = [
    (["eval", "--checkpoint", RUN, "--batches", "0"], "--batches: expected an integer >= 1, got 0"),
    (["eval", "--checkpoint", RUN, "--batches", "1.5"], "--batches: expected an integer >= 1, got 1.5"),
    (["eval", "--checkpoint", RUN, "--limit", "-2"], "--limit: expected an integer >= 1, got -2"),
    (["eval", "--checkpoint", RUN, "--tensor-parallel", "0"], "--tensor-parallel: expected an integer from 1 to 4096, got 0"),
    (["generate", "--checkpoint", RUN, "--top-k", "-3"], "--top-k: expected an integer >= 0, got -3"),
    (["generate", "--checkpoint", RUN, "--top-k", "99999999999"],
     "--top-k: expected an integer from 0 to 2147483647, got 99999999999"),
    (["generate", "--checkpoint", RUN, "--max-new-tokens", "-1"], "--max-new-tokens: expected an integer >= 0, got -1"),
    (["generate", "--checkpoint", RUN, "--temperature", "-0.5"], "--temperature: expected a number >= 0, got -0.5"),
    (["generate", "--checkpoint", RUN, "--temperature", "nan"], "--temperature: expected a number >= 0, got nan"),
    (["generate", "--checkpoint", RUN, "--top-p", "2"], "--top-p: expected a number from 0 to 1, got 2"),
    (["export", "--checkpoint", RUN, "--output", f"{CASES}/x", "--shard-gb", "0"], "--shard-gb: expected a number > 0, got 0"),
    (["plan", "--config", CONFIG_FILE, "--world-size", "0"], "--world-size: expected an integer from 1 to 1048576, got 0"),
    (["plan", "--config", CONFIG_FILE, "--ranks-per-node", "2000"],
     "--ranks-per-node: expected an integer from 1 to 1024, got 2000"),
]
for args, expect in cli_ranges:
    add("command line", "llmtrain " + " ".join(a[:40] for a in args), args, expect)

# ---------------------------------------------------------------------------------------------
# Running them.


def check(case):
    kind, name, args, expect = case
    start = time.monotonic()
    try:
        proc = subprocess.run([LLMTRAIN] + args, env=ENV, capture_output=True, timeout=TIMEOUT_S,
                              preexec_fn=limit_memory, cwd=CASES)
    except subprocess.TimeoutExpired:
        return case, f"hung: no exit within {TIMEOUT_S} s", time.monotonic() - start
    seconds = time.monotonic() - start
    err = proc.stderr.decode("utf-8", errors="replace")
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("llmtrain: error: ")]
    if proc.returncode < 0:
        return case, f"killed by signal {-proc.returncode}; stderr: {err[-500:]}", seconds
    if proc.returncode != 2:
        return case, f"exit {proc.returncode}, expected 2; stderr: {err[-500:]}", seconds
    if len(errors) != 1 or lines[-1] != errors[0]:
        return case, f"expected exactly one 'llmtrain: error:' line, last on stderr; got: {err[-800:]}", seconds
    try:
        proc.stderr.decode("utf-8")
    except UnicodeDecodeError:
        return case, f"the error line is not valid UTF-8: {proc.stderr[-300:]!r}", seconds
    if len(errors[0]) > 2200:
        return case, f"error line of {len(errors[0])} bytes (unbounded echo of input)", seconds
    if re.search(r"[0-9]{40}|1\.797693", errors[0]):
        return case, f"the error line spells out the largest double as a bound: {errors[0][:400]}", seconds
    if expect and expect not in errors[0]:
        return case, f"the error line does not name {expect!r}: {errors[0][:400]}", seconds
    return case, None, seconds


def main():
    by_kind = {}
    for kind, *_ in cases:
        by_kind[kind] = by_kind.get(kind, 0) + 1
    start = time.monotonic()
    failures = []
    slowest = (0.0, "")
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        for case, problem, seconds in pool.map(check, cases):
            slowest = max(slowest, (seconds, case[1]))
            if problem:
                failures.append((case, problem))
                print(f"FAIL [{case[0]}] {case[1]}: {problem}\n  llmtrain {' '.join(a[:80] for a in case[2])}",
                      flush=True)
    changed = sorted(k for k in set(GOOD_HASHES) | set(tree_hashes(GOOD))
                     if GOOD_HASHES.get(k) != tree_hashes(GOOD).get(k))
    # A run folder gains only logs and metrics lines when a run is refused; nothing there may change.
    for path in changed:
        print(f"FAIL good file changed: {path}", flush=True)
    elapsed = time.monotonic() - start
    summary = ", ".join(f"{kind} {n}" for kind, n in by_kind.items())
    print(f"fuzz: {len(cases)} hostile inputs ({summary}): {len(cases) - len(failures)} refused cleanly "
          f"(exit 2, one error line), {len(failures)} failed; good files changed: {len(changed)}; "
          f"{elapsed:.1f} s, slowest case {slowest[0]:.2f} s ({slowest[1]})"
          f"{'' if USE_RLIMIT else '; no RLIMIT_AS (sanitizer build)'}")
    if failures or changed:
        print(f"fuzz: files kept in {ROOT}")
        return 1
    shutil.rmtree(ROOT, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
