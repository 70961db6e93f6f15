"""PyTorch side of bench_checkpoint: what a torch.distributed.checkpoint (DCP) checkpoint
blocks training for, on the model bench_checkpoint gives the trainer. --ranks processes on
this host, gloo between them, one thread each, rank r bound to core r mod cores (as
`trainer launch` binds); the model wrapped in DistributedDataParallel beyond one rank. Two
optimizer steps on random data first, so the optimizer state exists. Models:

  gpt       bench_train_torch.GPT (models/gpt.h, nanoGPT: fused c_attn, tied head),
            --layers x --width, n_head = width / 64, context 64, vocabulary --vocab (73: the
            distinct characters of datasets/kjv.txt, the trainer's char vocabulary); one
            sequence per rank; AdamW (two moments per parameter)
  resnet50  torchvision.models.resnet50(num_classes=1000) (3 input channels, as the trainer
            reads bench_checkpoint's images), 4 images of 28 x 28 per rank; SGD momentum 0.9
            (one buffer per parameter)

The state is {"model": ..., "optim": ...} from
torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer). Each of these is
measured --repeats times (median), every rank starting together after a barrier, each into
a new checkpoint directory under --dir (removed at the end):

  sync   how long torch.distributed.checkpoint.save(state, checkpoint_id=dir) blocks: the
         plan, every rank's files written and fsynced (FileSystemWriter's default), the
         metadata committed
  async  how long torch.distributed.checkpoint.async_save(state, checkpoint_id=dir) blocks
         until it returns its future (the default stager's copy of the state into host
         memory; the write runs in a background thread); then the future is waited on,
         which also gives the whole background write's time (stderr only)

Prints one line on stdout, "sync_ms async_ms mib_per_rank": rank 0's median blocked times
and the bytes of the files DCP wrote divided by --ranks (DCP writes a replicated tensor
once, from one rank). The rest goes to stderr: the configuration, every repeat's times,
get_state_dict's time, rank 0's own files' bytes and the background writes' times. On
failure the exit status is 1 and the last line of both stdout and stderr is "ERR <reason>".

  bench_checkpoint_torch.py --model gpt --ranks 2 --layers 12 --width 768 --dir /tmp/x
  bench_checkpoint_torch.py --model resnet50 --ranks 1 --dir /tmp/x --repeats 1

Not a project dependency: bench_checkpoint calls it when python3 can import
torch.distributed.checkpoint.
"""
import os
import shutil
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_ranks import Arguments, fail, spawn_ranks  # noqa: E402
from bench_train_torch import GPT  # noqa: E402

CONTEXT = 64  # bench_checkpoint's model.context and data.seq_len
IMAGE_SIDE, IMAGE_BATCH, CLASSES = 28, 4, 1000  # bench_checkpoint's images, per-rank batch


def build_model(args):
    """The model, the same on every rank."""
    torch.manual_seed(0)
    if args.model == "gpt":
        return GPT(args.vocab, CONTEXT, args.width, args.layers, max(1, args.width // 64))
    import torchvision

    return torchvision.models.resnet50(num_classes=CLASSES)


def train_two_steps(args, model):
    """The optimizer, after two steps on random data: its state (AdamW's moments, SGD's
    momentum buffers) is allocated by the first."""
    g = torch.Generator().manual_seed(1)
    if args.model == "gpt":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x = torch.randint(0, args.vocab, (1, CONTEXT), generator=g)
        y = torch.randint(0, args.vocab, (1, CONTEXT), generator=g)
        loss_of = lambda: F.cross_entropy(model(x).reshape(-1, args.vocab), y.reshape(-1))
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        x = torch.randn(IMAGE_BATCH, 3, IMAGE_SIDE, IMAGE_SIDE, generator=g)
        y = torch.randint(0, CLASSES, (IMAGE_BATCH,), generator=g)
        loss_of = lambda: F.cross_entropy(model(x), y)
    for _ in range(2):
        loss_of().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return opt


def bind_to_core(rank):
    """Rank r on allowed core r mod cores, as trainer launch binds one-thread ranks."""
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[rank % len(cpus)]})


def barrier(world):
    if world > 1:
        dist.barrier()


def wait_for(future):
    """async_save returns a Future, or (with some stagers) an AsyncSaveResponse holding one
    for the upload."""
    upload = getattr(future, "upload_completion", future)
    upload.result()


def dir_bytes(path, prefix=""):
    """Bytes of the files under path whose names start with prefix."""
    return sum(os.path.getsize(os.path.join(root, name))
               for root, _, names in os.walk(path) for name in names if name.startswith(prefix))


def measure(rank, args, port):
    """This rank's {sync, async, background, state_dict} lists of seconds and, on rank 0,
    (all files' bytes, rank 0's files' bytes) of the first synchronous checkpoint."""
    world = args.ranks
    bind_to_core(rank)
    torch.set_num_threads(1)
    if world > 1:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", rank=rank, world_size=world)
    model = build_model(args)
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    opt = train_two_steps(args, model)
    times = {"sync": [], "async": [], "background": [], "state_dict": []}
    for i in range(args.repeats):
        t0 = time.perf_counter()
        model_state, optim_state = get_state_dict(model, opt)
        times["state_dict"].append(time.perf_counter() - t0)
        state = {"model": model_state, "optim": optim_state}
        barrier(world)
        t0 = time.perf_counter()
        dcp.save(state, checkpoint_id=f"{args.dir}/sync_{i}")
        times["sync"].append(time.perf_counter() - t0)
        barrier(world)
        t0 = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=f"{args.dir}/async_{i}")
        times["async"].append(time.perf_counter() - t0)
        wait_for(future)
        times["background"].append(time.perf_counter() - t0)
    barrier(world)  # every rank's files are in before rank 0 counts them
    sizes = (dir_bytes(f"{args.dir}/sync_0"), dir_bytes(f"{args.dir}/sync_0", "__0_"))
    if world > 1:
        dist.destroy_process_group()
    return times, sizes


def run_ranks(args):
    """Every rank's measure(), by rank; fails the run when a rank fails."""
    try:
        return spawn_ranks(args.ranks, measure, args)
    except RuntimeError as e:
        fail(str(e))


def report(args, times, sizes):
    """stderr: every repeat's figures; stdout: the result line."""
    ms = lambda values: " ".join(f"{1e3 * v:.1f}" for v in values)
    mib = 1 << 20
    print(f"rank 0, ms per repeat: save {ms(times['sync'])}; async_save returned after "
          f"{ms(times['async'])}, its write done after {ms(times['background'])}; "
          f"get_state_dict {ms(times['state_dict'])}", file=sys.stderr)
    print(f"files: {sizes[0] / mib:.1f} MiB in all, rank 0's {sizes[1] / mib:.1f} MiB; "
          f"median background write {1e3 * statistics.median(times['background']):.1f} ms",
          file=sys.stderr)
    print(f"{1e3 * statistics.median(times['sync']):.1f} "
          f"{1e3 * statistics.median(times['async']):.1f} "
          f"{sizes[0] / args.ranks / mib:.1f}", flush=True)


def main():
    p = Arguments(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("gpt", "resnet50"), required=True)
    p.add_argument("--ranks", type=int, default=1, help="processes (1)")
    p.add_argument("--dir", required=True, help="work directory; checkpoints go in a new "
                   "directory under it, removed at the end")
    p.add_argument("--repeats", type=int, default=3, help="measurements of each kind (3)")
    p.add_argument("--layers", type=int, default=12, help="gpt: blocks (12)")
    p.add_argument("--width", type=int, default=768, help="gpt: d_model (768)")
    p.add_argument("--vocab", type=int, default=73, help="gpt: vocabulary (73, KJV's chars)")
    args = p.parse_args()
    if args.ranks < 1 or args.repeats < 1:
        fail("--ranks and --repeats must be at least 1")
    if args.model == "gpt" and args.width % max(1, args.width // 64):
        fail(f"--width {args.width} is not a multiple of its heads, width / 64")
    os.makedirs(args.dir, exist_ok=True)
    args.dir = os.path.join(args.dir, f"dcp_{args.model}_{args.ranks}_{os.getpid()}")
    shape = (f"{args.layers} x {args.width}, context {CONTEXT}, vocab {args.vocab}, AdamW"
             if args.model == "gpt" else f"{CLASSES} classes, SGD momentum")
    print(f"bench_checkpoint_torch: torch {torch.__version__}, {args.model} ({shape}), "
          f"{args.ranks} rank(s) x 1 thread, {args.repeats} repeats", file=sys.stderr, flush=True)
    try:
        got = run_ranks(args)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    times, sizes = got[0]
    report(args, times, sizes)


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # the failure convention for what the checks above miss
        fail(f"{type(e).__name__}: {e}")
