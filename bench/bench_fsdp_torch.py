"""PyTorch side of bench_fsdp: the memory and step time of data parallelism with and without
sharding, on the model bench_fsdp gives the trainer. --ranks processes on this host, gloo
between them, one thread each, rank r bound to core r mod cores (as `trainer launch` binds).
Models as bench_checkpoint_torch.build_model makes them:

  gpt       bench_train_torch.GPT (models/gpt.h, nanoGPT: fused c_attn, tied head), --layers x
            --width, n_head = width / 64, context 64, vocabulary --vocab; --batch sequences
            per rank; AdamW lr 1e-4
  resnet50  torchvision.models.resnet50(num_classes=1000), 4 random 3 x 28 x 28 images per
            rank; SGD lr 0.01 momentum 0.9

--mode:

  ddp    DistributedDataParallel (at one rank the plain model)
  zero2  FSDP2: torch.distributed.fsdp.fully_shard on every transformer block (every
         ResNet bottleneck), then on the root, reshard_after_forward=False (the parameters
         stay gathered from forward to backward; gradients and optimizer state sharded)
  zero3  the same with reshard_after_forward=True (FSDP2's default: ZeRO-3)

fully_shard runs at one rank too (a process group of one). --warmup steps, then --steps timed
ones (forward, cross-entropy, backward, optimizer step, zero_grad(set_to_none=True)), each
timed on rank 0 after a barrier. Memory per rank from /proc/self/status: the peak (VmHWM)
at the end, the steady resident set (VmRSS) after the last step, and the bytes of the
parameters, gradients and optimizer state this rank holds (local shards of DTensors) after
the last backward and step, before zero_grad. Bytes sent are not counted here: gloo's
reduce-scatter is an allreduce underneath, so they would not be FSDP's own.

Prints one line on stdout, "step_ms peak_mib steady_mib state_mib": rank 0's median step
time and the largest figure of any rank; the rest (configuration, per-rank figures, step
times) on stderr. On failure the exit status is 1 and the last line of stdout and stderr is
"ERR <reason>".

  bench_fsdp_torch.py --model gpt --ranks 2 --mode zero3 --layers 12 --width 768
  bench_fsdp_torch.py --model resnet50 --ranks 4 --mode ddp

Not a project dependency: bench_fsdp calls it when python3 can import torch.distributed.fsdp.
"""
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_ranks import Arguments, fail, spawn_ranks  # noqa: E402
from bench_checkpoint_torch import CONTEXT, bind_to_core, build_model  # noqa: E402

IMAGE_SIDE, CLASSES = 28, 1000


def status_mib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def local_bytes(t):
    if t is None:
        return 0
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def wrap(args, model, world):
    if args.mode == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    from torch.distributed.fsdp import fully_shard

    blocks = (list(model.h) if args.model == "gpt"
              else [b for layer in (model.layer1, model.layer2, model.layer3, model.layer4)
                    for b in layer])
    reshard = args.mode == "zero3"
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    return model


def measure(rank, args, port):
    bind_to_core(rank)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    model = wrap(args, build_model(args), args.ranks)
    g = torch.Generator().manual_seed(1 + rank)
    if args.model == "gpt":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x = torch.randint(0, args.vocab, (args.batch, CONTEXT), generator=g)
        y = torch.randint(0, args.vocab, (args.batch, CONTEXT), generator=g)
        loss_of = lambda: F.cross_entropy(model(x).reshape(-1, args.vocab), y.reshape(-1))
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        x = torch.randn(args.batch, 3, IMAGE_SIDE, IMAGE_SIDE, generator=g)
        y = torch.randint(0, CLASSES, (args.batch,), generator=g)
        loss_of = lambda: F.cross_entropy(model(x), y)
    times, state = [], 0
    for step in range(args.warmup + args.steps):
        if args.ranks > 1:
            dist.barrier()
        t0 = time.perf_counter()
        loss_of().backward()
        opt.step()
        last = step == args.warmup + args.steps - 1
        if last:
            state = sum(local_bytes(p) + local_bytes(p.grad) for p in model.parameters())
            state += sum(local_bytes(v) for s in opt.state.values() for v in s.values()
                         if torch.is_tensor(v))
        opt.zero_grad(set_to_none=True)
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    steady = status_mib("VmRSS")
    dist.destroy_process_group()
    return times, status_mib("VmHWM"), steady, state / (1 << 20)


def main():
    p = Arguments(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("gpt", "resnet50"), required=True)
    p.add_argument("--ranks", type=int, default=1, help="processes (1)")
    p.add_argument("--mode", choices=("ddp", "zero2", "zero3"), required=True)
    p.add_argument("--steps", type=int, default=4, help="timed steps (4)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (2)")
    p.add_argument("--batch", type=int, default=0, help="per rank (gpt 2 sequences, resnet50 4)")
    p.add_argument("--layers", type=int, default=12, help="gpt: blocks (12)")
    p.add_argument("--width", type=int, default=768, help="gpt: d_model (768)")
    p.add_argument("--vocab", type=int, default=73, help="gpt: vocabulary (73, KJV's chars)")
    args = p.parse_args()
    args.batch = args.batch or (2 if args.model == "gpt" else 4)
    if min(args.ranks, args.steps, args.warmup, args.batch) < 1:
        fail("--ranks, --steps, --warmup and --batch must be at least 1")
    print(f"bench_fsdp_torch: torch {torch.__version__}, {args.model}, {args.mode}, "
          f"{args.ranks} rank(s) x 1 thread, batch {args.batch} per rank", file=sys.stderr,
          flush=True)
    try:
        got = spawn_ranks(args.ranks, measure, args)
    except RuntimeError as e:
        fail(str(e))
    for rank in sorted(got):
        times, peak, steady, state = got[rank]
        print(f"rank {rank}: steps {' '.join(f'{1e3 * t:.1f}' for t in times)} ms; peak "
              f"{peak:.1f} MiB, steady {steady:.1f} MiB, state {state:.1f} MiB", file=sys.stderr)
    figures = [got[r] for r in sorted(got)]
    print(f"{1e3 * statistics.median(figures[0][0]):.1f} {max(f[1] for f in figures):.1f} "
          f"{max(f[2] for f in figures):.1f} {max(f[3] for f in figures):.1f}", flush=True)


if __name__ == "__main__":
    main()
