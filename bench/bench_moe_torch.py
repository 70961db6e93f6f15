"""PyTorch twin of bench_moe: the mixture-of-experts layer of layers/moe.h written here from
its rules (not imported from any library), in three modes:

  --check FILE.. each FILE a safetensors file bench_moe wrote: the layer's options (metadata),
                 its weights (param.<name>), the input x, the probe v, our output y, our
                 routing (choice [N, k]) and our gradients (grad.x, grad.<name>) of
                 loss = sum(y * v) + the auxiliary losses. The layer is rebuilt from those
                 weights in float64, run, differentiated, and compared: the routing exactly,
                 the dropped count, the auxiliary and z-losses, y and every gradient by max
                 abs difference and max abs difference / max |ours| (at most 1e-4;
                 exit status 1 when any FILE's do not agree)
  --layer FILE   the layer of FILE (weights, x, v: bench_moe's timed layer) in float32:
                 median seconds of forward + backward (input gradient included) of
                 loss = sum(y * v) + the auxiliary losses
  --gpt          a training step of a GPT whose every block's MLP is the layer (bench_moe's
                 "gpt" case), at --ep ranks (gloo): median seconds per step

The layer's rules (layers/moe.h): scores softmax(router(x)) or sigmoid, router a Linear
without bias; each token's k largest scores (ties to the lower expert) its choices, their
scores its gates (normalised to sum 1 with normalize_top_k); each expert takes at most
ceil(capacity_factor N k / E) assignments per forward, first choices before second ones, each
in token order, the rest dropped (unless dropless); expert e is c_proj(gelu(c_fc(x))) with
biases, exact or tanh GELU; y = sum over kept choices of gate * expert(x), plus the shared
experts' MLP (width shared x hidden) on every token. Auxiliary losses, added to the loss:
Switch's coef E sum_e f_e P_e (f_e the share of the N k assignments choosing e before
dropping, P_e the mean over tokens of e's score, for sigmoid the scores normalised per token
to sum 1) and the z-loss coef mean(logsumexp(logits)^2).

At --ep > 1 the ranks are forked processes (gloo on this host); rank r holds experts
[r E/ep, (r+1) E/ep) and takes batch/ep sequences; each token's rows go to the rank of
their expert and back by all_to_all_single with uneven splits (autograd both ways), the
dense gradients are averaged over the ranks by one allreduce after backward and the
experts' divided by ep (what bench_moe and the trainer do).

The timing modes print the median seconds on the last stdout line, the rest on stderr; on
failure "ERR <reason>" and exit status 1 (torch_ranks.fail).

  bench_moe_torch.py --check /tmp/check0.safetensors
  bench_moe_torch.py --gpt --ep 2 --steps 3 --warmup 1 --bind

Not a project dependency: bench_moe calls it when torch is importable.
"""
import json
import math
import os
import pickle
import re
import signal
import statistics
import struct
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_ranks import Arguments, fail, free_port  # noqa: E402
from bench_train_torch import Block  # noqa: E402

TOLERANCE = 1e-4  # of the largest |value| of our tensor

SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                      "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
                      "U8": torch.uint8, "BOOL": torch.bool}


def read_safetensors(path):
    """(tensors by name, metadata) of a safetensors file."""
    with open(path, "rb") as f:
        data = f.read()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    metadata = header.pop("__metadata__", {})
    base = 8 + length
    tensors = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        dtype = SAFETENSORS_DTYPES[entry["dtype"]]
        if end > begin:
            t = torch.frombuffer(bytearray(data[base + begin:base + end]), dtype=dtype)
        else:
            t = torch.empty(0, dtype=dtype)
        tensors[name] = t.reshape(entry["shape"]).clone()
    return tensors, metadata


def options_of(meta):
    """The layer's options from bench_moe's metadata."""
    flag = lambda key: meta.get(key, "0") == "1"  # noqa: E731
    return dict(d_model=int(meta["d_model"]), hidden=int(meta["hidden"]),
                experts=int(meta["experts"]), top_k=int(meta["top_k"]), sigmoid=flag("sigmoid"),
                normalize_top_k=flag("normalize_top_k"),
                capacity_factor=float(meta["capacity_factor"]), dropless=flag("dropless"),
                aux_loss_coef=float(meta["aux_loss_coef"]),
                z_loss_coef=float(meta["z_loss_coef"]),
                shared_experts=int(meta["shared_experts"]), bias=meta.get("bias", "1") == "1",
                gelu=meta.get("gelu", "none"))


class ExpertMLP(nn.Module):
    """x -> c_proj(gelu(c_fc(x)))."""

    def __init__(self, d_model, hidden, bias, gelu):
        super().__init__()
        self.c_fc = nn.Linear(d_model, hidden, bias=bias)
        self.c_proj = nn.Linear(hidden, d_model, bias=bias)
        self.gelu = gelu

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate=self.gelu))


class AllToAll(torch.autograd.Function):
    """Rows of dim 0, send[r] of them to rank r, recv[r] from rank r; backward the reverse."""

    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((sum(ctx.send),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None


class MoE(nn.Module):
    """The mixture-of-experts layer (see the module's docstring). forward(x) returns
    (y, auxiliary loss); the last forward's routing is in self.last."""

    def __init__(self, o, ep_rank=0, ep_size=1, group=None):
        super().__init__()
        self.o = o
        d, E = o["d_model"], o["experts"]
        self.ep_rank, self.ep_size, self.group = ep_rank, ep_size, group
        self.local = E // ep_size
        self.first = ep_rank * self.local
        self.router = nn.Linear(d, E, bias=False)
        # Every expert is built (the same draws on every rank), then another rank's dropped
        # by drop_other_ranks_experts.
        self.experts = nn.ModuleDict(
            {str(e): ExpertMLP(d, o["hidden"], o["bias"], o["gelu"]) for e in range(E)})
        self.shared_experts = (ExpertMLP(d, o["shared_experts"] * o["hidden"], o["bias"],
                                         o["gelu"]) if o["shared_experts"] > 0 else None)
        self.last = {}

    def drop_other_ranks_experts(self):
        for e in range(self.o["experts"]):
            if not self.first <= e < self.first + self.local:
                del self.experts[str(e)]

    def run_local(self, xs, counts):
        """xs sorted by local expert, counts[i] rows for expert first + i."""
        ys = [self.experts[str(self.first + i)](part)
              for i, part in enumerate(xs.split(counts)) if part.shape[0] > 0]
        if not ys:
            return xs  # no rows: the empty input stands for the output
        return ys[0] if len(ys) == 1 else torch.cat(ys)

    def run_experts(self, xs, counts):
        """xs [M, D] sorted by expert, counts [E] (tensor) -> each row through its expert."""
        if self.ep_size == 1:
            return self.run_local(xs, counts.tolist())
        n, local = self.ep_size, self.local
        send = counts.view(n, local).sum(1).tolist()
        # frm[s, e]: rows rank s sends to this rank's expert e.
        frm = torch.empty_like(counts)
        dist.all_to_all_single(frm, counts.contiguous(), group=self.group)
        frm = frm.view(n, local).tolist()
        recv = [sum(row) for row in frm]
        got = AllToAll.apply(xs, send, recv, self.group)  # by source, by expert within
        # Expert-major order of the received rows.
        perm, start = [], [sum(recv[:s]) for s in range(n)]
        for e in range(local):
            for s in range(n):
                at = start[s] + sum(frm[s][:e])
                perm.extend(range(at, at + frm[s][e]))
        perm = torch.tensor(perm, dtype=torch.int64)
        rows = [sum(frm[s][e] for s in range(n)) for e in range(local)]
        ye = self.run_local(got[perm], rows)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.numel())
        return AllToAll.apply(ye[inverse], recv, send, self.group)

    def forward(self, x):
        o = self.o
        E, k = o["experts"], o["top_k"]
        x2 = x.reshape(-1, x.shape[-1])
        N = x2.shape[0]
        logits = self.router(x2)
        probs = torch.sigmoid(logits) if o["sigmoid"] else torch.softmax(logits, dim=-1)
        # Top-k, ties to the lower expert: a stable sort keeps equal scores in index order.
        choice = torch.sort(probs.detach(), dim=1, descending=True, stable=True).indices[:, :k]
        gates = probs.gather(1, choice)
        if o["normalize_top_k"]:
            gates = gates / gates.sum(1, keepdim=True)
        if o["dropless"]:
            kept = torch.ones(N * k, dtype=torch.bool)
        else:
            capacity = math.ceil(o["capacity_factor"] * N * k / E)
            # The assignments first choices first, each in token order: a' = j N + t.
            by_choice = choice.t().reshape(-1)
            onehot = F.one_hot(by_choice, E)
            place = (onehot.cumsum(0) * onehot).sum(1)  # 1-based place at its expert
            kept = (place <= capacity).view(k, N).t().reshape(-1)  # back to a = t k + j
        slot = kept.nonzero().squeeze(1)  # kept assignments t k + j, by token
        expert_of = choice.reshape(-1)[slot]
        slot = slot[torch.sort(expert_of, stable=True).indices]  # by expert, by token within
        token = slot // k
        counts = torch.bincount(expert_of, minlength=E)
        ys = self.run_experts(x2[token], counts)
        w = gates.reshape(-1)[slot].to(ys.dtype)
        y = torch.zeros_like(x2).index_add(0, token, ys * w.unsqueeze(1))
        if self.shared_experts is not None:
            y = y + self.shared_experts(x2)
        aux = torch.zeros((), dtype=probs.dtype)
        aux_value = z_value = 0.0
        if o["aux_loss_coef"] > 0:
            chosen = torch.bincount(choice.reshape(-1), minlength=E).to(probs.dtype)
            p = probs / probs.sum(1, keepdim=True) if o["sigmoid"] else probs
            a = o["aux_loss_coef"] * E * (p.mean(0) * chosen / (N * k)).sum()
            aux, aux_value = aux + a, float(a.detach())
        if o["z_loss_coef"] > 0:
            z = o["z_loss_coef"] * (torch.logsumexp(logits, dim=1) ** 2).mean()
            aux, z_value = aux + z, float(z.detach())
        self.last = dict(choice=choice, dropped=N * k - int(kept.sum()), aux=aux_value,
                         z=z_value)
        return y.reshape(x.shape), aux


# ---- --check ----

def difference(ours, twin):
    """(max abs difference, that / max |ours|) of two tensors."""
    ours, twin = ours.double(), twin.double()
    if ours.numel() == 0:
        return 0.0, 0.0
    diff = (ours - twin).abs().max().item()
    scale = ours.abs().max().item()
    return diff, diff / scale if scale > 0 else diff


def check(path):
    """Compares bench_moe's file; prints what it found, returns whether all agree."""
    tensors, meta = read_safetensors(path)
    o = options_of(meta)
    print(f"twin {meta.get('case', path)} (float64):")
    torch.manual_seed(0)
    m = MoE(o).double()
    params = dict(m.named_parameters())
    given = sorted(n[len("param."):] for n in tensors if n.startswith("param."))
    if sorted(params) != given:
        fail(f"parameters differ: ours {given}, the twin's {sorted(params)}")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(tensors["param." + name].double())
    x = tensors["x"].double().requires_grad_()
    v = tensors["v"].double()
    y, aux = m(x)
    ((y * v).sum() + aux).backward()
    ok = True
    lines = []

    choice = m.last["choice"]
    differ = int((choice != tensors["choice"]).sum())
    dropped, ours_dropped = m.last["dropped"], int(meta["dropped"])
    ok = ok and differ == 0 and dropped == ours_dropped
    lines.append(f"routing: {differ} of {choice.numel()} choices differ; {dropped} of "
                 f"{choice.numel()} assignments dropped (ours {ours_dropped})"
                 f"{'' if differ == 0 and dropped == ours_dropped else '  DIFFERENT'}")
    for key, label in (("aux", "aux_loss"), ("z", "z_loss")):
        twin, ours = float(m.last[key]), float(meta[label])
        rel = abs(twin - ours) / abs(twin) if twin else abs(ours)
        ok = ok and rel <= TOLERANCE
        lines.append(f"{label:24s} ours {ours:.8g}, twin {twin:.8g}: rel {rel:.1e}"
                     f"{'' if rel <= TOLERANCE else '  > ' + format(TOLERANCE, '.0e')}")

    # y, grad x, then the parameters' gradients, experts grouped (the worst of them).
    compared = [("y", tensors["y"], y.detach()), ("grad x", tensors["grad.x"], x.grad)]
    for name, p in params.items():
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        compared.append((f"grad {name}", tensors["grad." + name], grad))
    groups = {}
    for label, ours, twin in compared:
        if ours.shape != twin.shape:
            fail(f"{label}: ours {tuple(ours.shape)}, the twin's {tuple(twin.shape)}")
        key = re.sub(r"experts\.\d+\.", "experts.*.", label)
        diff, rel = difference(ours, twin)
        worst = groups.get(key)
        groups[key] = (max(diff, worst[0]) if worst else diff,
                       max(rel, worst[1]) if worst else rel, (worst[2] if worst else 0) + 1)
    for key, (diff, rel, count) in groups.items():
        ok = ok and rel <= TOLERANCE
        what = f"{key} ({count})" if count > 1 else key
        lines.append(f"{what:36s} max abs {diff:.1e}  rel {rel:.1e}"
                     f"{'' if rel <= TOLERANCE else '  > ' + format(TOLERANCE, '.0e')}")
    for line in lines:
        print("    " + line)
    print(f"    ok: within {TOLERANCE:.0e} of the largest |value|" if ok else
          f"    FAILED: a difference above {TOLERANCE:.0e} of the largest |value|", flush=True)
    return ok


# ---- timings ----

def bind_to_cores(rank, threads):
    """Rank r on the allowed cores [r threads, (r + 1) threads), as bench_moe binds ours."""
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[(rank * threads + i) % len(cpus)] for i in range(threads)})


def time_layer(args):
    if args.bind:
        bind_to_cores(0, args.threads)
    torch.set_num_threads(args.threads)
    tensors, meta = read_safetensors(args.layer)
    m = MoE(options_of(meta))
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(tensors["param." + name])
    x, v = tensors["x"], tensors["v"]
    times, dropped = [], 0
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        xi = x.detach().requires_grad_()
        y, aux = m(xi)
        ((y * v).sum() + aux).backward()
        m.zero_grad(set_to_none=True)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
            dropped += m.last["dropped"]
    k = m.o["top_k"]
    print(f"bench_moe_torch --layer: torch {torch.__version__}, {x.shape[0]} tokens, "
          f"{args.threads} thread(s); dropped {100 * dropped / (x.shape[0] * k * args.steps):.2f}%"
          f" of the assignments; step seconds " + " ".join(f"{t:.4f}" for t in times),
          file=sys.stderr)
    print(f"{statistics.median(times):.6f}", flush=True)


class MoEBlock(Block):
    """bench_train_torch's pre-LN block (its attention) with the MoE layer as its MLP."""

    def __init__(self, width, heads, o):
        nn.Module.__init__(self)
        self.heads = heads
        self.ln_1 = nn.LayerNorm(width)
        self.c_attn = nn.Linear(width, 3 * width)
        self.attn_proj = nn.Linear(width, width)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = MoE(o)
        self.aux = None

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        y, self.aux = self.mlp(self.ln_2(x))
        return x + y


class MoEGPT(nn.Module):
    """models/gpt.h's GPT (tied head) with every block's MLP the MoE layer."""

    def __init__(self, a, o):
        super().__init__()
        self.wte = nn.Embedding(a.vocab, a.width)
        self.wpe = nn.Embedding(a.context, a.width)
        self.h = nn.ModuleList(MoEBlock(a.width, a.heads, o) for _ in range(a.layers))
        self.ln_f = nn.LayerNorm(a.width)
        # GPT-2's initialisation, as models/gpt.h: normal(0, 0.02), the residual
        # projections 0.02 / sqrt(2 layers), biases 0.
        g = torch.Generator().manual_seed(0)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() == 2:
                std = 0.02 / math.sqrt(2 * a.layers) if name.endswith(
                    ("attn_proj.weight", "c_proj.weight")) else 0.02
                with torch.no_grad():
                    p.normal_(0, std, generator=g)

    def forward(self, tokens):
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
        for block in self.h:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight), sum(b.aux for b in self.h)


def gpt_rank(rank, args, port):
    """This rank's timed step seconds (after a barrier), its losses and the share of its
    assignments dropped over the timed steps."""
    ep = args.ep
    if args.bind:
        bind_to_cores(rank, args.threads)
    torch.set_num_threads(args.threads)
    if ep > 1:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", rank=rank, world_size=ep)
    o = dict(d_model=args.width, hidden=args.hidden, experts=args.experts, top_k=args.top_k,
             sigmoid=False, normalize_top_k=True, capacity_factor=1.25, dropless=False,
             aux_loss_coef=0.01, z_loss_coef=0.001, shared_experts=0, bias=True, gelu="none")
    model = MoEGPT(args, o)
    for block in model.h:
        layer = block.mlp
        layer.ep_rank, layer.ep_size, layer.local = rank, ep, args.experts // ep
        layer.first = rank * layer.local
        layer.group = dist.group.WORLD if ep > 1 else None
        layer.drop_other_ranks_experts()
    dense = [p for n, p in model.named_parameters() if ".experts." not in n]
    expert = [p for n, p in model.named_parameters() if ".experts." in n]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    g = torch.Generator().manual_seed(7)
    inputs = torch.randint(0, args.vocab, (args.batch, args.context), generator=g)
    targets = torch.randint(0, args.vocab, (args.batch, args.context), generator=g)
    rows = args.batch // ep
    inputs, targets = (t[rank * rows:(rank + 1) * rows] for t in (inputs, targets))
    times, losses, dropped = [], [], 0
    for i in range(args.warmup + args.steps):
        if i == args.warmup and ep > 1:
            dist.barrier()
        t0 = time.perf_counter()
        logits, aux = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), targets.reshape(-1))
        (loss + aux).backward()
        if ep > 1:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in dense]
            flat = torch.cat([gr.reshape(-1) for gr in grads])
            dist.all_reduce(flat)
            flat /= ep
            at = 0
            for p in dense:
                p.grad = flat[at:at + p.numel()].view_as(p)
                at += p.numel()
            for p in expert:
                if p.grad is not None:
                    p.grad /= ep
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
            dropped += sum(block.mlp.last["dropped"] for block in model.h)
        losses.append(float(loss))
    if ep > 1:
        dist.destroy_process_group()
    return times, losses, dropped / (rows * args.context * args.top_k * args.layers * args.steps)


def fork_ranks(world, work, args):
    """Every rank's work(rank, args, port), by rank, each in a forked process (torch already
    imported: no second import per rank, as torch_ranks.spawn_ranks' spawned processes need;
    this process has run no torch operation, so no thread pool is forked). A rank that raises
    or dies stops the others; RuntimeError says which."""
    port = free_port()
    children = {}
    for rank in range(world):
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read_end)
            code = 0
            try:
                payload = ("done", work(rank, args, port))
            except BaseException as e:  # reported to the parent, which fails the run
                traceback.print_exc()
                payload, code = ("error", f"{type(e).__name__}: {e}"), 1
            with os.fdopen(write_end, "wb") as f:
                pickle.dump(payload, f)
            os._exit(code)
        os.close(write_end)
        children[rank] = (pid, read_end)
    got, error, running = {}, None, dict(children)
    while running and error is None:
        for rank, (pid, read_end) in list(running.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done == 0:
                continue
            del running[rank]
            with os.fdopen(read_end, "rb") as f:
                data = f.read()
            payload = pickle.loads(data) if data else None
            if payload and payload[0] == "done":
                got[rank] = payload[1]
            elif payload:
                error = f"rank {rank}: {payload[1]}"
            elif os.WIFSIGNALED(status):
                error = f"rank {rank} killed by signal {os.WTERMSIG(status)}"
            else:
                error = f"rank {rank} exited with {os.waitstatus_to_exitcode(status)}"
        if running and error is None:
            time.sleep(0.02)
    for rank, (pid, read_end) in running.items():  # the others may wait on the failed one
        os.kill(pid, signal.SIGTERM)
        os.waitpid(pid, 0)
        os.close(read_end)
    if error is not None:
        raise RuntimeError(error)
    return got


def time_gpt(args):
    if args.batch % args.ep or args.experts % args.ep:
        fail(f"--ep {args.ep} must divide --batch {args.batch} and --experts {args.experts}")
    if args.ep == 1:
        times, losses, dropped = gpt_rank(0, args, None)
    else:
        try:
            times, losses, dropped = fork_ranks(args.ep, gpt_rank, args)[0]
        except RuntimeError as e:
            fail(str(e))
    print(f"bench_moe_torch --gpt: torch {torch.__version__}, ep {args.ep} x {args.threads} "
          f"thread(s); rank 0 losses " + " ".join(f"{v:.4f}" for v in losses)
          + f"; dropped {100 * dropped:.2f}% of rank 0's assignments; step seconds "
          + " ".join(f"{t:.4f}" for t in times), file=sys.stderr)
    print(f"{statistics.median(times):.6f}", flush=True)


def main():
    p = Arguments(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", metavar="FILE", nargs="+", help="compare with bench_moe's FILEs")
    mode.add_argument("--layer", metavar="FILE", help="time the layer of FILE")
    mode.add_argument("--gpt", action="store_true", help="time the MoE GPT's training step")
    p.add_argument("--steps", type=int, default=3, help="timed steps")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    p.add_argument("--threads", type=int, default=1, help="per process")
    p.add_argument("--bind", action="store_true", help="rank r on cores [r t, (r + 1) t)")
    p.add_argument("--ep", type=int, default=1, help="gpt: expert-parallel ranks")
    p.add_argument("--layers", type=int, default=2, help="gpt")
    p.add_argument("--width", type=int, default=256, help="gpt: d_model")
    p.add_argument("--heads", type=int, default=4, help="gpt")
    p.add_argument("--context", type=int, default=256, help="gpt: sequence length")
    p.add_argument("--batch", type=int, default=8, help="gpt: global batch of sequences")
    p.add_argument("--vocab", type=int, default=256, help="gpt")
    p.add_argument("--experts", type=int, default=8, help="gpt")
    p.add_argument("--top-k", type=int, default=2, help="gpt")
    p.add_argument("--hidden", type=int, default=512, help="gpt: of each expert")
    args = p.parse_args()
    if args.steps < 1 or args.warmup < 0 or args.threads < 1 or args.ep < 1:
        fail("--steps, --threads and --ep must be at least 1, --warmup at least 0")
    if args.check:
        results = [check(path) for path in args.check]
        sys.exit(0 if all(results) else 1)
    if args.layer:
        time_layer(args)
    else:
        time_gpt(args)


if __name__ == "__main__":
    try:
        main()
    except SystemExit:
        raise
    except Exception as e:  # the failure convention for what the checks above miss
        fail(f"{type(e).__name__}: {e}")
