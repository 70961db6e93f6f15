"""PyTorch side of bench_dp: DistributedDataParallel (gloo backend) on the
same model, per-rank batch, input size and bucket size, one thread per rank,
channels-last, synthetic data, SGD momentum 0.9. Measures dp=1 (the plain
model) and dp=2 (two processes on this host) and prints
"scaling_efficiency hidden_fraction" where

  scaling efficiency = throughput(dp=2) / (2 x throughput(dp=1))
  hidden fraction    = allreduce time overlapping backward / allreduce time

as bench_dp computes them. The allreduce spans come from a DDP comm hook:
from the hook's call (the bucket is ready) to the completion callback of the
gloo work. Not a project dependency: bench_dp calls it when torch is importable.
"""
import os
import queue
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_train_torch import case_arguments, image_model  # noqa: E402


def build(args):
    m = image_model(args)
    if args.model == "small_cnn":
        m.drop.p = 0.0
    return m


def union(spans):
    out = []
    for b, e in sorted(spans):
        if out and b <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([b, e])
    return out


def covered(spans):
    return sum(e - b for b, e in union(spans))


def overlap(a, b):
    ua, ub, total, i, j = union(a), union(b), 0.0, 0, 0
    while i < len(ua) and j < len(ub):
        lo, hi = max(ua[i][0], ub[j][0]), min(ua[i][1], ub[j][1])
        total += max(0.0, hi - lo)
        if ua[i][1] < ub[j][1]:
            i += 1
        else:
            j += 1
    return total


def run(rank, world, args, port, results):
    if args.bind:
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    torch.set_num_threads(1)
    torch.manual_seed(rank + 1)
    model = build(args).to(memory_format=torch.channels_last)
    comm_spans = []
    if world > 1:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", rank=rank, world_size=world)

        def hook(state, bucket):
            t0 = time.perf_counter()
            buf = bucket.buffer().div_(world)
            fut = dist.all_reduce(buf, async_op=True).get_future()

            def done(f):
                comm_spans.append((t0, time.perf_counter()))
                return f.value()[0]

            return fut.then(done)

        model = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb)
        model.register_comm_hook(None, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    x = torch.randn(args.batch, args.channels, args.size, args.size).to(
        memory_format=torch.channels_last)
    y = torch.arange(args.batch) % args.classes
    times, backward_spans, timed_from = [], [], 0.0
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            if world > 1:
                dist.barrier()
            timed_from = time.perf_counter()
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x), y)
        b0 = time.perf_counter()
        loss.backward()
        backward_spans.append((b0, time.perf_counter()))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    comm = [s for s in comm_spans if s[0] >= timed_from]
    backward = [s for s in backward_spans if s[0] >= timed_from]
    hidden = overlap(comm, backward) / covered(comm) if comm else 0.0
    if rank == 0:
        results.put((statistics.median(times), hidden))
    if world > 1:
        dist.destroy_process_group()


def measure(world, args):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = 29000 + os.getpid() % 10000
    procs = [ctx.Process(target=run, args=(r, world, args, port, results)) for r in range(world)]
    for p in procs:
        p.start()
    # Poll rather than block: a rank that dies before reporting (torchvision
    # missing for ResNet-18, a failed rendezvous) must end the run, not hang it.
    out = None
    while out is None:
        try:
            out = results.get(timeout=1.0)
        except queue.Empty:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed:
                for p in procs:
                    p.terminate()
                raise SystemExit(f"rank exited with {failed[0]}")
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise SystemExit(f"rank exited with {p.exitcode}")
    return out


def main():
    p = case_arguments(steps=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--bucket-mb", type=float, default=25)
    p.add_argument("--bind", action="store_true", help="rank r on core r, as bench_dp --bind")
    args = p.parse_args()
    t1, _ = measure(1, args)
    t2, hidden = measure(2, args)
    # Same per-rank batch: efficiency = (2 b / t2) / (2 x b / t1) = t1 / t2.
    print(f"{t1 / t2:.4f} {hidden:.4f}")


if __name__ == "__main__":
    main()
