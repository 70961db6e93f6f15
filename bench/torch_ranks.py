"""What the PyTorch sides of the multi-rank benchmarks share: their ranks as spawned
processes (gloo on this host), and the failure convention bench/*.cpp parse.

    got = spawn_ranks(world, work, args)   # {rank: work(rank, args, port)}; RuntimeError on failure
    fail("no torchvision")                      # "ERR no torchvision", exit 1

work(rank, args, port), a module-level function, runs in each process: it joins the
process group at 127.0.0.1:port and returns the rank's figures, a tuple.
Not a project dependency: only the *_torch.py benchmark scripts import it.
"""
import argparse
import queue
import socket
import sys
import traceback

import torch.multiprocessing as mp


def fail(reason):
    """The failure convention: "ERR <reason>" on one line, last on stdout and stderr; exit 1."""
    line = "ERR " + " ".join(str(reason).split())
    print(line, file=sys.stderr, flush=True)
    print(line, flush=True)
    sys.exit(1)


class Arguments(argparse.ArgumentParser):
    """argparse whose errors follow the failure convention."""

    def error(self, message):
        self.print_usage(sys.stderr)
        fail(f"arguments: {message}")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(work, rank, args, port, results):
    """A rank's process: its figures, or the reason it failed, onto results."""
    try:
        results.put(("done", rank, *work(rank, args, port)))
    except Exception as e:  # reported to the parent, which fails the run
        traceback.print_exc()
        results.put(("error", rank, f"{type(e).__name__}: {e}"))
        sys.exit(1)


def spawn_ranks(world, work, args):
    """Every rank's work(), by rank. A rank that raises or dies without a word (a signal:
    the OOM killer?) stops the others and raises RuntimeError saying which."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(work, r, args, port, results))
             for r in range(world)]
    for proc in procs:
        proc.start()
    got, error = {}, None
    while len(got) < world and error is None:
        try:
            kind, rank, *payload = results.get(timeout=1)
        except queue.Empty:
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:
                rank, code = dead[0]
                error = (f"rank {rank} killed by signal {-code}" if code < 0
                         else f"rank {rank} exited with {code}")
            continue
        if kind == "error":
            error = f"rank {rank}: {payload[0]}"
        else:
            got[rank] = payload
    if error is not None:
        for proc in procs:  # the others may wait on the failed one in a collective
            if proc.is_alive():
                proc.terminate()
    for proc in procs:
        proc.join()
    if error is not None:
        raise RuntimeError(error)
    return got
