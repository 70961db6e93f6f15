#!/usr/bin/env python3
"""Draws test accuracy against wall time for the runs of scripts/ps_compare.sh
(each a folder with metrics.jsonl and start_time), one curve per run, one
panel per worker count.

    python3 scripts/plot_ps.py runs/ps_compare --out runs/ps_compare/accuracy_vs_time.png

Needs matplotlib (pip install -r bench/requirements.txt); not needed to
build, train or test.
"""
import argparse
import json
import os
import sys


def curve(run):
    """(seconds since the run started, top-1 %) of each evaluation."""
    with open(os.path.join(run, "start_time")) as f:
        start = float(f.read())
    points = []
    with open(os.path.join(run, "metrics.jsonl")) as f:
        for line in f:
            record = json.loads(line)
            if record.get("split") == "val" and "top1" in record:
                points.append((record["time"] - start, record["top1"]))
    return sorted(points)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="the OUT folder of scripts/ps_compare.sh")
    parser.add_argument("--out", required=True, help="the PNG to write")
    args = parser.parse_args()
    runs = sorted(
        name for name in os.listdir(args.folder)
        if os.path.exists(os.path.join(args.folder, name, "metrics.jsonl")))
    if not runs:
        sys.exit(f"error: no runs (folders with metrics.jsonl) under {args.folder}")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = sorted({int(name.split("_")[0]) for name in runs})
    fig, axes = plt.subplots(1, len(counts), figsize=(6 * len(counts), 4.5), squeeze=False)
    for ax, workers in zip(axes[0], counts):
        for name in runs:
            if int(name.split("_")[0]) != workers:
                continue
            points = curve(os.path.join(args.folder, name))
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                        label=name.split("_", 1)[1])
        ax.set_title(f"{workers} workers")
        ax.set_xlabel("wall time (s)")
        ax.set_ylabel("test top-1 (%)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Fashion-MNIST CNN: parameter servers (bsp, asp, ssp) and allreduce")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
