#!/usr/bin/env python3
"""Draws a run's metrics.jsonl as curves in one PNG: training and validation
loss, validation accuracy (top-1/top-5, or bits per character for language
models), throughput, and the learning rate (for a mixture-of-experts run,
the load of its most loaded expert over the mean, in place of the learning
rate when any run of the figure has one).

    python3 scripts/plot_run.py runs/fmnist_cnn                 # writes runs/fmnist_cnn/curves.png
    python3 scripts/plot_run.py runs/a runs/b --out cmp.png     # several runs on the same axes
    python3 scripts/plot_run.py runs/x/metrics.jsonl --smooth 20

Needs matplotlib (pip install -r bench/requirements.txt); not needed to
build, train or test.
"""
import argparse
import json
import os
import sys


def load(path):
    """The records of one run: {"train": [...], "val": [...]}, each sorted by step."""
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    records = {"train": [], "val": []}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                sys.exit(f"plot_run: {path}:{number}: not JSON ({e.msg}); is it a metrics.jsonl?")
            records.setdefault(record.get("split", "train"), []).append(record)
    for split in records.values():
        split.sort(key=lambda r: r["step"])
    if not records["train"] and not records["val"]:
        sys.exit(f"plot_run: {path} has no records")
    return records


def series(records, key):
    points = [(r["step"], r[key]) for r in records if key in r]
    return [p[0] for p in points], [p[1] for p in points]


def expert_load(records):
    """Per record with moe_imbalance.<layer>: the largest expert's load over
    the mean, the most unbalanced layer's."""
    points = []
    for r in records:
        worst = [v for k, v in r.items() if k.startswith("moe_imbalance.")]
        if worst:
            points.append((r["step"], 1 + max(worst)))
    return [p[0] for p in points], [p[1] for p in points]


def smooth(values, window):
    """Trailing mean over `window` records (1: unchanged)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run directories or metrics.jsonl files")
    parser.add_argument("--out", help="PNG to write (default: <first run>/curves.png)")
    parser.add_argument("--smooth", type=int, default=1,
                        help="trailing mean over this many training records")
    parser.add_argument("--title", help="figure title (default: the run names)")
    args = parser.parse_args()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("plot_run: matplotlib not found (pip install -r bench/requirements.txt)")

    runs = [(os.path.basename(os.path.normpath(p.removesuffix("metrics.jsonl"))) or p, load(p))
            for p in args.runs]
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.5))
    loss_ax, acc_ax, speed_ax, lr_ax = axes.flat
    moe = any(expert_load(records["train"])[0] for _, records in runs)
    for name, records in runs:
        label = (lambda what: f"{name} {what}") if len(runs) > 1 else (lambda what: what)
        train, val = records["train"], records["val"]
        steps, loss = series(train, "loss")
        line, = loss_ax.plot(steps, smooth(loss, args.smooth), lw=1, label=label("train"))
        steps, loss = series(val, "loss")
        loss_ax.plot(steps, loss, "o-", color=line.get_color(), label=label("validation"))
        if any("top1" in r for r in val):
            for key, style in (("top1", "o-"), ("top5", "s--")):
                acc_ax.plot(*series(val, key), style, label=label(key))
            acc_ax.set_ylabel("validation accuracy, %")
        else:
            for key, what in (("bits_per_char", "character"), ("bits_per_token", "token")):
                if any(key in r for r in val):
                    acc_ax.plot(*series(val, key), "o-", label=label(f"bits per {what}"))
                    acc_ax.set_ylabel(f"validation bits per {what}")
        unit = "tokens_per_second" if any("tokens_per_second" in r for r in train) else \
            "samples_per_second"
        speed_ax.plot(*series(train, unit), lw=1, label=label(unit.replace("_", " ")))
        speed_ax.set_ylabel(unit.replace("_per_second", "/s"))
        if moe:
            if expert_load(train)[0]:
                lr_ax.plot(*expert_load(train), lw=1, color=line.get_color(),
                           label=label("most loaded expert / mean"))
        else:
            lr_ax.plot(*series(train, "lr"), lw=1, label=label("learning rate"))
    loss_ax.set_ylabel("loss")
    if moe:
        lr_ax.axhline(2.0, color="gray", ls="--", lw=1)
        lr_ax.set_ylabel("expert load, largest / mean")
    else:
        lr_ax.set_ylabel("learning rate")
    for ax in axes.flat:
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=8)
    fig.suptitle(args.title or ", ".join(name for name, _ in runs))
    fig.tight_layout()
    out = args.out or os.path.join(args.runs[0] if os.path.isdir(args.runs[0])
                                   else os.path.dirname(args.runs[0]) or ".", "curves.png")
    fig.savefig(out, dpi=100)
    print(f"plot_run: wrote {out}")


if __name__ == "__main__":
    main()
