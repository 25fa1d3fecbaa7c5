#!/usr/bin/python3
"""Plots loss, val_loss, learning rate and throughput of one or more runs, side by side.

Usage: plot_metrics.py RUN_DIR [RUN_DIR ...] [--out metrics.png]
Reads RUN_DIR/metrics.jsonl of each run (as llmtrain train writes it) and writes one PNG with four
panels; each run is one line, labelled by its folder name. Needs matplotlib (python3-matplotlib).
"""
import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read_metrics(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    try:
        lines = open(path).read().splitlines()
    except OSError as e:
        sys.exit(f"plot_metrics: error: {path}: {e.strerror}")
    series = {"loss": [], "val_loss": [], "lr": [], "tokens_per_s": []}
    for number, line in enumerate(lines, 1):
        try:
            m = json.loads(line)
        except json.JSONDecodeError:
            print(f"plot_metrics: warning: {path}:{number}: not JSON, skipped", file=sys.stderr)
            continue
        for key in series:
            if m.get(key) is not None:
                series[key].append((m["step"], m[key]))
    return series


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--out", default="metrics.png")
    a = p.parse_args()
    panels = [("loss", "train loss (nats)"), ("val_loss", "validation loss (nats)"), ("lr", "learning rate"),
              ("tokens_per_s", "tokens / s")]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for run in a.runs:
        series = read_metrics(run)
        label = os.path.basename(os.path.normpath(run))
        for ax, (key, title) in zip(axes.flat, panels):
            if series[key]:
                steps, values = zip(*series[key])
                ax.plot(steps, values, label=label, marker="o" if key == "val_loss" else None, markersize=3)
            ax.set_title(title)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
    for ax in axes.flat:
        if ax.lines:
            ax.legend()
    fig.tight_layout()
    fig.savefig(a.out, dpi=100)
    print(f"plot_metrics: wrote {a.out}")


if __name__ == "__main__":
    main()
