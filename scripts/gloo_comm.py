#!/usr/bin/env python3
"""torch.distributed over gloo on the ops and sizes of `zrun bench comm`, to
set beside it in one sitting (2 ranks on this host by default):

    python3 scripts/gloo_comm.py [--world 2] [--sizes 64MiB,256MiB]

Bus bandwidth follows nccl-tests (and zrun bench comm): all_reduce
algbw*2(n-1)/n, reduce_scatter and all_gather algbw*(n-1)/n. Each figure is the
median over calls of the slowest rank, after a warm-up call, with a barrier
before each call; outputs are allocated before the clock starts. Needs torch
(e.g. the peers' venv).
"""
import argparse
import datetime
import os
import queue
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def parse(size):
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for u, f in units.items():
        if size.endswith(u):
            return int(size[: -len(u)]) * f
    return int(size)


def rank_main(rank, world, sizes, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # gloo's own deadline for the rendezvous and every collective (its
    # default is 30 minutes).
    timeout = datetime.timedelta(seconds=120)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    rows = []
    for op in ["all_reduce", "reduce_scatter", "all_gather"]:
        for nbytes in sizes:
            n = nbytes // 4
            chunk = n // world
            x = torch.ones(n)
            outs = [torch.empty(chunk) for _ in range(world)]
            mine = torch.ones(chunk)
            out1 = torch.empty(chunk)

            def call():
                if op == "all_reduce":
                    dist.all_reduce(x)
                elif op == "reduce_scatter":
                    # gloo has no reduce_scatter_tensor; reduce_scatter of a list
                    # is what torch offers on CPU.
                    dist.reduce_scatter(out1, list(x.chunk(world)))
                else:
                    dist.all_gather(outs, mine)

            try:
                call()
            except RuntimeError as e:
                rows.append((op, nbytes, None, str(e).splitlines()[0]))
                continue
            times = []
            deadline = time.perf_counter() + 1.0
            while len(times) < 3 or (time.perf_counter() < deadline and len(times) < 20):
                dist.barrier()
                t = time.perf_counter()
                call()
                times.append(time.perf_counter() - t)
            slowest = torch.tensor(times)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            secs = statistics.median(slowest.tolist())
            factor = 2 * (world - 1) / world if op == "all_reduce" else (world - 1) / world
            rows.append((op, nbytes, nbytes / secs / 1e9 * factor, None))
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--sizes", default="64MiB,256MiB")
    a = p.parse_args()
    sizes = [parse(s) for s in a.sizes.split(",")]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    # A port the kernel says is free now (29500 + pid % 1000 collided once
    # and the ranks waited forever).
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    procs = [ctx.Process(target=rank_main, args=(r, a.world, sizes, port, out)) for r in range(a.world)]
    for pr in procs:
        pr.start()
    try:
        rows = out.get(timeout=600)
    except queue.Empty:
        rows = None
    for pr in procs:
        pr.join(timeout=60 if rows is not None else 0)
    # A rank still running at its deadline (once, a rank waited in gloo for
    # a quarter of an hour): stopped here, or the interpreter would wait
    # for it at exit.
    for pr in procs:
        if pr.is_alive():
            pr.kill()
    if rows is None:
        sys.exit("gloo_comm: no result within 10 minutes; the ranks were stopped")
    print(f"{'op':<16}{'bytes':>12}{'workers':>9}  transport  busbw_GB/s")
    for op, nbytes, bw, err in rows:
        shown = f"{bw:.3f}" if bw is not None else f"unsupported: {err}"
        print(f"{op:<16}{nbytes:>12}{a.world:>9}  gloo       {shown}")


if __name__ == "__main__":
    main()
