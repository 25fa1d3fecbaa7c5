#!/usr/bin/python3
"""Loads an `llmtrain export --format hf` folder with Hugging Face transformers and prints the
mean next-token loss of its model (GPT2LMHeadModel or LlamaForCausalLM, as config.json says) on
the first N samples of token shards, sample i being tokens [i T, i T + T] as llmtrain reads them.
Compare it with `llmtrain eval` on the same data.

Usage: check_hf_export.py --hf DIR --shards 'GLOB' --samples N
Needs: python3-torch, and transformers + safetensors from PyPI.
"""
import argparse
import glob
import json
import os

import numpy as np
import torch
from transformers import AutoModelForCausalLM


def read_tokens(paths):
    for path in sorted(paths):
        header = np.fromfile(path, dtype="<i4", count=256)
        assert header[0] == 20240520, f"{path}: not a token shard"
        dtype = "<u2" if header[1] == 1 else "<u4"
        yield np.fromfile(path, dtype=dtype, offset=1024, count=int(header[2])).astype(np.int64)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hf", required=True)
    p.add_argument("--shards", required=True)
    p.add_argument("--samples", type=int, required=True)
    a = p.parse_args()
    model = AutoModelForCausalLM.from_pretrained(a.hf, torch_dtype=torch.float32).eval()
    config = json.load(open(os.path.join(a.hf, "config.json")))
    T = config["n_positions"] if "n_positions" in config else config["max_position_embeddings"]
    samples = []
    for tokens in read_tokens(glob.glob(a.shards)):
        for i in range((len(tokens) - 1) // T):
            samples.append(tokens[i * T : i * T + T + 1])
    batch = torch.tensor(np.stack(samples[: a.samples]))
    with torch.no_grad():
        logits = model(batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
    print(f"{loss.item():.6f}")


if __name__ == "__main__":
    main()
