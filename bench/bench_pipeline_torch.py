"""PyTorch side of bench_pipeline: the same model cut into the same two stages, run by
torch.distributed.pipelining (gloo backend, two processes on this host, one thread each,
rank r on core r with --bind) with the same schedule (ScheduleGPipe or Schedule1F1B), the
same micro-batches and the same optimizer, on synthetic inputs of the same shapes.
Prints "median_step_seconds peak_rss_mib_stage0 peak_rss_mib_stage1", where a step's time
is the interval between the ends of consecutive optimizer steps (the later of the two
stages'), as bench_pipeline measures ours.

  gpt             models/gpt.h as bench_train_torch.GPT: stage 0 = the embeddings and the
                  first half of the blocks, stage 1 = the rest, ln_f and the LM head;
                  AdamW (betas 0.9, 0.99, weight decay 0.1) and the gradient norm clipped
                  to 1 over both stages, as recipes/gpt_kjv.yaml. The head is not tied to
                  the embedding (pipelining cannot share a weight between stages).
  resnet18_small  torchvision's resnet18 with the 3x3 stride-1 stem and no max-pool
                  (models/resnet.h small_input), channels-last: stage 0 = stem, layer1,
                  layer2; stage 1 = layer3, layer4, pool, fc; SGD (momentum 0.9,
                  Nesterov, weight decay 5e-4), as recipes/fmnist_cnn.yaml.

Not a project dependency: bench_pipeline calls it when torch is importable.
"""
import argparse
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_train_torch import GPT  # noqa: E402


class GPTStage(nn.Module):
    """Blocks [first, last) of a GPT; stage 0 embeds the tokens, the last stage ends in
    ln_f and the (untied) head."""

    def __init__(self, gpt, first, last, embed, head, vocab):
        super().__init__()
        self.wte = gpt.wte if embed else None
        self.wpe = gpt.wpe if embed else None
        self.h = nn.ModuleList(gpt.h[first:last])
        self.ln_f = gpt.ln_f if head else None
        self.lm_head = nn.Linear(gpt.ln_f.normalized_shape[0], vocab, bias=False) if head else None

    def forward(self, x):
        if self.wte is not None:
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1]))
        for block in self.h:
            x = block(x)
        if self.lm_head is not None:
            x = self.lm_head(self.ln_f(x))
        return x


class ChannelsLast(nn.Sequential):
    """A ResNet stage computing in channels-last layout; what it sends is contiguous
    (gloo sends only contiguous tensors)."""

    def forward(self, x):
        return super().forward(x.contiguous(memory_format=torch.channels_last)).contiguous()


def build_stages(args):
    """Both stages' modules, from one model built as every rank builds it."""
    torch.manual_seed(0)
    if args.model == "gpt":
        gpt = GPT(args.vocab, args.seq, args.width, args.layers, args.heads)
        half = args.layers // 2
        return (GPTStage(gpt, 0, half, True, False, args.vocab),
                GPTStage(gpt, half, args.layers, False, True, args.vocab))
    import torchvision

    m = torchvision.models.resnet18(num_classes=args.classes)
    m.conv1 = nn.Conv2d(args.channels, 64, 3, 1, 1, bias=False)
    m.maxpool = nn.Identity()
    stages = (ChannelsLast(m.conv1, m.bn1, m.relu, m.layer1, m.layer2),
              ChannelsLast(m.layer3, m.layer4, m.avgpool, nn.Flatten(), m.fc))
    return tuple(s.to(memory_format=torch.channels_last) for s in stages)


def inputs(args):
    g = torch.Generator().manual_seed(1)
    n = args.batch * args.micro_batches
    if args.model == "gpt":
        x = torch.randint(0, args.vocab, (n, args.seq), generator=g)
        y = torch.randint(0, args.vocab, (n, args.seq), generator=g)
        return x, y
    x = torch.randn(n, args.channels, args.size, args.size, generator=g)
    return x, torch.arange(n) % args.classes


def optimizer(args, params):
    if args.model == "gpt":
        return torch.optim.AdamW(params, lr=0.004, betas=(0.9, 0.99), weight_decay=0.1)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)


def clip_across_stages(params, max_norm):
    """The gradient norm over both stages' parameters, clipped to max_norm (as ours)."""
    sq = torch.zeros(1, dtype=torch.float64)
    for p in params:
        if p.grad is not None:
            sq += p.grad.double().pow(2).sum()
    dist.all_reduce(sq)
    scale = max_norm / (sq.sqrt().item() + 1e-6)
    if scale < 1:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)


def run(rank, args, port, results):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    if args.bind:
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    stages = build_stages(args)
    module = stages[rank]
    params = list(module.parameters())
    opt = optimizer(args, params)
    x, y = inputs(args)
    # Each stage's input and output at micro-batch size, contiguous as they travel and
    # wanting gradients (given, so no shapes are inferred at run time).
    with torch.no_grad():
        boundary = [x[: args.batch]]
        for s in stages:
            boundary.append(s(boundary[-1]).contiguous().requires_grad_())
    stage = PipelineStage(module, rank, 2, torch.device("cpu"),
                          input_args=boundary[rank], output_args=boundary[rank + 1])

    def loss_fn(out, target):
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))

    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[args.schedule]
    schedule = kind(stage, args.micro_batches, loss_fn=loss_fn)
    ends = []
    for _ in range(args.warmup + args.steps):
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=[])
        if args.model == "gpt":
            clip_across_stages(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ends.append(time.perf_counter())  # CLOCK_MONOTONIC: one clock for both processes
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    results.put((rank, ends, peak))
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=("gpt", "resnet18_small"), required=True)
    p.add_argument("--schedule", choices=("gpipe", "1f1b"), required=True)
    p.add_argument("--micro-batches", type=int, required=True)
    p.add_argument("--batch", type=int, required=True, help="micro-batch size")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=73)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--size", type=int, default=28)
    p.add_argument("--channels", type=int, default=1)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--bind", action="store_true", help="rank r on core r, as trainer launch")
    args = p.parse_args()
    if args.warmup < 1:
        p.error("--warmup must be at least 1 (the first timed step's interval starts at one)")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = 29000 + os.getpid() % 10000
    procs = [ctx.Process(target=run, args=(r, args, port, results)) for r in range(2)]
    for proc in procs:
        proc.start()
    got = {}
    while len(got) < 2 and all(proc.exitcode in (None, 0) for proc in procs):
        try:
            rank, ends, peak = results.get(timeout=1)
            got[rank] = (ends, peak)
        except Exception:  # queue.Empty: check the ranks are alive and wait on
            pass
    for proc in procs:
        proc.join()
        if proc.exitcode != 0:
            raise SystemExit(f"rank exited with {proc.exitcode}")
    step_ends = [max(a, b) for a, b in zip(got[0][0], got[1][0])]
    periods = [b - a for a, b in zip(step_ends, step_ends[1:])][args.warmup - 1:]
    print(f"{statistics.median(periods):.6f} {got[0][1]:.1f} {got[1][1]:.1f}")


if __name__ == "__main__":
    main()
