#!/usr/bin/env python3
"""Turns a scripts/bench.sh result directory into results.md (one markdown
table per benchmark, each with the command that produced it, what "faster"
means and the side-by-side ratio) and, when matplotlib is installed, the
figures allreduce.png (bus bandwidth against message size, ours and
OpenMPI's) and dp_scaling.png (data-parallel scaling efficiency, ours and
PyTorch DDP's).

    python3 scripts/bench_report.py bench/results/2026-11-25-1a2b3c4

The directory holds meta.txt ("key: value" lines: date, commit, machine,
load) and, per benchmark NAME, raw/NAME.cmd (the commands, one a line) and
raw/NAME.txt (their output). Only the standard library is needed for the
tables.
"""
import math
import os
import re
import sys

NUM = r"([0-9]+(?:\.[0-9]+)?)"


def read(path):
    with open(path) as f:
        return f.read()


def meta_of(root):
    meta = {}
    for line in read(os.path.join(root, "meta.txt")).splitlines():
        key, _, value = line.partition(": ")
        meta[key] = value
    return meta


def commands(root, name):
    return [c for c in read(os.path.join(root, "raw", name + ".cmd")).splitlines() if c]


def table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return out


def ratio(a, b):
    return f"**{a / b:.2f}x**" if a > b else f"{a / b:.2f}x"


# ---- bench_train: "case batch thr | ours peak-MiB | torch peak-MiB | ratio (range) |
#      GFLOP/s of-peak torch-GF/s", the row of medians after its rounds' lines
TRAIN_ROW = re.compile(
    rf"^(\S+)\s+(\d+)\s+(\d+) \|\s+{NUM}\s+(\d+) \|\s+(?:{NUM}\s+(\d+)|-\s+-) \|"
    rf"\s+(-|{NUM}x(?: \({NUM}-{NUM}\))?)\s+\|\s+{NUM}\s+{NUM}%\s+(\S+)")
TRAIN_PEAK = re.compile(rf"^peak over the run: matmul (\S+) {NUM} GFLOP/s at (\d+) thread")


def train_ratio(median, low, high):
    if median is None:
        return "-"
    text = ratio(float(median), 1.0)
    return text + (f" ({low}-{high})" if low else "")


def train_section(text):
    rows, peaks = [], []
    for line in text.splitlines():
        p = TRAIN_PEAK.match(line)
        if p:
            peaks.append(f"{p.group(1)} {p.group(2)} GFLOP/s at {p.group(3)} thread(s)")
        m = TRAIN_ROW.match(line)
        if not m:
            continue
        (case, batch, threads, ours, ours_mib, torch, torch_mib, _, median, low, high, gflops,
         of_peak, torch_gflops) = m.groups()
        unit = "tokens/s" if case in ("gpt", "llama", "lstm_lm") else "samples/s"
        rows.append([case, batch, threads, f"{float(ours):.1f} {unit}",
                     f"{float(torch):.1f}" if torch else "-", train_ratio(median, low, high),
                     f"{gflops} ({of_peak}%)", torch_gflops, f"{ours_mib} / {torch_mib or '-'}"])
    lines = ["Training step (forward, backward, SGD with momentum) on synthetic data: each",
             "side's median over the rounds (ours and PyTorch alternate). **Faster** = more",
             "samples (tokens) per second; the ratio is the median of the rounds' ours /",
             "PyTorch (> 1: ours is faster) with its range. GFLOP/s = 3 x forward FLOPs x",
             "steps/s, in brackets as a share of our matmul's peak"
             + (" (" + "; ".join(peaks) + ")" if peaks else "") + ".", ""]
    return lines + table(["case", "batch", "threads", "ours", "PyTorch", "ours / PyTorch",
                          "ours GFLOP/s (of peak)", "PyTorch GFLOP/s",
                          "peak MiB ours / PyTorch"], rows), rows


# ---- bench_dp: median rows "case batch | dp1 dp2 | eff comm bwd hidden exposed | pair ... | torch eff hidden"
DP_ROW = re.compile(
    rf"^(\S+)\s+(\d+) \|\s+{NUM}\s+{NUM} \|\s+{NUM}%\s+{NUM}\s+{NUM}\s+{NUM}%\s+{NUM}% \|"
    rf"\s+{NUM}%\s+{NUM}%\s+{NUM}%\s+{NUM}% \|\s+(?:{NUM}%\s+{NUM}%|-\s+-)")
DP_ROUND = re.compile(rf"^\s+round (\d+)\s+(\d+) \|\s+{NUM}\s+{NUM} \|\s+{NUM}%")


def dp_parse(text):
    cases, rounds, current = [], {}, []
    for line in text.splitlines():
        r = DP_ROUND.match(line)
        if r:
            current.append(float(r.group(5)))
            continue
        m = DP_ROW.match(line)
        if m:
            g = m.groups()
            cases.append({"case": g[0], "batch": g[1], "dp1": float(g[2]), "dp2": float(g[3]),
                          "eff": float(g[4]), "exposed": float(g[8]), "pair": float(g[9]),
                          "sync": float(g[11]),
                          "torch": float(g[13]) if g[13] else None})
            rounds[len(cases) - 1] = current
            current = []
    return cases, rounds


def dp_section(text):
    cases, rounds = dp_parse(text)
    rows = []
    for i, c in enumerate(cases):
        per_round = ", ".join(f"{x:.1f}" for x in rounds.get(i, []))
        rows.append([c["case"], c["batch"], f"{c['dp1']:.1f}", f"{c['dp2']:.1f}",
                     f"{c['eff']:.1f}%" + (f" ({per_round})" if per_round else ""),
                     f"{c['pair']:.1f}%", f"{c['sync']:.1f}%", f"{c['exposed']:.1f}%",
                     f"{c['torch']:.1f}%" if c["torch"] is not None else "-",
                     ratio(c["eff"], c["torch"]) if c["torch"] else "-"])
    lines = ["Two data-parallel ranks against one (one thread per rank, same per-rank batch).",
             "**Efficiency** = samples/s at dp=2 / (2 x samples/s at dp=1): 100% is perfect",
             "scaling, higher is better. *Pair* is two independent dp=1 processes at once (what",
             "the machine allows any two ranks), *sync* the same pair joined by a barrier per",
             "step (what lock step alone costs), *exposed* the share of the dp=2 step spent",
             "waiting for gradients. The ratio is our efficiency / PyTorch DDP's (gloo),",
             "measured in the same run; medians of the rounds (each round in brackets).", ""]
    return lines + table(["case", "batch/rank", "dp=1 samples/s", "dp=2 samples/s", "efficiency",
                          "pair", "sync", "exposed", "PyTorch DDP", "ours / DDP"], rows), cases


# ---- bench_allreduce: "bytes count | us algbw busbw cpu | mpi us algbw busbw | speedup won"
AR_ROW = re.compile(
    rf"^\s+(\d+)\s+(\d+) \|\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM} \|"
    rf"(?:\s+{NUM}\s+{NUM}\s+{NUM} \|\s+{NUM}x\s+(\d+)/(\d+))?")


def human_bytes(n):
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n // size} {unit}"
    return f"{n} B"


def allreduce_parse(text):
    sizes = []
    for line in text.splitlines():
        m = AR_ROW.match(line)
        if m:
            g = m.groups()
            sizes.append({"bytes": int(g[0]), "us": float(g[2]), "busbw": float(g[4]),
                          "mpi_us": float(g[6]) if g[6] else None,
                          "mpi_busbw": float(g[8]) if g[8] else None,
                          "won": f"{g[10]}/{g[11]}" if g[10] else "-"})
    bound = re.search(rf"copy bound: single-thread memcpy {NUM} GB/s", text)
    return sizes, float(bound.group(1)) if bound else None


def allreduce_section(text):
    sizes, bound = allreduce_parse(text)
    rows = [[human_bytes(s["bytes"]), f"{s['us']:.1f}",
             f"{s['mpi_us']:.1f}" if s["mpi_us"] else "-",
             ratio(s["mpi_us"], s["us"]) if s["mpi_us"] else "-", s["won"],
             f"{s['busbw']:.2f}"] for s in sizes]
    lines = ["f32 sum allreduce over 2 ranks on this host, each size timed by ours and then",
             "at once by OpenMPI's `MPI_Allreduce` (mpirun), best of the rounds.",
             "**Faster** = less time per allreduce; the speedup is OpenMPI's time / ours",
             "(> 1: ours is faster), *won* the rounds ours was faster. busbw = bytes x",
             "2(n-1)/n / time, comparable with nccl-tests."
             + (f" Copy bound (single-thread memcpy): {bound:.2f} GB/s." if bound else ""), ""]
    return lines + table(["bytes", "ours us", "OpenMPI us", "speedup", "won", "ours busbw GB/s"],
                         rows), (sizes, bound)


# ---- bench_matmul: "case M K N thr ms GFLOP/s %peak"
def matmul_section(text):
    rows = []
    pattern = re.compile(rf"^(.+?)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+{NUM}\s+{NUM}\s+{NUM}%$")
    for line in text.splitlines():
        m = pattern.match(line)
        if m:
            name, M, K, N, thr, ms, gflops, peak = m.groups()
            rows.append([name, f"{M} x {K} x {N}", thr, gflops, f"{peak}%"])
    peak = re.search(r"^fp32 peak per core = (.*)$", text, re.M)
    lines = ["f32 matmul through the op layer (oneDNN). No peer is run: the figure is",
             "GFLOP/s and its share of this CPU's fp32 peak"
             + (f" ({peak.group(1)})." if peak else "."), ""]
    return lines + table(["case", "M x K x N", "threads", "GFLOP/s", "of peak"], rows), rows


# ---- bench_loader: per-thread images per CPU second, ours and torchvision's
def loader_section(text):
    rows = []
    block = None
    for line in text.splitlines():
        if line.startswith("ImageNet train"):
            block = "train transforms"
        elif line.startswith("ImageNet eval"):
            block = "eval transforms"
        elif line.startswith("Fashion-MNIST train"):
            block = "Fashion-MNIST"
        elif line.startswith("Python"):
            block = "torchvision"
        m = re.search(rf"one thread, .* -> {NUM} images per CPU second", line)
        if m:
            rows.append([f"ours, {block}, one thread", m.group(1)])
        m = re.search(rf"Loader, (\d+) worker\(s\): {NUM} images/s wall .* {NUM} images per CPU",
                      line)
        if m:
            rows.append([f"ours, {block}, Loader with {m.group(1)} worker(s)",
                         f"{m.group(3)} ({m.group(2)} images/s wall)"])
        m = re.search(rf"^\s+(.+), 1 thread: {NUM} images/s wall, {NUM} images per CPU", line)
        if m:
            rows.append([f"{m.group(1)}, train transforms, one thread", m.group(3)])
    lines = ["Decoding and augmenting generated 500x375 JPEGs (ImageNet transforms) and",
             "Fashion-MNIST. **Faster** = more images per CPU second (the figure that",
             "holds on a loaded machine); torchvision's PIL pipeline runs on the same files",
             "in the same run when it is installed.", ""]
    return lines + table(["pipeline", "images per CPU second"], rows), rows


# ---- bench_pipeline: "case sched M | step pred meas/pred verdict pred-of-means | bubble pred |
#      F0 B0 F1 B1 | torch torch/ours" and, below, the memory rows
#      "case sched | in flight | act MiB | RSS | torch RSS" (s0 s1 each)
PP_ROW = re.compile(
    rf"^(\S+)\s+(\S+)\s+(\d+) \|\s+{NUM}\s+{NUM}\s+{NUM} (ok|off by \S+)\s+{NUM} \|"
    rf"\s+{NUM}%\s+{NUM}% \|(?:\s+[0-9.]+){{4}} \|\s+(?:{NUM}\s+{NUM}|-\s+-)\s*$")
PP_MEMORY = re.compile(
    r"^(\S+)\s+(\S+)\s+\|\s+(\d+(?: \(W \d+\))?)\s+(\d+(?: \(W \d+\))?) \|\s+(\S+)\s+(\S+) \|"
    r"\s+(\d+)\s+(\d+) \|\s+(\S+)\s+(\S+)\s*$")


def pipeline_section(text):
    runs, memory = [], {}
    for line in text.splitlines():
        m = PP_ROW.match(line)
        if m:
            g = m.groups()
            runs.append({"case": g[0], "schedule": g[1], "micro_batches": g[2],
                         "ms": float(g[3]), "pred_ms": float(g[4]), "verdict": g[6],
                         "bubble": float(g[8]), "pred_bubble": float(g[9]),
                         "torch_ms": float(g[10]) if g[10] else None,
                         "torch_ratio": float(g[11]) if g[11] else None})
        m = PP_MEMORY.match(line)
        if m:
            g = m.groups()
            memory[g[0], g[1]] = {"in_flight": f"{g[2]} / {g[3]}", "rss": f"{g[6]} / {g[7]}",
                                  "torch_rss": f"{g[8]} / {g[9]}" if g[8] != "-" else "-"}
    rows = []
    for run in runs:
        mem = memory.get((run["case"], run["schedule"]), {})
        rows.append([run["case"], run["schedule"], run["micro_batches"], f"{run['ms']:.1f}",
                     f"{run['pred_ms']:.1f} ({run['verdict']})",
                     f"{run['bubble']:.1f}% / {run['pred_bubble']:.1f}%",
                     f"{run['torch_ms']:.1f}" if run["torch_ms"] else "-",
                     ratio(run["torch_ratio"], 1.0) if run["torch_ms"] else "-",
                     mem.get("in_flight", "-"), mem.get("rss", "-"), mem.get("torch_rss", "-")])
    cases = [f"- {line.strip()}" for line in text.splitlines()
             if re.match(r"^  (gpt|resnet18_small): ", line)]
    lines = ["Pipeline parallelism, 2 stages (`trainer launch`, one thread per rank), each",
             "schedule's median step read back from the trainer's trace. **Faster** = less",
             "time per optimizer step; the speedup is PyTorch's time / ours (> 1: ours is",
             "faster), PyTorch running the same stages, micro-batches and optimizer under",
             "torch.distributed.pipelining (gloo; no zero-bubble schedule, so zbh1 has no",
             "peer) in the same run. *Predicted* is the schedule simulated from the measured",
             "forward, backward and optimizer spans (ok: within 10% of the measured step);",
             "*bubble* the stages' idle share, measured / predicted. *In flight* (the",
             "micro-batches whose activations a stage holds at peak; zbh1's \"W n\" counts",
             "until the weight half) and peak RSS are stage 0 / stage 1.", ""]
    if cases:
        lines += cases + [""]
    return lines + table(["case", "schedule", "micro-batches", "ours ms", "predicted ms",
                          "bubble", "PyTorch ms", "speedup", "in flight",
                          "peak RSS MiB", "PyTorch peak RSS MiB"], rows), runs


# ---- bench_tp: "case layout | step ms items/s | bytes/step analytic ratio | torch ms torch/ours"
TP_ROW = re.compile(
    rf"^(\S+)\s+(tp=2|tp=1 \(2 threads\)|dp=2)\s+\|\s+{NUM}\s+{NUM} \|"
    rf"\s+(\d+|-)\s+(\d+|-)\s+(\S+) \|\s+(.+?)\s+(\S+)\s*$")


def tp_section(text):
    runs = []
    for line in text.splitlines():
        m = TP_ROW.match(line)
        if m:
            g = m.groups()
            torch = re.fullmatch(NUM, g[7]) and float(g[7])
            runs.append({"case": g[0], "layout": g[1], "ms": float(g[2]), "items": float(g[3]),
                         "bytes": g[4], "analytic": g[5], "bytes_ratio": g[6],
                         "torch_ms": torch or None,
                         "torch_ratio": float(g[8].rstrip("x")) if torch else None,
                         # why PyTorch did not run, "(...)", kept whole but for table bars
                         "torch_note": g[7].replace("|", "/") if not torch else None})
    rows = []
    for run in runs:
        unit = "tokens/s" if run["case"] == "gpt" else "rows/s"
        bytes_cell = "-" if run["bytes"] == "-" else \
            f"{run['bytes']} / {run['analytic']} ({run['bytes_ratio']})"
        rows.append([run["case"], run["layout"], f"{run['ms']:.1f}",
                     f"{run['items']:.0f} {unit}",
                     f"{run['torch_ms']:.1f}" if run["torch_ms"] else run["torch_note"],
                     ratio(run["torch_ratio"], 1.0) if run["torch_ms"] else "-",
                     bytes_cell])
    shapes = re.search(r"^gpt: .*$", text, re.M)
    lines = ["Tensor parallelism against the other ways of giving one model two cores:",
             "tp=2 (two ranks, one thread each, Megatron-style split, each rank the whole",
             "batch), tp=1 (one process, two threads) and dp=2 (two ranks, half the batch",
             "each). **Faster** = less time per optimizer step (median, rank 0); the",
             "speedup is PyTorch's time / ours for the same layout (> 1: ours is faster),",
             "PyTorch running torch.distributed.tensor.parallel, one process with two",
             "threads and DDP (gloo) in the same run. *Bytes* are what rank 0 handed to the",
             "tensor-parallel collectives per step / the analytic count (ratio)."
             + (f" Shapes: {shapes.group(0)}." if shapes else ""), ""]
    return lines + table(["case", "layout", "ours ms", "ours throughput", "PyTorch ms",
                          "speedup", "bytes/step / analytic"], rows), runs


# ---- bench_checkpoint: the step blocked by a checkpoint, sync and async, ours and DCP's
def checkpoint_section(text):
    rows, model = [], "?"
    row = re.compile(rf"^(\d+)\s+\|\s+{NUM}\s+\|\s+{NUM}\s+{NUM}\s+\|\s+{NUM}%\s+\|"
                     rf"\s+{NUM}\s+{NUM}\s+{NUM}\s+\|\s+(\S+)\s+(\S+)\s+(\S+)$")
    for line in text.splitlines():
        m = re.match(r"^(gpt|resnet50): (.*?),", line)
        if m:
            model = m.group(2)
            continue
        m = row.match(line)
        if m:
            ranks, mib, sync_ms, async_ms, pct, ours, plain, r, dcp_sync, dcp_async, dcp_r = m.groups()
            rows.append([model, ranks, mib, sync_ms, async_ms, f"{pct}%", ours, plain, r,
                         dcp_sync, dcp_async, dcp_r])
    lines = ["The step blocked by a checkpoint (rank 0's, median over the run's checkpoints),",
             "written synchronously and in the background, against PyTorch DCP's save and",
             "async_save of the same state; write bandwidth against plain writes with fsync.", ""]
    return lines + table(["model", "ranks", "MiB/rank", "sync ms", "async ms", "async/sync",
                          "sync MiB/s", "plain MiB/s", "ratio", "DCP save ms",
                          "DCP async_save ms", "ours/DCP async"], rows), rows


# ---- bench_fsdp: memory and step time of each shard mode, ours and DDP / FSDP2's
def fsdp_section(text):
    rows, model = [], "?"
    row = re.compile(rf"^(\d+)\s+(\S+)\s+\|\s+{NUM}\s+{NUM}\s+{NUM}\s+(\S+)\s+\|"
                     rf"\s+(\S+)\s+(\S+)\s+(\S+)\s+\|\s+(\S+)\s+(\S+)$")
    for line in text.splitlines():
        m = re.match(r"^(gpt|resnet50): (.*?);", line)
        if m:
            model = m.group(2).split(",")[0]
            continue
        m = row.match(line)
        if m:
            rows.append([model, *m.groups()])
    lines = ["Rank 0's step time and memory under each parallel.shard (none, ZeRO-1, -2, -3),",
             "against PyTorch DDP and FSDP2 (fully_shard, gloo) on the same model in the same run;",
             "*peak* is the tensors' peak (ours) and VmHWM (resident, both); *comm* is the",
             "median comm_mib of rank 0's steps: the bus bytes its collectives moved per step,",
             "counted by the trainer.", ""]
    return lines + table(["model", "ranks", "shard", "ms", "peak MiB", "resident MiB",
                          "comm MiB", "torch ms", "torch peak MiB", "torch steady MiB",
                          "torch/ours ms", "torch/ours resident"], rows), rows


SECTIONS = {
    "train": ("Training step vs PyTorch", train_section),
    "dp": ("Data-parallel scaling", dp_section),
    "allreduce": ("Allreduce vs OpenMPI", allreduce_section),
    "matmul": ("Matmul", matmul_section),
    "loader": ("Data pipeline", loader_section),
    "pipeline": ("Pipeline parallelism vs PyTorch", pipeline_section),
    "tp": ("Tensor parallelism vs PyTorch", tp_section),
    "checkpoint": ("Checkpoints vs PyTorch DCP", checkpoint_section),
    "fsdp": ("Sharded data parallelism vs PyTorch FSDP2", fsdp_section),
}


def stamp(meta):
    """Date, commit and load average of a run, for figure titles: a figure
    taken on a busy machine says so."""
    load = meta.get("load before", "?").split(" ")[0]
    return f"{meta.get('date', '?')}, {meta.get('commit', '?')}, load average {load}"


def plot_allreduce(sizes, bound, meta, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.2))
    x = [s["bytes"] for s in sizes]
    ax.plot(x, [s["busbw"] for s in sizes], "o-", label="ours")
    if any(s["mpi_busbw"] for s in sizes):
        ax.plot(x, [s["mpi_busbw"] or math.nan for s in sizes], "s--", label="OpenMPI")
    if bound:
        ax.axhline(bound, color="grey", linestyle=":", label=f"memcpy bound {bound:.1f} GB/s")
    ax.set_xscale("log", base=2)
    ax.set_xticks(x)
    ax.set_xticklabels([human_bytes(b).replace(" ", "") for b in x], rotation=45)
    ax.set_xlabel("message size")
    ax.set_ylabel("bus bandwidth, GB/s (higher is better)")
    ax.set_title(f"Allreduce, 2 ranks, one host ({stamp(meta)})", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_dp(cases, meta, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.2))
    labels = [f"{c['case']}\nbatch {c['batch']}/rank" for c in cases]
    series = [("ours", "eff"), ("PyTorch DDP", "torch"), ("two independent ranks", "pair")]
    width = 0.8 / len(series)
    for k, (name, key) in enumerate(series):
        values = [c[key] if c[key] is not None else 0 for c in cases]
        bars = ax.bar([i + (k - 1) * width for i in range(len(cases))], values, width, label=name)
        ax.bar_label(bars, fmt="%.0f%%", fontsize=8)
    ax.axhline(100, color="grey", linestyle=":")
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels(labels)
    ax.set_ylim(0, 125)
    ax.set_ylabel("dp=2 scaling efficiency, % (higher is better)")
    ax.set_title(f"Data parallelism, 2 ranks ({stamp(meta)})", fontsize=10)
    ax.legend(loc="upper center", ncol=3, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    root = sys.argv[1]
    meta = meta_of(root)
    out = [f"# Benchmarks, {meta.get('date', '?')}", "",
           f"Commit `{meta.get('commit', '?')}`; {meta.get('machine', '?')}; load average "
           f"{meta.get('load before', '?')} before, {meta.get('load after', '?')} after;"
           f" {meta.get('peers', '')}", ""]
    if meta.get("mode") == "quick":
        out += ["Quick mode: the smallest sizes, a check that every benchmark runs; these",
                "figures are not meaningful.", ""]
    parsed = {}
    for name, (title, section) in SECTIONS.items():
        if not os.path.exists(os.path.join(root, "raw", name + ".txt")):
            continue
        lines, data = section(read(os.path.join(root, "raw", name + ".txt")))
        parsed[name] = data
        out += [f"## {title}", "", "```sh"] + commands(root, name) + ["```", ""] + lines + [
            "", f"Raw output: `raw/{name}.txt`.", ""]
    figures = []
    try:
        if parsed.get("allreduce") and parsed["allreduce"][0]:
            plot_allreduce(*parsed["allreduce"], meta, os.path.join(root, "allreduce.png"))
            figures.append("allreduce.png")
        if parsed.get("dp"):
            plot_dp(parsed["dp"], meta, os.path.join(root, "dp_scaling.png"))
            figures.append("dp_scaling.png")
    except ImportError:
        print("bench_report: matplotlib not found, no figures (pip install -r bench/requirements.txt)")
    out += [f"![{f}]({f})" for f in figures]
    with open(os.path.join(root, "results.md"), "w") as f:
        f.write("\n".join(out).rstrip() + "\n")
    print(f"bench_report: wrote {os.path.join(root, 'results.md')}"
          + (f" and {', '.join(figures)}" if figures else ""))


if __name__ == "__main__":
    main()
