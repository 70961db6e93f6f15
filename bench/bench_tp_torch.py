"""PyTorch side of bench_tp: a few training steps of one model on synthetic data in one of
three layouts on this host, gloo between the processes, rank r on core r with --bind:

  tp      2 processes, 1 thread each: Megatron-style tensor parallelism by
          torch.distributed.tensor.parallel (parallelize_module over DeviceMesh("cpu", [0, 1]));
          every rank runs the whole batch
  dp      2 processes, 1 thread each: DistributedDataParallel, each rank half the batch
  single  1 process, 2 threads (cores 0 and 1 with --bind), the whole batch

--batch is the global batch. Models and what tp shards:

  gpt  models/gpt.h as bench_train_torch.GPT (nanoGPT: fused c_attn, tied head), token ids
       [batch, seq] of --vocab, cross-entropy; AdamW lr 1e-3 (torch's defaults otherwise:
       betas 0.9, 0.999, weight decay 0.01), no clipping. tp shards, in every block, c_attn
       column-wise by whole heads (its rows reordered from [q | k | v] to each rank's heads'
       [q k v], so a rank's contiguous shard is n_head / 2 heads' q, k and v), attn_proj
       (nanoGPT attn.c_proj) row-wise, c_fc column-wise and mlp_proj (mlp.c_proj) row-wise;
       the token embedding by vocabulary rows (RowwiseParallel on nn.Embedding), and with it
       the tied LM head, whose logits stay sharded by vocabulary into a loss_parallel()
       cross-entropy. Replicated: the position embedding, the LayerNorms and the row-wise
       layers' biases. No sequence parallelism: activations between the sharded pairs are
       whole on both ranks.
  mlp  a wide MLP: --layers residual pairs x + down(gelu(up(x))), up Linear(width, 4 width),
       down Linear(4 width, width), input and random target [batch, width], MSE loss; SGD lr
       0.01 (no momentum). tp shards every up column-wise and every down row-wise; the downs'
       biases are replicated.

Prints one line on stdout, "median_step_seconds peak_rss_mib": the median over the timed
steps of the interval between the ends of consecutive optimizer steps (the later rank's),
and the largest rank's peak RSS. The rest goes to stderr: the configuration, each rank's
parameters held (tp: about half), rank 0's losses (tp's match single's: the same model, data
and initial weights) and the timed steps' intervals. On failure the exit status is 1 and
the last line of both stdout and stderr is "ERR <reason>".

  bench_tp_torch.py --model gpt --layout tp --bind
  bench_tp_torch.py --model mlp --layout dp --width 512 --steps 4 --warmup 2

Not a project dependency: bench_tp calls it when torch is importable.
"""
import contextlib
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_ranks import Arguments, fail, spawn_ranks  # noqa: E402
from bench_train_torch import GPT, Block  # noqa: E402

# Processes and threads per process of each --layout.
WORLD = {"tp": 2, "dp": 2, "single": 1}
THREADS = {"tp": 1, "dp": 1, "single": 2}


class WideMLP(nn.Module):
    """--layers residual pairs x + down(gelu(up(x))): up width -> 4 width, down back."""

    def __init__(self, width, layers):
        super().__init__()
        self.up = nn.ModuleList(nn.Linear(width, 4 * width) for _ in range(layers))
        self.down = nn.ModuleList(nn.Linear(4 * width, width) for _ in range(layers))

    def forward(self, x):
        for up, down in zip(self.up, self.down):
            x = x + down(F.gelu(up(x)))
        return x


class HeadShardedBlock(Block):
    """A GPT block whose attention runs only its rank's heads: c_attn's (local) output is
    [q k v] of heads // world heads (see group_qkv_by_rank) and attn_proj takes their
    concatenated outputs, its row-wise shard's input."""

    def __init__(self, block, world):
        nn.Module.__init__(self)
        for name, child in block.named_children():
            setattr(self, name, child)
        self.heads = block.heads // world

    def attn(self, x):
        B, T, _ = x.shape
        q, k, v = self.c_attn(x).chunk(3, dim=2)
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.attn_proj(y.transpose(1, 2).reshape(B, T, -1))


def group_qkv_by_rank(c_attn, world):
    """Reorders c_attn's output rows from [q | k | v] to [q0 k0 v0 | q1 k1 v1 | ...], qr kr vr
    the rows of rank r's heads, so that ColwiseParallel's contiguous shard of rank r holds its
    heads' queries, keys and values. The same weights, permuted: the model computes the same."""
    width = c_attn.in_features
    order = torch.arange(3 * width).view(3, world, width // world).transpose(0, 1).reshape(-1)
    with torch.no_grad():
        c_attn.weight.copy_(c_attn.weight[order])
        c_attn.bias.copy_(c_attn.bias[order])


def parallelize(model, args, mesh):
    """The tp layout's sharding of model (see the module's docstring), in place."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleOutput,
                                                   RowwiseParallel, parallelize_module)

    world = mesh.size()
    if args.model == "mlp":
        plan = {"up.*": ColwiseParallel(), "down.*": RowwiseParallel()}
        return parallelize_module(model, mesh, plan)
    for i, block in enumerate(model.h):
        group_qkv_by_rank(block.c_attn, world)
        model.h[i] = HeadShardedBlock(block, world)
    plan = {
        "h.*.c_attn": ColwiseParallel(),
        "h.*.attn_proj": RowwiseParallel(),
        "h.*.c_fc": ColwiseParallel(),
        "h.*.mlp_proj": RowwiseParallel(),
        # Vocabulary-parallel: each rank looks up the ids in its rows, the sum all-reduced.
        "wte": RowwiseParallel(input_layouts=Replicate()),
        # ln_f's output as a replicated DTensor, so that GPT.forward's tied head
        # F.linear(ln_f(x), wte.weight) yields logits sharded by vocabulary.
        "ln_f": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Replicate(),
                                    use_local_output=False),
    }
    return parallelize_module(model, mesh, plan)


def build_model(args):
    """The model, the same on every rank."""
    torch.manual_seed(0)
    if args.model == "gpt":
        return GPT(args.vocab, args.seq, args.width, args.layers, args.heads)
    return WideMLP(args.width, args.layers)


def batch_of(args, rank, world):
    """This rank's inputs and targets: rows [rank b / world, (rank + 1) b / world) of the
    global batch for dp, all of it otherwise."""
    g = torch.Generator().manual_seed(1)
    if args.model == "gpt":
        x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        y = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    else:
        x = torch.randn(args.batch, args.width, generator=g)
        y = torch.randn(args.batch, args.width, generator=g)
    if args.layout != "dp":
        return x, y
    rows = args.batch // world
    return x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]


def loss_of(args, model, x, y):
    if args.model == "gpt":
        logits = model(x)
        return F.cross_entropy(logits.reshape(-1, args.vocab), y.reshape(-1))
    return F.mse_loss(model(x), y)


def optimizer(args, model):
    if args.model == "gpt":
        return torch.optim.AdamW(model.parameters(), lr=1e-3)
    return torch.optim.SGD(model.parameters(), lr=0.01)


def held_parameters(model):
    """(held here, in the model) element counts of the sharded and of the replicated
    parameters."""
    from torch.distributed.tensor import DTensor, Shard

    counts = {"sharded": [0, 0], "replicated": [0, 0]}
    for p in model.parameters():
        sharded = isinstance(p, DTensor) and any(isinstance(s, Shard) for s in p.placements)
        local = p.to_local() if isinstance(p, DTensor) else p
        counts["sharded" if sharded else "replicated"][0] += local.numel()
        counts["sharded" if sharded else "replicated"][1] += p.numel()
    return counts


def describe_parameters(rank, counts):
    held = sum(c[0] for c in counts.values())
    total = sum(c[1] for c in counts.values())
    sharded, replicated = counts["sharded"], counts["replicated"]
    return (f"rank {rank}: holds {held / 1e6:.3f}M of the model's {total / 1e6:.3f}M parameters"
            f" (sharded {sharded[0] / 1e6:.3f}M of {sharded[1] / 1e6:.3f}M,"
            f" replicated {replicated[0] / 1e6:.3f}M)")


def bind_to_cores(rank, threads):
    """Rank r on the allowed cores [r threads, (r + 1) threads), as trainer launch binds."""
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[(rank * threads + i) % len(cpus)] for i in range(threads)})


def train(rank, args, port):
    """This rank's optimizer-step end times (perf_counter: CLOCK_MONOTONIC, one clock for
    all processes), its peak RSS in MiB, its losses and its held_parameters()."""
    world, threads = WORLD[args.layout], THREADS[args.layout]
    if args.bind:
        bind_to_cores(rank, threads)
    torch.set_num_threads(threads)
    if world > 1:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", rank=rank, world_size=world)
    model = build_model(args)
    step_context = contextlib.nullcontext
    if args.layout == "tp":
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor.parallel import loss_parallel

        model = parallelize(model, args, DeviceMesh("cpu", list(range(world))))
        if args.model == "gpt":
            step_context = loss_parallel  # logits sharded by vocabulary; backward in it too
    elif args.layout == "dp":
        model = nn.parallel.DistributedDataParallel(model)
    counts = held_parameters(model)
    opt = optimizer(args, model)
    x, y = batch_of(args, rank, world)
    ends, losses = [], []
    for _ in range(args.warmup + args.steps):
        with step_context():
            loss = loss_of(args, model, x, y)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ends.append(time.perf_counter())
        losses.append(loss.detach())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    losses = [float(v.full_tensor() if hasattr(v, "full_tensor") else v) for v in losses]
    if world > 1:
        dist.destroy_process_group()
    return ends, peak, losses, counts


def run_ranks(args):
    """Every rank's (ends, peak, losses, parameter counts), by rank; fails the run when a
    rank fails."""
    try:
        return spawn_ranks(WORLD[args.layout], train, args)
    except RuntimeError as e:
        fail(str(e))


def main():
    p = Arguments(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("gpt", "mlp"), required=True)
    p.add_argument("--layout", choices=tuple(WORLD), required=True)
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    p.add_argument("--layers", type=int, help="gpt: blocks (6); mlp: residual pairs (4)")
    p.add_argument("--width", type=int, help="gpt: d_model (384); mlp: features (2048)")
    p.add_argument("--batch", type=int, help="global batch; gpt: sequences (8), mlp: rows (64)")
    p.add_argument("--heads", type=int, default=6, help="gpt")
    p.add_argument("--seq", type=int, default=256, help="gpt: context and sequence length")
    p.add_argument("--vocab", type=int, default=256, help="gpt")
    p.add_argument("--bind", action="store_true", help="rank r on core r, as trainer launch")
    args = p.parse_args()
    defaults = {"gpt": (6, 384, 8), "mlp": (4, 2048, 64)}[args.model]
    for name, value in zip(("layers", "width", "batch"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, value)
    world = WORLD[args.layout]
    if args.warmup < 1:
        fail("--warmup must be at least 1 (the first timed step's interval starts at one)")
    if args.steps < 1:
        fail("--steps must be at least 1")
    if args.layout == "dp" and args.batch % world:
        fail(f"--batch {args.batch}: dp splits it over {world} ranks; use a multiple of {world}")
    if args.model == "gpt" and args.width % args.heads:
        fail(f"--width {args.width} is not a multiple of --heads {args.heads}")
    if args.layout == "tp" and args.model == "gpt" and args.heads % world:
        fail(f"--heads {args.heads}: tp gives each of {world} ranks whole heads; use a multiple")
    if args.layout == "tp" and args.model == "mlp" and args.width % world:
        fail(f"--width {args.width}: tp splits 4 x width over {world} ranks evenly; use a multiple")
    shape = (f"layers {args.layers} width {args.width} heads {args.heads} seq {args.seq} "
             f"vocab {args.vocab}" if args.model == "gpt" else
             f"layers {args.layers} width {args.width}")
    print(f"bench_tp_torch: torch {torch.__version__}, {args.model} ({shape}), global batch "
          f"{args.batch}, layout {args.layout}: {world} process(es) x {THREADS[args.layout]} "
          f"thread(s){', bound' if args.bind else ''}; {args.warmup} warm-up + {args.steps} timed "
          f"steps", file=sys.stderr, flush=True)
    got = run_ranks(args)
    for rank in range(world):
        print(describe_parameters(rank, got[rank][3]), file=sys.stderr)
    losses = got[0][2]
    print(f"rank 0 losses{' (its half of the batch)' if args.layout == 'dp' else ''}: "
          + " ".join(f"{v:.4f}" for v in losses), file=sys.stderr)
    step_ends = [max(ends) for ends in zip(*(got[r][0] for r in range(world)))]
    periods = [b - a for a, b in zip(step_ends, step_ends[1:])][args.warmup - 1:]
    print("timed step seconds: " + " ".join(f"{v:.4f}" for v in periods), file=sys.stderr)
    peak = max(got[r][1] for r in range(world))
    print(f"{statistics.median(periods):.6f} {peak:.1f}", flush=True)


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # the failure convention for what the checks above miss
        fail(f"{type(e).__name__}: {e}")
